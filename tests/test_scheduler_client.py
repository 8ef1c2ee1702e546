"""The frontend client library: async SchedulerClient, SyncSchedulerClient, the entry point.

The scheduler runs with stub group leaders (``stub_nodes.StubCluster``) that finish every
request at once, so these tests see whole request lives through the public client API only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest

from common.config import RpcConfig, build_config
from services.config import ServicesConfig
from common.errors import (DeadlineExceeded, InvalidArgument, NotFound, PeerFailed,
                           Unavailable)
from common.portal import PortalStopped
from common.protocol import (FirstToken, RequestFailed, RequestFinished, RequestPlaced,
                             RequestQueued)
from services.scheduler.client.client import SchedulerClient, SyncSchedulerClient, failure_error
from services.scheduler.shell.service import SchedulerService
from tools.cluster.stub_nodes import StubCluster
from tests.helpers import poll, reap, until

RPC = RpcConfig(reconnect_initial_s=0.01, reconnect_max_s=0.05, reconnect_attempts=5,
                default_deadline_s=10.0)
REPO = Path(__file__).resolve().parents[1]
ORDER = [RequestQueued, RequestPlaced, FirstToken, RequestFinished]


def make_cfg(**service):
    svc = {"lease_s": 1.0, "heartbeat_s": 0.1, "fetch_interval_s": 0.005, **service}
    return build_config({"kv": {"preset": "test-small"}, "rpc": msgspec.to_builtins(RPC),
                         "scheduler_service": svc}, ServicesConfig, environ={})


async def test_async_client_runs_requests_to_the_end():
    cfg = make_cfg()
    async with SchedulerService(cfg, port=0) as svc:
        async with StubCluster(RPC, "127.0.0.1", svc.port, prefill_nodes=2, decode_nodes=2,
                               kv_fingerprint=svc.kv.fingerprint()):
            async with SchedulerClient("127.0.0.1", svc.port, rpc=RPC) as fe:
                events = [ev async for ev in fe.submit("a", "s", 300, 8,
                                                        token_ids=list(range(300)))]
                assert [type(e) for e in events] == ORDER
                finals = await asyncio.gather(*(fe.run(f"r{i}", f"s{i % 3}", 200 + i, 4)
                                                for i in range(40)))
                assert all(isinstance(f, RequestFinished) and f.tokens == 4 for f in finals)
                status = await fe.cluster_status()
                assert status.counters["finished"] == 41 and status.requests == {}
                assert len(status.engines) == 8 and len(status.nodes) == 4


async def test_run_with_check_raises_the_typed_failure_and_breaking_out_cancels():
    async with SchedulerService(make_cfg(), port=0) as svc:          # no nodes: nothing runs
        async with SchedulerClient("127.0.0.1", svc.port, rpc=RPC) as fe:
            final = await fe.run("late", "s", 100, 2, deadline_s=0.1)
            assert isinstance(final, RequestFailed) and final.code == "DEADLINE_EXCEEDED"
            assert isinstance(failure_error(final), DeadlineExceeded)
            with pytest.raises(DeadlineExceeded):
                await fe.run("late2", "s", 100, 2, deadline_s=0.1, check=True)
            async for ev in fe.submit("brief", "s", 100, 2):
                assert isinstance(ev, RequestQueued)
                break
            await until(lambda: not svc.active_requests, 5, "the abandoned stream's request to end")
            with pytest.raises(InvalidArgument):
                await fe.run("bad", "s", -3, 2)


class ServiceThread:
    """A scheduler plus stub nodes on their own event loop thread, for plain sync tests."""

    def __init__(self, with_nodes: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.svc = SchedulerService(make_cfg(), port=0)
        self.stubs: StubCluster | None = None
        self._call(self.svc.start())
        if with_nodes:
            self.stubs = StubCluster(RPC, "127.0.0.1", self.svc.port,
                                     kv_fingerprint=self.svc.kv.fingerprint())
            self._call(self.stubs.start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        if self.stubs is not None:
            self._call(self.stubs.stop())
        self._call(self.svc.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def test_sync_client_works_from_plain_code():
    server = ServiceThread()
    try:
        with SyncSchedulerClient("127.0.0.1", server.svc.port, rpc=RPC) as sched:
            events = list(sched.submit("s1", "agent", 500, 6, token_ids=list(range(500))))
            assert [type(e) for e in events] == ORDER
            turn2 = list(range(500)) + list(range(7, 7 + 100))
            final = sched.run("s2", "agent", len(turn2), 6, token_ids=turn2)
            assert isinstance(final, RequestFinished) and final.hit_tokens == 7 * 64
            assert sched.cluster_status().counters["finished"] == 2
            with pytest.raises(InvalidArgument):
                list(sched.submit("bad", "agent", 10, 0))
            with pytest.raises(NotFound):
                sched.cancel("nobody")
    finally:
        server.close()


def test_sync_client_leaving_a_stream_cancels_the_request():
    server = ServiceThread(with_nodes=False)
    try:
        sched = SyncSchedulerClient("127.0.0.1", server.svc.port, rpc=RPC)
        events = sched.submit("q", "s", 100, 2)
        assert isinstance(next(events), RequestQueued)
        events.close()                                   # generator finally → stream closed
        poll(lambda: not server.svc.active_requests, 5, interval=0.005)
        assert server.svc.active_requests == 0
        sched.close()
        sched.close()                                    # idempotent
        with pytest.raises(PortalStopped, match="closed"):     # typed, never a hang
            sched.cluster_status()
    finally:
        server.close()


def test_sync_client_sees_the_server_go_away():
    server = ServiceThread(with_nodes=False)
    # resubmit_window_s=0: a lost scheduler is the request's outcome (no resubmission)
    with SyncSchedulerClient("127.0.0.1", server.svc.port, rpc=RPC,
                             resubmit_window_s=0) as sched:
        events = sched.submit("q", "s", 100, 2)
        assert isinstance(next(events), RequestQueued)
        server.close()                                   # live requests fail, then it closes
        rest = list(events)
        assert [(type(e), e.code, e.retryable) for e in rest] == \
            [(RequestFailed, "UNAVAILABLE", True)]
        with pytest.raises((PeerFailed, Unavailable)):   # nobody listens any more
            sched.cluster_status(timeout=2)


def test_entry_point_serves_on_its_printed_port_and_stops_on_sigterm(tmp_path):
    port_file = tmp_path / "ready"
    env = {**os.environ, "DUALPATH__SCHEDULER_SERVICE__LEASE_S": "1.0",
           "DUALPATH__SCHEDULER_SERVICE__HEARTBEAT_S": "0.2",
           "DUALPATH__LOGGING__LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cluster.serve", "scheduler",
                             "--port", "0", "--ready-file", str(port_file)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        ready = json.loads(line or "{}")
        assert (ready.get("event"), ready.get("host")) == ("ready", "127.0.0.1"), line
        port = ready["rpc_port"]
        assert json.loads(port_file.read_text())["rpc_port"] == port
        with SyncSchedulerClient("127.0.0.1", port, rpc=RPC) as sched:
            assert sched.cluster_status().policy == "dualpath"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        reap(proc)


def test_entry_point_rejects_a_bad_config(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler_service]\nlease_s = 1.0\nheartbeat_s = 2.0\n")
    proc = subprocess.run([sys.executable, "-m", "tools.cluster.serve", "scheduler", "-c",
                           str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "heartbeat_s" in proc.stderr
