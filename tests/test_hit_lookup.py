"""Hit lookup through any gateway of the shared store (issue #16, item 3).

``GatewayHitLookup`` on fake clients (rotation, retry on the next gateway, every gateway failing
→ a typed error naming each, the per-try share of the budget); the scheduler service when the
lookup fails (the request still runs with hit 0, and its events, counters, metrics and log say
so); and two real gateways over one storage directory, one stopped: the lookup still answers
the right hit through the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import structlog

from common import metrics
from common.config import build_config
from common.errors import DeadlineExceeded, InvalidArgument, Overloaded, Unavailable
from common.kv import block_keys_from_tokens, spec_from_config
from common.protocol import RequestFinished, RequestQueued
from services.scheduler.app import start_scheduler
from services.scheduler.client.client import SchedulerClient
from services.scheduler.shell.frontend_channel import LOOKUP_STALL_S
from services.scheduler.shell.gateway_lookup import BUDGET_SHARE, GatewayHitLookup
from services.scheduler.shell.hit_lookup import HitLookup
from storage_gateway.service import GatewayService
from tests.test_scheduler_service import BT, keys, nxt, run_stages, running
from tools.cluster.inprocess import base_config
from tools.config import DualpathConfig
from tools.engine_sim.kv_pattern import full_block


class Reply:
    def __init__(self, hit_blocks: int) -> None:
        self.hit_blocks = hit_blocks


class FakeGateway:
    """Answers ``hit`` or raises ``fail``; ``hang``: never answers; records every call."""

    def __init__(self, hit: int = 0, fail: BaseException | None = None, hang: bool = False,
                 on_call: Any = None) -> None:
        self.hit, self.fail, self.hang, self.on_call = hit, fail, hang, on_call
        self.calls: list[tuple[list[str], float | None]] = []
        self.closed = False

    async def lookup_prefix(self, keys: Sequence[str], timeout: float | None = None) -> Reply:
        self.calls.append((list(keys), timeout))
        if self.on_call is not None:
            self.on_call()
        if self.hang:
            await asyncio.Event().wait()
        if self.fail is not None:
            raise self.fail
        return Reply(self.hit)

    async def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def bad(name: str) -> Unavailable:
    return Unavailable(f"cannot reach {name}")


# --------------------------------------------------------------------------- unit: fake clients

def test_is_a_hit_lookup_and_refuses_nonsense():
    assert isinstance(GatewayHitLookup({"g0": FakeGateway()}, 1.0), HitLookup)
    with pytest.raises(InvalidArgument):
        GatewayHitLookup({}, 1.0)
    with pytest.raises(InvalidArgument):
        GatewayHitLookup({"g0": FakeGateway()}, 0.0)


async def test_lookups_rotate_over_the_gateways():
    gws = {f"g{i}": FakeGateway(hit=i + 1) for i in range(3)}
    lookup = GatewayHitLookup(gws, 1.0)
    assert lookup.gateways == ["g0", "g1", "g2"]
    assert [await lookup.lookup("s", ["k"]) for _ in range(4)] == [1, 2, 3, 1]
    assert [len(g.calls) for g in gws.values()] == [2, 1, 1]
    assert lookup.retries == 0 and not lookup.failures
    await lookup.close()
    assert all(g.closed for g in gws.values())


async def test_a_failed_gateway_hands_the_lookup_to_the_next():
    gws = {"g0": FakeGateway(fail=bad("g0")), "g1": FakeGateway(hit=5),
           "g2": FakeGateway(hit=7)}
    lookup = GatewayHitLookup(gws, 1.0)
    with structlog.testing.capture_logs() as logs:
        assert await lookup.lookup("s", ["a", "b"]) == 5
    assert [c[0] for c in gws["g1"].calls] == [["a", "b"]]
    assert gws["g2"].calls == []                        # one answer is enough
    assert lookup.failures == {"g0": 1} and lookup.retries == 1
    failed = [e for e in logs if e["event"] == "hit_lookup_gateway_failed"]
    assert failed and failed[0]["gateway"] == "g0" and "cannot reach g0" in failed[0]["error"]
    assert await lookup.lookup("s", ["a"]) == 5         # the next turn starts at g1
    assert lookup.retries == 1


async def test_a_gateway_dropped_while_a_lookup_connects_to_it_hands_the_lookup_on():
    """etcd discovery drops a gateway (``replace``, then the scheduler closes its client)
    while a lookup waits for that client's connection: the lookup moves to the next gateway
    instead of unwinding the request's submit stream with a CancelledError."""
    from common.config import RpcConfig
    from common.protocol import ErrorReply, Ping, Pong
    from common.rpc import RpcClient

    class RpcBacked:                    # a gateway client whose lookup is one RPC call
        def __init__(self, port: int) -> None:
            self.rpc = RpcClient(RpcConfig(connect_timeout_s=30.0, handshake_timeout_s=30.0),
                                 "127.0.0.1", port, role="scheduler", node_id="s",
                                 reply_type=Pong | ErrorReply)

        async def lookup_prefix(self, keys: Sequence[str], timeout: float | None = None):
            await self.rpc.call(Ping(b""), timeout)
            raise AssertionError("a silent gateway never answers")

        async def close(self) -> None:
            await self.rpc.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()             # accepts, never says hello
        writer.close()
    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    dropped = RpcBacked(srv.sockets[0].getsockname()[1])
    lookup = GatewayHitLookup({"gone": dropped, "g1": FakeGateway(hit=4)}, 30.0)
    task = asyncio.create_task(lookup.lookup("s", ["k"]))
    await until_connecting(dropped.rpc)
    for old in lookup.replace({"g1": lookup.clients["g1"]}):
        await old.close()               # what the scheduler's discovery follower does
    assert await task == 4
    assert lookup.failures == {"gone": 1}
    srv.close()
    await srv.wait_closed()


