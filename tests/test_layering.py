"""The scheduler's placement core stays sans-I/O at import time (CONVENTIONS §3, §13), and
every service starts without ``tools/``.

`make lint` checks the same rule statically (import-linter's ``sans-io-cores`` contract); this
test proves it at run time, where a lazy import or a package ``__init__`` would also show: a
fresh interpreter imports ``services.scheduler.core`` and reports what ended up loaded. The
simulator reuses the core unchanged, so anything on this list would drag an event loop, the
network or a tool into every simulated run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# module names (and their submodules) the core must not load
FORBIDDEN = (
    "asyncio", "ucxx", "uvloop",
    "common.transport", "common.transport_ucx", "common.ucxx_handshake",
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
