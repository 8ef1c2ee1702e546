"""The compiled simulator build (``sim.accel``): loaded only when it matches the sources, all or
nothing, and bit-identical to the interpreted simulator.

Every check that loads or refuses a build runs in a child process: the test process itself is
pinned to the interpreted simulator (``conftest``), and a process cannot unload modules.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sim import accel

ROOT = Path(__file__).resolve().parent.parent


def _child(code: str, mode: str, accel_dir: Path, timeout: float = 300.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, DUALPATH_SIM_ACCEL=mode, DUALPATH_SIM_ACCEL_DIR=str(accel_dir))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _fake_build(accel_dir: Path) -> Path:
    """A build directory that passes ``is_built`` (empty files): never imported by these tests."""
    d = accel_dir / accel.digest()
    for p in accel._paths(d).values():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    (d / "manifest.json").write_text("{}")
    return d


def test_digest_covers_every_source_file(tmp_path):
    for sub in ("sim", "services/scheduler/core", "services/compute_model"):
        shutil.copytree(ROOT / sub, tmp_path / sub, ignore=shutil.ignore_patterns("__pycache__"))
    before = accel.digest(tmp_path)
    assert before == accel.digest(ROOT)
    for rel in ("sim/flows.py", "services/scheduler/core/records.py", "sim/reproduce.py",
                "services/compute_model/cost_model.py", "sim/datasets.py"):
        p = tmp_path / rel
        original = p.read_bytes()
        p.write_bytes(original + b"\n# edited\n")
        assert accel.digest(tmp_path) != before, f"an edit to {rel} must change the digest"
        p.write_bytes(original)
    assert accel.digest(tmp_path) == before


def test_no_build_means_interpreted_and_require_says_why(tmp_path):
    code = """
        from sim import accel
        import sim.flows
        print(accel.active(), '|', accel.status())
    """
    r = _child(code, "auto", tmp_path)
    assert r.returncode == 0, r.stderr
    active, status = r.stdout.strip().split(" | ")
    assert active == "False" and "no compiled build" in status and "make sim-accel" in status
    r = _child(code, "1", tmp_path)
    assert r.returncode != 0
    assert "AccelError" in r.stderr and "no compiled build" in r.stderr


def test_a_stale_build_is_never_loaded(tmp_path):
    """A build made for other sources (another digest) sits in the cache: not used."""
    stale = tmp_path / ("0" * 20)
    _fake_build(tmp_path).rename(stale)
    r = _child("from sim import accel; print(accel.active(), accel.status())", "auto", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False") and "no compiled build" in r.stdout


def test_all_or_nothing_when_scheduler_was_imported_first(tmp_path):
    """Compiled sim code must never meet interpreted scheduler classes: nothing is loaded."""
    _fake_build(tmp_path)        # would fail to import if the hook tried to load it
    code = """
        import services.scheduler.core.scheduler
        from sim import accel
        import sim.cluster
        print(accel.active(), '|', accel.status(), '|', sim.cluster.__file__)
    """
    r = _child(code, "auto", tmp_path)
    assert r.returncode == 0, r.stderr
    active, status, path = r.stdout.strip().split(" | ")
    assert active == "False" and "already imported" in status and path.endswith(".py")
    r = _child(code, "1", tmp_path)
    assert r.returncode != 0 and "already imported" in r.stderr


def test_off_wins_over_a_present_build(tmp_path):
    _fake_build(tmp_path)
    r = _child("from sim import accel; import sim.cluster; print(accel.active(), accel.status())",
               "0", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False") and "DUALPATH_SIM_ACCEL=0" in r.stdout


_SCENARIOS = """
    import json, sys
    from sim import accel, simulate
    runs = {}
    for mode in ("basic", "+layer", "+dpl", "dualpath", "oracle"):
        runs[mode] = simulate("configs/sim-2p4d-ds660b.toml", mode, "64k", 96, turns_scale=0.05)
    runs["exact"] = simulate("configs/sim-local-1p2d.toml", "dualpath", "32k", 8, exact=True,
                             turns_scale=0.3)
    runs["online"] = simulate("configs/sim-local-1p2d.toml", "dualpath", "32k", 6, online=True,
                              aps=0.5, turns_scale=0.3)
    # recorded sessions: think times, a sub-agent blocking its parent, repeat copies
    import pathlib, tempfile
    from sim.recorded import load_workload
    from sim.run import simulate_trace
    from tests.trace_files import write_agentic
    with tempfile.TemporaryDirectory() as tmp:     # read whole: nothing left behind
        trace = load_workload(write_agentic(pathlib.Path(tmp) / "c", n_files=2))
    runs["trace"] = simulate_trace("configs/sim-2p4d-ds660b.toml", "dualpath", trace, online=True,
                                   aps=0.5, repeat=3)
    for r in runs.values():
        for k in ("wall_s", "events_per_s", "requests_per_s", "peak_rss_mb", "compiled", "build"):
            r["sim"].pop(k)
    mods = [m.__file__ for n, m in sys.modules.items() if n in accel.MODULES]
    print(json.dumps({"active": accel.active(), "modules": mods, "runs": runs}, sort_keys=True))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)   # a mypyc build of the simulator (~1-2 min alone, far more under load)
