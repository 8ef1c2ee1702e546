"""An optional compiled build of the simulator's hot path (mypyc), used only when it matches the
sources exactly.

Why: a 48P96D run of the full 64K dataset is ~31M events through Python-level bookkeeping
(flows, engines, the scheduler's placement); interpreted, that is ~16 minutes of one core on a
slow host. mypyc compiles the same, unchanged modules — ``sim``'s event loop, flows, engines,
cluster, statistics and workload, the scheduler core's placement, policy and state, and the
prefill batcher (``services.compute_model``) —
into C extensions whose classes keep their attributes in C structs: ~2.3× faster, with
bit-identical results (``tests/test_sim_accel.py`` compares a compiled run with an interpreted
one, field by field). The scheduler code is still imported from ``services.scheduler.core``, never
copied: the build compiles those very files.

How it is used:

* ``dualpath sim-accel build`` (``make sim-accel``) compiles into
  ``$DUALPATH_SIM_ACCEL_DIR`` (default ``~/.cache/dualpath/sim-accel``)``/<digest>/``, where the
  digest covers every ``.py`` of ``sim/``, ``services/scheduler/core/`` and
  ``services/compute_model/`` and the interpreter's ABI.
  Needs ``mypy`` (the ``accel`` extra) and a C compiler. Nothing is written beside the sources;
  the cache keeps the newest ``KEEP_BUILDS`` builds (~2 MB each).
* ``enable()`` runs when ``sim`` is first imported. It installs an import hook that loads the
  compiled modules, if a build for the current digest exists. Any edit to a source file changes
  the digest, so a stale build is never loaded. ``DUALPATH_SIM_ACCEL``: ``auto`` (default, use a
  build if there is one), ``0`` (never), ``1`` (require; an ``AccelError`` says why not).
* All or nothing: if any compiled module is already imported as Python (a process that imported
  ``services.scheduler.core`` before ``sim``), nothing is accelerated. A half-compiled set would have
  compiled code meet interpreted instances of classes it expects to be native.

``status()`` says what happened; the simulator's JSON and ``dualpath bench sim`` report it.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

MODULES = ("sim.events", "sim.flows", "sim.stats", "sim.workload", "sim.engines", "sim.cluster",
           "services.scheduler.core.state", "services.scheduler.core.policy",
           "services.compute_model.batching", "services.scheduler.core.scheduler")
GROUP = "dualpath_sim"                   # mypyc's shared library: ``dualpath_sim__mypyc``
ENV_MODE = "DUALPATH_SIM_ACCEL"
ENV_DIR = "DUALPATH_SIM_ACCEL_DIR"
ROOT = Path(__file__).resolve().parent.parent     # holds sim/ and services/
_DIGESTED = ("sim", "services/scheduler/core", "services/compute_model")
_EXT = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
_BUILD_TIMEOUT_S = 900.0
KEEP_BUILDS = 4                          # builds of other digests kept in the cache (~2 MB each)

_status = "not enabled (sim.accel.enable() not called)"


class AccelError(RuntimeError):
    """The compiled build was required (``DUALPATH_SIM_ACCEL=1``) but cannot be used or built."""


def digest(root: Path = ROOT) -> str:
    """Hash of every source file the build depends on, and of the interpreter's ABI."""
    h = hashlib.sha256(f"{_EXT}|{sys.implementation.cache_tag}|{GROUP}|{','.join(MODULES)}".encode())
    for sub in _DIGESTED:
        for p in sorted((root / sub).glob("*.py")):
            h.update(f"\0{sub}/{p.name}\0".encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:20]


def cache_root() -> Path:
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dualpath" / "sim-accel"


def build_dir(root: Path = ROOT) -> Path:
    return cache_root() / digest(root)


def _paths(d: Path) -> dict[str, Path]:
    """Module name -> extension file of a build directory (the group library included)."""
    return {m: d / (m.replace(".", "/") + _EXT) for m in (f"{GROUP}__mypyc", *MODULES)}


def is_built(d: Path | None = None) -> bool:
    d = build_dir() if d is None else d
    return (d / "manifest.json").is_file() and all(p.is_file() for p in _paths(d).values())


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the compiled modules' names from one build directory, nothing else."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths

    def find_spec(self, fullname, path=None, target=None):
        p = self.paths.get(fullname)
        if p is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(p))
        return importlib.util.spec_from_file_location(fullname, str(p), loader=loader)


def requested_mode(value: str | None = None) -> str:
    """``off``, ``auto`` or ``require``: ``value``, else ``$DUALPATH_SIM_ACCEL`` (default auto)."""
    m = (value if value is not None else os.environ.get(ENV_MODE, "auto")).strip().lower()
    if m in ("0", "off", "no", "false"):
        return "off"
    if m in ("1", "on", "yes", "true", "require"):
        return "require"
    return "auto"


