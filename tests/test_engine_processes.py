"""The engine emulator as processes of its own (docs/engine-api.md "Cross-process"):
``dualpath cluster up`` with ``[cluster] remote_engines`` (one ``serve engine_sim`` process
per node, a SIGKILLed one replaced and re-attached) and ``dualpath serve … --engine-socket``
with an engine process attaching. The in-process side of the engine channel:
``tests/test_engine_ipc.py``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import pytest

from common.errors import KVSpecMismatch
from common.kv import KVSpec
from common.protocol import RequestFinished

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

@pytest.mark.slow
@pytest.mark.usefixtures("keep_logging")
def test_cluster_up_runs_engines_in_their_own_processes_and_a_killed_one_restarts(tmp_path):
    """``[cluster] remote_engines``: one ``serve engine_sim`` process per node; requests
    finish byte-checked through the engine sockets; a SIGKILLed engine process is replaced
    by a new one that attaches to the same, still running node service."""
    from common.protocol import GetStats, GetStatsReply
    from common.rpc import RpcClient as _Rpc
    from common.config import RpcConfig
    from services.scheduler.client.client import SyncSchedulerClient
    from tests.helpers import reap, wait_until
    from tests.test_cluster_launcher import gone, small_cluster
    from tools.cluster import cli
    from tools.cluster.launcher import State
    from tools.cluster.toml_write import dumps

    def stats(p) -> dict:
        async def get():
            async with _Rpc(RpcConfig(), p.host, p.rpc_port, role="test", node_id="t",
                            reply_type=GetStatsReply) as rpc:
                return (await rpc.call(GetStats(), 5)).counters
        return asyncio.run(get())

    cfg = tmp_path / "c.toml"
    cfg.write_text(dumps(small_cluster(tmp_path, cluster={"remote_engines": True})))
    assert cli.main(["up", "-c", str(cfg)]) == 0
    state = State.load(tmp_path / "cluster" / "t1p1d")
    pids = [p.pid for p in state.procs]
    extra = None
    try:
        assert sorted(p.name for p in state.procs if p.service == "engine_sim") == \
            ["engine_sim:d0", "engine_sim:p0"]
        with SyncSchedulerClient(*state.scheduler) as sched:
            toks = list(range(200))
            first = sched.run("t0", "s", len(toks), 70, token_ids=toks, deadline_s=30)
            assert isinstance(first, RequestFinished), first
            victim = state.proc("engine_sim:p0")
            os.kill(victim.pid, signal.SIGKILL)
            pe = state.proc("pe_receiver:p0")
            wait_until(lambda: stats(pe)["engine_api_engines_attached"] == 0,
                       what="the killed engine detached")
            extra = subprocess.Popen([sys.executable, "-m", "tools.cluster.serve", "engine_sim",
                                      "-c", state.config, "--node", "p0"], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until(lambda: stats(pe)["engine_api_engines_attached"] == 1,
                       what="the new engine process attached")
            toks = toks + first.output_token_ids + list(range(500, 530))
            second = sched.run("t1", "s", len(toks), 8, token_ids=toks, deadline_s=30)
            assert isinstance(second, RequestFinished), second
            assert second.hit_tokens == (200 + 70 - 1) // 64 * 64
        de = state.proc("de_loader:d0")
        wait_until(lambda: stats(de).get("engine_verified_requests", 0) >= 2,
                   what="the decode engine process reported its byte checks")
        assert stats(de).get("engine_prompt_mismatches", 0) == 0
        wait_until(lambda: stats(pe).get("engine_verified_layers", 0) > 0,   # turn 2's hit
                   what="the new prefill engine process reported its byte checks")
    finally:
        if extra is not None:
            extra.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                extra.wait(10)
            reap(extra)
        assert cli.main(["down", "-c", str(cfg)]) == 0
    assert gone(pids), "a service outlived `cluster down`"


@pytest.mark.slow
@pytest.mark.usefixtures("keep_logging")
def test_serve_with_engine_socket_lets_an_engine_process_attach(tmp_path):
    """``dualpath serve pe_receiver --engine-socket PATH``: no emulated engines in the node;
    an engine in another process attaches and is refused with another KV spec."""
    from common.kv import PRESETS
    from services.engine_api.remote import SyncEngineClient
    from tests.helpers import ready_line, reap
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[kv]\npreset = "test-small"\n[pe_receiver]\nbuffer_bytes = {8 << 20}\n'
                   f'[transport]\nstaging_bytes = {16 << 20}\n[logging]\nlevel = "warning"\n')
    sock = tmp_path / "p0.sock"
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "pe_receiver", "-c",
                             str(cfg), "--node", "p0", "--engine-socket", str(sock)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready_line(proc)
        spec = PRESETS["test-small"]
        with SyncEngineClient.connect(str(sock), engine_id="p0.e0", role="prefill",
                                      kv_spec=spec) as c:
            assert c.kv_spec == spec and c.node_id == "p0"
            assert c.next_prefill(0.0) is None
            assert c.arena.nbytes == 8 << 20
        with pytest.raises(KVSpecMismatch, match="2 layers"):
            SyncEngineClient.connect(str(sock), engine_id="p0.e1", role="prefill",
                                     kv_spec=KVSpec("other", 2, 256))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not sock.exists()                          # unlinked on a clean stop
    finally:
        reap(proc)