def test_compiled_simulator_is_bit_identical_to_interpreted():
    """The build in the user's cache (``make sim-accel``'s, the one ``dualpath simulate`` and
    the benches load), made here when none matches these sources: a mypyc build costs ~2.5
    CPU-minutes, so a run whose simulator sources are unchanged checks the build they already
    have (keyed by the sources' digest) instead of compiling an identical one again. Every
    change to the simulator's sources is compiled here on the next run."""
    try:
        import mypyc  # noqa: F401
    except ImportError:
        pytest.skip("mypy/mypyc not installed (the 'accel' extra)")
    cache = accel.cache_root()
    r = _child("from sim import accel; print(accel.build())", "0", cache, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    built = Path(r.stdout.strip())
    assert accel.is_built(built) and built.name == accel.digest()
    compiled = _child(_SCENARIOS, "1", cache)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    interpreted = _child(_SCENARIOS, "0", cache)
    assert interpreted.returncode == 0, interpreted.stderr[-3000:]
    c, i = json.loads(compiled.stdout), json.loads(interpreted.stdout)
    assert c["active"] is True and i["active"] is False
    assert len(c["modules"]) == len(accel.MODULES)
    assert all(str(built) in m and not m.endswith(".py") for m in c["modules"]), c["modules"]
    assert all(m.endswith(".py") for m in i["modules"])
    assert c["runs"]["dualpath"]["requests"] > 0 and c["runs"]["online"]["requests"] > 0
    assert c["runs"]["trace"]["requests"] == 3 * 2 * 6
    for name in i["runs"]:
        assert c["runs"][name] == i["runs"][name], f"{name}: compiled and interpreted runs differ"


def test_the_cache_keeps_a_bounded_number_of_builds(tmp_path, monkeypatch):
    monkeypatch.setenv(accel.ENV_DIR, str(tmp_path))
    made = []
    for i in range(7):
        d = tmp_path / f"{i:020d}"
        d.mkdir()
        (d / "manifest.json").write_text("{}")
        os.utime(d / "manifest.json", (1000 + i, 1000 + i))
        made.append(d)
    abandoned = tmp_path / "sim-accel-stage"
    abandoned.mkdir()
    os.utime(abandoned, (1000, 1000))
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    removed = accel.prune(keep=3, current=made[0])
    left = sorted(p.name for p in tmp_path.iterdir())
    # the current build, the 2 newest others, and what is not a build
    assert left == sorted([made[0].name, made[6].name, made[5].name, "notes"]), left
    assert abandoned in removed and len(removed) == 5
