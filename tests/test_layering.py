"""The scheduler's placement core stays sans-I/O at import time (docs/contributing.md,
'Sans-I/O cores'), and every service starts without ``tools/``.

`make lint` checks the same rule statically (import-linter's ``sans-io-cores`` contract); this
test proves it at run time, where a lazy import or a package ``__init__`` would also show: a
fresh interpreter imports ``services.scheduler.core`` and reports what ended up loaded. The
simulator reuses the core unchanged, so anything on this list would drag an event loop, the
network or a tool into every simulated run.

The second half checks that no two files of ``services/`` import each other, directly or
around a circle (``if TYPE_CHECKING:`` imports count): a node attempt gets the node's I/O
object, never its service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# module names (and their submodules) the core must not load
FORBIDDEN = (
    "asyncio", "ucxx", "uvloop",
    "common.transport",
    "common.rpc", "common.rpc_client", "common.rpc_server",
    "common.service", "services.node.base", "tools",
)

_PROBE = "import json, sys; import services.scheduler.core; print(json.dumps(sorted(sys.modules)))"


def _loaded_by(probe: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def _forbidden(names: list[str]) -> list[str]:
    return [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]


def test_scheduler_core_imports_no_io_transport_rpc_or_tools():
    loaded = _loaded_by(_PROBE)
    assert "services.scheduler.core" in loaded
    assert _forbidden(loaded) == []


_APPS = ("services.scheduler.app", "services.pe_receiver.app", "services.de_loader.app",
         "storage_gateway.app")


def test_service_composition_roots_load_no_tools_and_no_engine_emulator():
    """Each service's composition root (what ``dualpath serve`` runs for it) stands on the
    services and the floor alone: nothing from ``tools/``, the engine emulator included, so
    a service can start in a deployment that ships no tools."""
    loaded = _loaded_by(f"import json, sys; import {', '.join(_APPS)}; "
                        f"print(json.dumps(sorted(sys.modules)))")
    assert set(_APPS) <= set(loaded)
    assert [n for n in loaded if n == "tools" or n.startswith("tools.")] == []


# `dualpath serve ...` in a fresh interpreter; once it is serving (its ready line), report
# what is loaded and stop it the way an operator does (SIGTERM)
_SERVE_PROBE = """
import json, os, signal, sys
import common.service as shell
announce = shell.announce_ready
def probe(info, ready_file):
    announce(info, ready_file)
    print("LOADED " + json.dumps(sorted(sys.modules)), file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
shell.announce_ready = probe
from tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serving_a_gateway_loads_no_engine_emulator(tmp_path):
    """``dualpath serve gateway`` runs the gateway's root and nothing of the emulator (the
    host file's ``[engine_sim]`` schema is ``tools.config``'s, not the emulator's)."""
    env = {**os.environ, "DUALPATH__GATEWAY__ROOT": str(tmp_path / "storage")}
    out = subprocess.run([sys.executable, "-c", _SERVE_PROBE, "serve", "gateway", "-c",
                          str(REPO / "configs" / "default.toml"), "--node", "n0", "--port", "0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stderr.splitlines() if ln.startswith("LOADED "))
    loaded = json.loads(line[len("LOADED "):])
    assert "storage_gateway.app" in loaded
    assert [n for n in loaded if n == "tools.engine_sim" or n.startswith("tools.engine_sim.")
            ] == []
    assert [n for n in loaded if n.startswith(("services.pe_receiver", "services.de_loader"))
            or n == "services.scheduler.shell.service"] == []


# ---------------------------------------------------------------- no import circles in services/

def _services_imports() -> dict[str, set[str]]:
    """Module → the modules of ``services/`` it imports at module level, ``if TYPE_CHECKING:``
    blocks included (a cycle there is still two files that need each other to be read)."""
    import ast

    files = {".".join(p.relative_to(REPO).with_suffix("").parts): p
             for p in (REPO / "services").rglob("*.py")}
    mods = {m.removesuffix(".__init__"): p for m, p in files.items()}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out: set[str] = set()
        for node in _module_level(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                         for a in node.names]
            out.update(n for n in names if n in mods and n != mod)
        graph[mod] = out
    return graph


def _module_level(body):
    """Import statements run at import time or under ``if TYPE_CHECKING:`` (any ``if``/``try``
    at module level), not those inside functions."""
    import ast

    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody,
                         *(h.body for h in node.handlers)):
                yield from _module_level(part)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_any_two_files_of_services():
    """An attempt never imports its service (it gets the node's I/O instead), and no file of
    ``services/`` imports one that imports it back — TYPE_CHECKING imports included."""
    graph = _services_imports()
    assert graph["services.pe_receiver.service"] >= {"services.pe_receiver.attempt"}
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_ignored_import_of_the_contracts_must_match_an_import():
    """An ignore entry that matches nothing is an error (a renamed module would otherwise
    leave a stale exception that hides the next real violation)."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    with_ignores = [c for c in contracts if c.get("ignore_imports")]
    assert with_ignores
    assert {c["id"]: c.get("unmatched_ignore_imports_alerting") for c in with_ignores} == {
        c["id"]: "error" for c in with_ignores}


def test_the_readme_layout_names_every_package_of_the_tree():
    """README's layout table is the map a newcomer reads first: every package directory of
    the layered roots (and every composition root) must appear in it by path."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Layout"):readme.index("## Real engine")]
    roots = ("common", "storage_gateway", "services", "sim", "tools", "bench", "integrations")
    packages = sorted(str(p.parent.relative_to(REPO)) + "/"
                      for root in roots for p in (REPO / root).rglob("__init__.py")
                      if "__pycache__" not in p.parts)
    def named(p: str) -> bool:
        if f"`{p}`" in table or (p.count("/") == 1 and f"`{p}" in table):  # a root: its rows
            return True
        parent = p.rsplit("/", 2)[0]          # a sub-package named in its parent's row
        return f"`{parent}/`" in table and f"`{p[len(parent) + 1:]}`" in table

    missing = [p for p in packages if not named(p)]
    assert missing == [], f"packages not in README's layout table: {missing}"
    for app in ("storage_gateway/", "services/scheduler/", "services/pe_receiver/",
                "services/de_loader/"):
        assert (REPO / app / "app.py").exists()


def test_no_class_over_40_methods_and_no_module_over_600_lines():
    """Size is a hint to find a seam (docs/contributing.md): a class past 40 methods or a
    module past 600 lines has two jobs — split it by responsibility, not across files."""
    import ast

    roots = ("common", "storage_gateway", "services", "sim", "tools", "bench", "integrations")
    big_classes, long_modules = [], []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            text = path.read_text()
            if len(text.splitlines()) > 600:
                long_modules.append(str(path.relative_to(REPO)))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                            for b in node.body)
                    if n > 40:
                        big_classes.append(f"{path.relative_to(REPO)}:{node.name} ({n})")
    assert (big_classes, long_modules) == ([], [])