def enable(mode: str | None = None) -> bool:
    """Load the compiled modules from now on, if allowed and a matching build exists."""
    global _status
    m = requested_mode(mode)
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return active()
    if m == "off":
        _status = f"interpreted ({ENV_MODE}=0)"
        return False
    d = build_dir()
    loaded = [name for name in MODULES if name in sys.modules]
    if not is_built(d):
        reason = f"no compiled build for these sources at {d} (run `make sim-accel`)"
    elif loaded:
        reason = f"{', '.join(loaded)} already imported as Python before sim"
    else:
        sys.meta_path.insert(0, _Finder(_paths(d)))
        _status = f"compiled (mypyc, {d})"
        return True
    if m == "require":
        raise AccelError(reason)
    _status = f"interpreted: {reason}"
    return False


def active() -> bool:
    """Whether the simulator's modules in this process are the compiled ones."""
    mod = sys.modules.get("sim.flows")
    return bool(mod is not None and str(getattr(mod, "__file__", "")).endswith(_EXT))


def status() -> str:
    return _status


_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
files = sys.argv[1].split(",")
del sys.argv[1]
setup(name="dualpath-sim-accel", ext_modules=mypycify(files, opt_level="3", group_name="{group}",
      target_dir=sys.argv.pop(1)))
"""


def build(root: Path = ROOT, *, force: bool = False, quiet: bool = True) -> Path:
    """Compile ``MODULES`` for the sources under ``root``; returns the build directory."""
    d = cache_root() / digest(root)
    if is_built(d) and not force:
        return d
    try:
        import mypyc  # noqa: F401
        from importlib.metadata import version
        mypy_version = version("mypy")
    except Exception as e:  # ImportError, PackageNotFoundError
        raise AccelError("mypy (with mypyc) is not installed: pip install 'dualpath[accel]'") from e
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        raise AccelError(f"no C compiler ({cc}) found: mypyc needs one")
    d.parent.mkdir(parents=True, exist_ok=True)
    files = ",".join(m.replace(".", "/") + ".py" for m in MODULES)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sim-accel-", dir=d.parent) as tmp:
        stage = Path(tmp) / "out"
        env = dict(os.environ, MYPY_CACHE_DIR=str(Path(tmp) / "mypy-cache"))
        cmd = [sys.executable, "-c", _SETUP.format(group=GROUP), files, str(Path(tmp) / "c"),
               "build_ext", "--build-lib", str(stage), "--build-temp", str(Path(tmp) / "obj")]
        try:
            r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                               timeout=_BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise AccelError(f"mypyc build took over {_BUILD_TIMEOUT_S:.0f} s") from e
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).splitlines()[-25:])
            raise AccelError(f"mypyc build failed (exit {r.returncode}):\n{tail}")
        if not quiet:
            print(r.stdout[-2000:], file=sys.stderr)
        missing = [str(p) for p in _paths(stage).values() if not p.is_file()]
        if missing:
            raise AccelError(f"mypyc build produced no {', '.join(missing)}")
        (stage / "manifest.json").write_text(json.dumps({
            "digest": d.name, "modules": list(MODULES), "mypy": mypy_version,
            "python": sys.version.split()[0], "ext_suffix": _EXT,
            "build_s": round(time.perf_counter() - t0, 1), "built_at": time.time()}, indent=1))
        if d.exists():
            shutil.rmtree(d)
        os.replace(stage, d)
    prune(keep=KEEP_BUILDS, current=d)
    return d


def prune(keep: int = KEEP_BUILDS, current: Path | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest builds (and any abandoned staging directory over an
    hour old), so the cache stays bounded as sources change. A process that has a deleted build
    loaded keeps running: the files stay mapped until it exits."""
    root = cache_root()
    if not root.is_dir():
        return []
    builds = sorted((p for p in root.iterdir() if p.is_dir() and (p / "manifest.json").is_file()
                     and p != current), key=lambda p: (p / "manifest.json").stat().st_mtime,
                    reverse=True)
    doomed = builds[max(keep - (current is not None), 0):]
    doomed += [p for p in root.glob("sim-accel-*")
               if p.is_dir() and time.time() - p.stat().st_mtime > 3600]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="dualpath sim-accel", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["build", "status", "dir"])
    p.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    args = p.parse_args(argv)
    if args.command == "dir":
        print(build_dir())
        return 0
    if args.command == "status":
        d = build_dir()
        print(f"build for these sources: {'present' if is_built(d) else 'absent'} ({d})")
        return 0 if is_built(d) else 1
    t0 = time.perf_counter()
    try:
        d = build(force=args.force, quiet=True)
    except AccelError as e:
        print(f"sim.accel: {e}", file=sys.stderr)
        return 1
    print(f"compiled simulator modules in {d} ({time.perf_counter() - t0:.1f} s)")
    return 0