async def until_connecting(rpc: Any) -> None:
    from tests.helpers import until
    await until(lambda: rpc._connecting is not None and not rpc._connecting.done(),
                what="the lookup connecting to the gateway")


async def test_every_gateway_failing_raises_one_error_naming_each():
    gws = {"g0": FakeGateway(fail=bad("g0")),
           "g1": FakeGateway(fail=Overloaded("read queue full")),
           "g2": FakeGateway(fail=DeadlineExceeded("LookupPrefix got no reply"))}
    lookup = GatewayHitLookup(gws, 1.0)
    with pytest.raises(Unavailable) as err:
        await lookup.lookup("s", ["a"])
    msg = err.value.message
    assert msg.startswith("hit lookup failed on every gateway: ")
    for name, text in (("g0", "cannot reach g0"), ("g1", "read queue full"),
                       ("g2", "got no reply")):
        assert f"{name}: " in msg and text in msg
    assert [len(g.calls) for g in gws.values()] == [1, 1, 1]   # at most once per gateway
    assert lookup.failures == {"g0": 1, "g1": 1, "g2": 1}
    assert lookup.retries == 2 and lookup.exhausted == 1


async def test_a_bug_in_a_client_is_not_retried():
    gws = {"g0": FakeGateway(fail=ValueError("bug")), "g1": FakeGateway(hit=1)}
    with pytest.raises(ValueError):
        await GatewayHitLookup(gws, 1.0).lookup("s", ["a"])
    assert gws["g1"].calls == []


