"""``dualpath serve``, the one process shell: a plain host config file (no ``[cluster]``) is used
as written with ``--node`` as the service's id; the ready line is the same JSON for every
service; the old per-service commands are aliases of ``serve``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import InternalError
from common.service import Service, serve_process
from tests.helpers import reap
from tools import cli
from tools.cluster import serve

ROOT = Path(__file__).resolve().parents[1]
READY_KEYS = {"event", "service", "node_id", "host", "rpc_port", "ucx_port", "metrics_port", "pid"}


def test_a_plain_host_file_runs_as_written(tmp_path):
    t = serve.load_target(str(ROOT / "configs" / "default.toml"), None)
    assert t.cluster is None and t.metrics_port("gateway", "n0") is None
    assert t.config("gateway", "n0") is t.host_cfg              # no cluster rendering
    cfg = t.config("de_loader", "n0", scheduler=("10.0.0.1", 7700), gateway_port=7400)
    assert (cfg.de_loader.scheduler_host, cfg.de_loader.scheduler_port,
            cfg.de_loader.gateway_port) == ("10.0.0.1", 7700, 7400)


def test_a_cluster_file_is_rendered_per_service():
    t = serve.load_target(str(ROOT / "configs" / "local-1p2d.toml"), None)
    assert t.cluster is not None and t.service("node", "d0") == "de_loader"


def test_bad_arguments_exit_2(capsys):
    plain = str(ROOT / "configs" / "default.toml")
    assert serve.main(["node", "-c", plain, "--node", "n0"]) == 2   # a plain file has no roles
    assert "pe_receiver or de_loader" in capsys.readouterr().err
    assert serve.main(["gateway", "-c", plain]) == 2                # --node is required
    assert cli.main(["gateway", "-c", plain]) == 2                  # alias of serve gateway
    assert "needs --node" in capsys.readouterr().err


@pytest.mark.slow
def test_gateway_on_a_plain_file_announces_and_stops_on_sigterm(tmp_path):
    cfg = tmp_path / "gw.toml"
    cfg.write_text(f'[kv]\npreset = "test-small"\n[gateway]\nroot = "{tmp_path / "store"}"\n'
                   f'[gateway_service]\nstaging_bytes = {16 << 20}\nmax_batch_bytes = {4 << 20}\n'
                   f'[transport]\nstaging_bytes = {16 << 20}\n[logging]\nlevel = "warning"\n')
    ready_file = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "gateway", "-c", str(cfg),
                             "--node", "n0", "--port", "0", "--ready-file", str(ready_file)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DUALPATH__LOGGING__LEVEL": "warning"})
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        assert set(ready) == READY_KEYS, proc.stderr.read() if not ready else ready
        assert (ready["event"], ready["service"], ready["node_id"]) == ("ready", "gateway", "n0")
        assert ready["rpc_port"] > 0 and ready["pid"] == proc.pid
        assert json.loads(ready_file.read_text()) == ready
        assert (tmp_path / "store").is_dir()                       # its own root, as written
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        reap(proc)


class _Quiet(Service):
    name = "quiet"


async def test_the_shell_stops_in_order_on_sigterm(capsys):
    order: list[str] = []

    async def start(stack):
        svc = await stack.enter_async_context(_Quiet("n1"))
        stack.callback(order.append, "engines")                # entered last, stopped first
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
        return svc, {"event": "ready", "service": "quiet"}

    await serve_process(start)
    assert order == ["engines"]
    assert json.loads(capsys.readouterr().out) == {"event": "ready", "service": "quiet"}


async def test_a_service_that_stops_on_its_own_fails_the_shell(tmp_path):
    svc, tasks = _Quiet("n1"), []

    async def start(stack):
        await stack.enter_async_context(svc)
        asyncio.get_running_loop().call_soon(lambda: tasks.append(asyncio.ensure_future(svc.stop())))
        return svc, {"event": "ready"}

    with pytest.raises(InternalError, match="stopped on its own"):
        await serve_process(start, tmp_path / "ready")
    assert json.loads((tmp_path / "ready").read_text()) == {"event": "ready"}
