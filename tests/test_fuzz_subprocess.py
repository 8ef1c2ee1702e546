"""Fuzzing a real scheduler process (issue 8, item 3): the in-process fuzz files prove the
handlers; this proves the deployed shape — ``dualpath serve scheduler`` on uvloop, its own
logging setup — survives the same input, and exits cleanly on SIGTERM afterwards.

Stand-in group leaders (``StubCluster``) and a frontend stay connected the whole time; after
every fuzz batch the frontend's request must run to RequestFinished.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import KVConfig, RpcConfig
from common.errors import ErrorCode
from common.framing import HEADER
from common.kv import spec_from_config
from common.protocol import Call, CallError, CancelRequest, SubmitRequest
from services.scheduler.client.client import SchedulerClient
from tools.cluster.stub_nodes import StubCluster
from tests.fuzz_rig import RawPeer, error_code, frame_of
from tests.test_fuzz_decoders import deep, mutated

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
RPC = RpcConfig(reconnect_attempts=3, reconnect_initial_s=0.01)

BATCH = st.lists(st.one_of(
    st.binary(min_size=1, max_size=300).map(lambda b: ("bytes", b)),
    st.integers(4 * 1024 * 1024 + 1, 2**32 - 1).map(lambda n: ("huge", n)),
    st.dictionaries(st.text(max_size=6), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
                    max_size=4)
    .map(lambda d: ("body", {**d, "t": "sched.submit"})),
    st.builds(SubmitRequest, request_id=st.text(max_size=8), session_id=st.text(max_size=8),
              prompt_tokens=st.integers(-10, 10**9), gen_tokens=st.integers(-1, 5),
              deadline_s=st.none() | st.floats()).map(lambda m: ("body", m)),
    # issue 26: bodies nested past the recursion limit (they closed the connection untyped)
    # and valid call frames mutated byte-wise (a CancelRequest: harmless should one survive)
    st.integers(1_100, 50_000).map(lambda d: ("deep", d)),
    mutated(st.just(msgspec.msgpack.encode(Call(1, 5.0, msgspec.Raw(msgspec.msgpack.encode(
        CancelRequest("fz-nobody"))))))).map(lambda b: ("frame", b))),
    min_size=1, max_size=6)
RSS_GROWTH_BOUND_MB = 128      # generous: the process is ~100 MB; the fuzzing must not add to it


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` now, in MB."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _attack(port: int, kind: str, value) -> None:
    peer = await RawPeer.open(port)
    try:
        if kind == "bytes":
            peer.send_bytes(value)
            peer.eof()
            await peer.drain()                 # typed answers only, then the close
        elif kind == "deep":
            peer.send(Call(7, 5.0, msgspec.Raw(deep(value))))
            peer.eof()
            envs = await peer.drain()
            assert [(type(e), e.id, e.error.code) for e in envs] in (
                [(CallError, 0, ErrorCode.PROTOCOL_ERROR)],
                [(CallError, 7, ErrorCode.INVALID_ARGUMENT)]), envs
        elif kind == "frame":
            peer.send_bytes(frame_of(value))
            peer.eof()
            await peer.drain()                 # typed answers only, then the close
        elif kind == "huge":
            peer.send_bytes(HEADER.pack(value))
            envs = await peer.drain()
            assert [e.error.code for e in envs if type(e) is CallError] == \
                [ErrorCode.FRAME_TOO_LARGE]
        else:
            env = await peer.answer(peer.send_call(value, 5.0))
            assert error_code(env) in (None, ErrorCode.INVALID_ARGUMENT), env
    finally:
        await peer.close()


def _start(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    port_file = tmp_path / "ready"
    env = {**os.environ, "DUALPATH__LOGGING__LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cluster.serve", "scheduler", "-c",
                             str(ROOT / "configs" / "default.toml"), "--port", "0",
                             "--ready-file", str(port_file)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(600):
        if port_file.exists():
            return proc, json.loads(port_file.read_text())["rpc_port"]
        if proc.poll() is not None:
            raise AssertionError(f"scheduler exited: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("scheduler did not announce its port within 30 s")


def test_scheduler_process_survives_fuzz_batches(tmp_path, reliability):
    proc, port = _start(tmp_path)
    loop = asyncio.new_event_loop()
    batches = 0
    fp = spec_from_config(KVConfig()).fingerprint()
    stubs = StubCluster(RPC, "127.0.0.1", port, prefill_nodes=1, decode_nodes=1, engines=1,
                        kv_fingerprint=fp)
    front = SchedulerClient("127.0.0.1", port, rpc=RPC, client_id="well-behaved")
    try:
        loop.run_until_complete(stubs.__aenter__())
        loop.run_until_complete(front.connect())

        @settings(derandomize=True, max_examples=15, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(batch=BATCH)
        def example(batch) -> None:
            nonlocal batches
            batches += 1
            for kind, value in batch:
                loop.run_until_complete(asyncio.wait_for(_attack(port, kind, value), 30))
            assert proc.poll() is None, "scheduler process died"
            final = loop.run_until_complete(asyncio.wait_for(front.run(
                f"good-{batches}", "good", 130, 2, deadline_s=20, check=True), 30))
            assert final.tokens >= 1

        rss_before = rss_mb(proc.pid)
        example()
        rss_growth = rss_mb(proc.pid) - rss_before
        assert rss_growth < RSS_GROWTH_BOUND_MB, f"scheduler RSS grew {rss_growth:.0f} MB"
        status = loop.run_until_complete(front.cluster_status())
        assert status.counters["finished"] == batches
        assert status.counters["rejected_invalid"] >= 1
    finally:
        loop.run_until_complete(front.close())
        loop.run_until_complete(stubs.__aexit__(None, None, None))
        loop.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    stderr = proc.stderr.read().decode(errors="replace")
    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    reliability.record("input", "scheduler process (uvloop): random bytes, huge lengths, wrong "
                       "schema, hostile submits, bodies nested past the recursion limit, "
                       "mutated call frames", "typed errors; process alive; frontend's "
                       "request finished after every batch; clean SIGTERM exit; RSS "
                       f"{rss_growth:+.0f} MB (bound {RSS_GROWTH_BOUND_MB})", examples=batches)