async def test_each_try_gets_the_budget_left_shared_by_the_tries_left():
    clock = Clock()

    def slow():
        clock.now += 0.1                                # each try takes 0.1 s of the budget
    gws = {f"g{i}": FakeGateway(fail=bad(f"g{i}"), on_call=slow) for i in range(3)}
    gws["g2"].fail = None
    gws["g2"].hit = 3
    lookup = GatewayHitLookup(gws, 1.0, clock=clock)
    assert await lookup.lookup("s", ["a"]) == 3
    budget = BUDGET_SHARE * 1.0
    shares = [g.calls[0][1] for g in gws.values()]
    assert shares == pytest.approx([budget / 3, (budget - 0.1) / 2, budget - 0.2])
    assert sum(shares[:2]) + 0.1 <= budget              # the tries fit in the budget


async def test_a_gateway_that_never_answers_times_out_within_its_share():
    gws = {"g0": FakeGateway(hang=True), "g1": FakeGateway(hit=2)}
    lookup = GatewayHitLookup(gws, 0.2)
    assert await lookup.lookup("s", ["a"]) == 2
    assert lookup.failures == {"g0": 1}


# --------------------------------------------------------------------------- the scheduler

async def test_a_failed_lookup_is_hit_0_and_says_so_in_events_counters_metrics_and_log():
    down = {"g0": FakeGateway(fail=bad("g0")), "g1": FakeGateway(fail=bad("g1"))}
    lookup = GatewayHitLookup(down, 1.0)
    async with running(hit_lookup=lookup) as env:
        p0, d0 = await env.pair()
        fe = await env.client()
        metrics.register_source("scheduler", "scheduler", metrics.scheduler_stats(env.svc))
        try:
            with structlog.testing.capture_logs() as logs:
                stream = fe.submit("r1", "s", 5 * BT + 1, 2, block_keys=keys(5))
                queued = await nxt(stream)
                assert isinstance(queued, RequestQueued)
                assert queued.hit_tokens == 0 and queued.hit_lookup_failed
                await d0.fetch()
                plan = (await p0.fetch()).plans[0]
                assert plan.hit_keys == []              # recompute the whole prompt
                await run_stages(p0, plan)
                events = [await nxt(stream) for _ in range(3)]
            done = events[-1]
            assert isinstance(done, RequestFinished)
            assert done.hit_tokens == 0 and done.hit_lookup_failed
            assert env.svc.counters["hit_lookup_failures"] == 1
            assert env.svc.counters["hit_lookup_retries"] == 1
            failed = [e for e in logs if e["event"] == "hit_lookup_failed"]
            assert len(failed) == 1 and failed[0]["request_id"] == "r1"
            assert failed[0]["hit_tokens"] == 0 and failed[0]["code"] == "UNAVAILABLE"
            assert "g0: " in failed[0]["reason"] and "g1: " in failed[0]["reason"]

            down["g1"].fail, down["g1"].hit = None, 3   # one gateway back: no failure now
            ok = fe.submit("r2", "s", 5 * BT + 1, 2, block_keys=keys(5))
            queued = await nxt(ok)
            assert queued.hit_tokens == 3 * BT and not queued.hit_lookup_failed
            await ok.aclose()
            assert env.svc.counters["hit_lookup_failures"] == 1
            metrics.registry().refresh()
            text = prometheus_client.generate_latest(metrics.registry().registry).decode()
        finally:
            metrics.unregister_source("scheduler", "scheduler")
    assert "dualpath_hit_lookup_failures_total 1.0" in text
    assert "dualpath_hit_lookup_retries_total " in text


class StallingGateway:
    """Its first call holds the loop ``stall_s`` (a synchronous sleep in a callback: this
    process standing still, as a GC pause or a stopped VM does) and is never answered; every
    later call answers ``hit``."""

    def __init__(self, hit: int, stall_s: float) -> None:
        self.hit, self.stall_s, self.calls = hit, stall_s, 0

    async def lookup_prefix(self, keys: Sequence[str], timeout: float | None = None) -> Reply:
        self.calls += 1
        if self.calls == 1:
            asyncio.get_running_loop().call_soon(time.sleep, self.stall_s)
            await asyncio.Event().wait()
        return Reply(self.hit)


