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


def _event_loop_stat(port: int, name: str) -> float | None:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        for row in r.read().decode().splitlines():
            if row.startswith("dualpath_stat{") and 'service="event_loop"' in row \
                    and f'name="{name}"' in row:
                return float(row.rsplit(" ", 1)[1])
    return None


@pytest.mark.slow
def test_a_served_node_whose_loop_stands_still_logs_the_stack_that_held_it(tmp_path):
    """``[logging] loop_stall_s``: a node service's loop held (the failpoint's ``delay``, armed
    once the node is serving, sleeps in the loop thread at its next call to the scheduler) is
    logged with the holding stack, every thread's stack is written to its log *during* the
    stall past ``loop_stall_dump_s``, and ``/metrics`` counts the stall — what stop 54's lost
    lease lacked."""
    from tests.helpers import ready_line, wait_until
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[kv]\npreset = "test-small"\n[pe_receiver]\nbuffer_bytes = {8 << 20}\n'
                   f'[transport]\nstaging_bytes = {16 << 20}\n[logging]\nlevel = "warning"\n'
                   f'json = true\nloop_stall_s = 0.4\nloop_stall_dump_s = 0.8\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALPATH")}
    serve_cmd = [sys.executable, "-m", "tools.cli", "serve"]
    sched = subprocess.Popen([*serve_cmd, "scheduler", "-c", str(cfg), "--port", "0"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    node = None
    try:
        port = ready_line(sched)["rpc_port"]
        arm = tmp_path / "failpoints"
        node = subprocess.Popen([*serve_cmd, "pe_receiver", "-c", str(cfg), "--node", "p0",
                                 "--scheduler", f"127.0.0.1:{port}", "--metrics-port", "0"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**env, "DUALPATH_FAILPOINTS_FILE": str(arm)})
        metrics = ready_line(node)["metrics_port"]
        wait_until(lambda: _event_loop_stat(metrics, "loop_stalls") == 0,    # refreshed 1/s
                   what="the watch on /metrics, nothing held yet")
        arm.write_text("node.sched.call=delay:2")                 # its next heartbeat or fetch
        node.send_signal(signal.SIGUSR1)
        wait_until(lambda: _event_loop_stat(metrics, "loop_stalls") == 1,
                   what="the stall counted on /metrics")
        assert 1.5 <= (_event_loop_stat(metrics, "loop_stall_max_s") or 0) < 10
        assert _event_loop_stat(metrics, "loop_stalled_now") == 0
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=20) == 0
        log = node.stderr.read()
    finally:
        for proc in (node, sched):
            if proc is not None:
                reap(proc)
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    blocked = [e for e in events if e.get("event") == "event_loop_blocked"]
    assert len(blocked) == 1, log[-3000:]
    assert "in failpoint" in blocked[0]["stack"] and "_call" in blocked[0]["stack"]
    resumed = [e for e in events if e.get("event") == "event_loop_resumed"]
    assert len(resumed) == 1 and resumed[0]["stalled_s"] >= 1.5
    # faulthandler's dump, written during the stall: the loop thread asleep in the failpoint
    dump = log[log.index("FAILPOINT node.sched.call"):]
    assert 'in failpoint' in dump and "the loop stood still" in dump, log[-3000:]