async def test_a_lookup_that_ran_out_while_the_scheduler_stood_still_is_asked_again():
    """CI (the real-engine front test, four agents at once): the in-process scheduler's loop
    stood still 28 s, the lookups' deadlines fell due inside the stall and ran before the
    gateways' answers, and two later turns were recomputed from hit 0. A lookup that fails
    more than ``LOOKUP_STALL_S`` past its budget is now asked once more; one that is merely
    slow (no stall) still fails at its budget, hit 0, and is not asked again."""
    budget = 0.3
    stalling = StallingGateway(hit=3, stall_s=budget + LOOKUP_STALL_S + 0.5)
    lookup = GatewayHitLookup({"g0": stalling}, budget)
    async with running(hit_lookup=lookup, hit_lookup_timeout_s=budget) as env:
        await env.pair()
        fe = await env.client()
        with structlog.testing.capture_logs() as logs:
            stream = fe.submit("r1", "s", 5 * BT + 1, 2, block_keys=keys(5))
            queued = await nxt(stream)
            await stream.aclose()
        assert queued.hit_tokens == 3 * BT and not queued.hit_lookup_failed
        assert stalling.calls == 2
        assert env.svc.counters["hit_lookup_stall_retries"] == 1
        assert env.svc.counters["hit_lookup_failures"] == 0
        retried = [e for e in logs if e["event"] == "hit_lookup_retried_after_stall"]
        assert len(retried) == 1 and retried[0]["overrun_s"] > LOOKUP_STALL_S, retried

        lookup.replace({"g1": FakeGateway(hang=True)})     # slow, and the loop runs
        stream = fe.submit("r2", "s", 5 * BT + 1, 2, block_keys=keys(5))
        queued = await nxt(stream)
        await stream.aclose()
        assert queued.hit_tokens == 0 and queued.hit_lookup_failed
        assert env.svc.counters["hit_lookup_stall_retries"] == 1
        assert env.svc.counters["hit_lookup_failures"] == 1


# --------------------------------------------------------------------------- two real gateways

def _cfg(tmp: Path) -> DualpathConfig:
    data = base_config(tmp, {"rpc": {"reconnect_initial_s": 0.01, "reconnect_max_s": 0.05}})
    return build_config(data, DualpathConfig, "test", environ={})


async def test_a_stopped_gateway_leaves_the_lookup_to_the_other(tmp_path):
    cfg = _cfg(tmp_path)
    spec = spec_from_config(cfg.kv)
    bt = spec.block_tokens
    ks = block_keys_from_tokens(list(range(6 * bt)), bt)
    async with contextlib.AsyncExitStack() as stack:
        gws = {n: await stack.enter_async_context(GatewayService(cfg, n, spec=spec))
               for n in ("g0", "g1")}
        await gws["g0"].store.write_blocks(ks[:4], [full_block(spec, k) for k in ks[:4]])
        sched, lookup = await start_scheduler(
            stack, cfg, {n: ("127.0.0.1", g.rpc_port) for n, g in gws.items()},
            host="127.0.0.1")
        assert isinstance(lookup, GatewayHitLookup) and sched.hits is lookup
        assert [await lookup.lookup("s", ks) for _ in range(2)] == [4, 4]   # both answer
        fe = SchedulerClient("127.0.0.1", sched.port, rpc=cfg.rpc, client_id="fe")
        stack.push_async_callback(fe.close)
        await gws["g0"].stop()
        for i in range(2):                              # one of the two starts at g0
            stream = fe.submit(f"r{i}", "s", 6 * bt + 1, 2, block_keys=ks)
            queued = await nxt(stream)
            assert queued.hit_tokens == 4 * bt and not queued.hit_lookup_failed
            await stream.aclose()
        assert lookup.failures["g0"] >= 1 and lookup.failures["g1"] == 0
        assert sched.counters["hit_lookup_failures"] == 0
        assert sched.counters["hit_lookup_retries"] >= 1
