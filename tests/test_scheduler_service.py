"""The live scheduler service on 127.0.0.1:0 with fake node services driven step by step.

Fake group leaders are ``NodeSession``s (registration, heartbeats, FetchWork, ReportProgress)
whose fetches the tests call by hand, so every placement happens exactly when a test says.
Conditions are polled, never waited for with fixed sleeps; nothing asserts a duration.
The rig (``running``, ``Env``, ``nxt``, ...) is shared: ``test_scheduler_leases.py`` and
``test_scheduler_flow_control.py`` hold the node-loss and flow-control cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from common.config import RpcConfig, build_config
from services.config import ServicesConfig
from common.errors import AlreadyExists, DualpathError, ErrorCode, InvalidArgument, NotFound
from common.kv import block_keys_from_tokens
from common.protocol import (EngineInfo, EngineLoad, FetchWork, FirstToken, FrontendReply,
                             FrontendRequest, Heartbeat, Message, NodeReply, NodeRequest,
                             RegisterNode, ReportProgress, RequestEvent, RequestFailed,
                             RequestFinished, RequestPlaced, RequestQueued, SchedulerRequest,
                             SubmitRequest)
from common.rpc import RpcClient, check_handler_coverage
from services.scheduler.client.client import SchedulerClient
from services.scheduler.shell.hit_lookup import FunctionHitLookup
from services.scheduler.client.node_client import NodeSession
from services.scheduler.shell.service import SchedulerService
from tests.helpers import until

RPC = RpcConfig(reconnect_initial_s=0.01, reconnect_max_s=0.05, reconnect_attempts=5,
                default_deadline_s=10.0)
BT = 64                                   # test-small preset: 64-token blocks, 1 KiB per token
HBM = 1 << 40
WAIT_S = 5.0


def make_cfg(scheduler: dict | None = None, **service: Any):
    sched = {"alpha_tokens": 10**9, "beta_tokens": 10**9, "max_replans": 2, **(scheduler or {})}
    svc = {"lease_s": 0.5, "heartbeat_s": 0.05, "lease_check_s": 0.02, "max_block_keys": 32,
           "drain_grace_s": 0.5, **service}
    return build_config({"kv": {"preset": "test-small"}, "rpc": msgspec.to_builtins(RPC),
                         "scheduler": sched, "scheduler_service": svc}, ServicesConfig, environ={})


def keys(n: int, seed: int = 0) -> list[str]:
    return block_keys_from_tokens([seed] * (n * BT), BT)


class Env:
    """One scheduler service plus the fakes a test creates; all closed at the end."""

    def __init__(self, svc: SchedulerService) -> None:
        self.svc = svc
        self.core = svc.core
        self._closers: list[Any] = []

    @property
    def base(self) -> int:
        """This scheduler epoch's first attempt number (``attempt_base``): a request's first
        plan carries it, each re-plan one more."""
        return self.core.attempt_base

    async def node(self, node_id: str, role: str, engines: int = 2, hbm: int = HBM,
                   service: str | None = None, epoch: int | None = None,
                   buffer: int = 0) -> NodeSession:
        """``hbm``: each DE's HBM; ``buffer``: a prefill node's PE buffer (0: not stated)."""
        infos = [EngineInfo(f"{node_id}.e{i}", role, hbm if role == "decode" else buffer)
                 for i in range(engines)]
        s = NodeSession(RPC, "127.0.0.1", self.svc.port, node_id=node_id,
                        service=service or ("pe_receiver" if role == "prefill" else "de_loader"),
                        role=role, control=("127.0.0.1", 9000 + len(self._closers)),
                        ucx=("127.0.0.1", 9500 + len(self._closers)), engines=infos,
                        epoch=epoch, kv_fingerprint=self.svc.kv.fingerprint())
        await s.start()
        self._closers.append(s.close)
        return s

    async def gateway(self, node_id: str, role: str) -> NodeSession:
        return await self.node(node_id, role, engines=0, service="storage_gateway")

    async def pair(self) -> tuple[NodeSession, NodeSession]:
        return await self.node("p0", "prefill"), await self.node("d0", "decode")

    async def client(self, name: str = "fe") -> SchedulerClient:
        c = SchedulerClient("127.0.0.1", self.svc.port, rpc=RPC, client_id=name)
        await c.connect()
        self._closers.append(c.close)
        return c

    async def raw(self, reply_type: Any = NodeReply) -> RpcClient:
        c = RpcClient(RPC, "127.0.0.1", self.svc.port, role="test", node_id="raw",
                      reply_type=reply_type, event_type=RequestEvent)
        self._closers.append(c.close)
        return c

    async def aclose(self) -> None:
        for close in reversed(self._closers):
            await close()


@contextlib.asynccontextmanager
async def running(scheduler: dict | None = None, hit_lookup=None, **service: Any
                  ) -> AsyncIterator[Env]:
    svc = SchedulerService(make_cfg(scheduler, **service), port=0, hit_lookup=hit_lookup)
    await svc.start()
    env = Env(svc)
    try:
        yield env
    finally:
        await env.aclose()
        await svc.stop()


async def nxt(stream) -> Any:
    return await asyncio.wait_for(stream.__anext__(), WAIT_S)


async def queued_r(env) -> tuple[Any, Any, Any]:
    """The usual start: a PE/DE pair, a frontend, request ``r`` submitted and queued;
    ``(p0, d0, its event stream)``."""
    p0, d0 = await env.pair()
    fe = await env.client()
    stream = fe.submit("r", "s", 200, 3)
    await nxt(stream)
    return p0, d0, stream


async def ended(stream) -> bool:
    with contextlib.suppress(StopAsyncIteration):
        await nxt(stream)
        return False
    return True


async def run_stages(node: NodeSession, plan, tokens: int = 4) -> None:
    for stage in ("allocated", "read_done", "prefill_done", "second_token"):
        reply = await node.report(plan.request_id, plan.attempt, stage)
        assert reply.current, (stage, reply)
    await node.report(plan.request_id, plan.attempt, "finished", tokens=tokens)


def assert_idle(svc: SchedulerService) -> None:
    assert svc.active_requests == 0
    assert svc.core.queue_lengths()["total"] == 0
    assert all(r.seq == 0 and r.tok == 0 for r in svc.core.engine_reports())


# --------------------------------------------------------------------------- coverage

def test_every_request_of_both_channels_has_a_handler():
    svc = SchedulerService(make_cfg())
    assert check_handler_coverage(svc.handlers, FrontendRequest) == []
    assert check_handler_coverage(svc.handlers, NodeRequest) == []
    assert check_handler_coverage(svc.handlers, SchedulerRequest) == []


# --------------------------------------------------------------------------- happy path

async def test_submit_streams_events_in_order_with_ttft_breakdown():
    async with running() as env:
        p0, d0 = await env.pair()
        await env.gateway("p0", "prefill")
        await env.gateway("d0", "decode")
        fe = await env.client()
        ks = keys(10)
        stream = fe.submit("r1", "s1", 10 * BT + 60, 5, block_keys=ks, hit_tokens=8 * BT)
        queued = await nxt(stream)
        assert queued == RequestQueued("r1", 0, 8 * BT)

        bound = await d0.fetch()
        assert [(b.request_id, b.attempt, b.de_engine) for b in bound.bindings] == \
            [("r1", env.base, "d0.e0")]
        assert bound.bindings[0].hbm_bytes == (10 * BT + 60 + 5) * env.svc.kv.bytes_per_token
        plan = (await p0.fetch()).plans[0]
        assert (plan.pe_node, plan.de_engine, plan.read_side, plan.read_node) == \
            ("p0", "d0.e0", "pe", "p0")
        assert plan.hit_keys == ks[:8] and plan.new_keys == ks[8:]
        assert (plan.hit_tokens, plan.new_tokens, plan.gen_tokens) == (8 * BT, 2 * BT + 60, 5)
        assert plan.de_loader.node_id == "d0" and plan.de_loader.service == "de_loader"
        assert (plan.read_gateway.node_id, plan.read_gateway.service) == ("p0", "storage_gateway")
        placed = await nxt(stream)
        assert isinstance(placed, RequestPlaced)
        assert (placed.pe_engine, placed.de_node, placed.read_side, placed.attempt) == \
            ("p0.e0", "d0", "pe", env.base)
        assert env.svc.request_state("r1") == "loading"

        await run_stages(p0, plan, tokens=5)
        first = await nxt(stream)
        assert isinstance(first, FirstToken)
        parts = (first.sched_s, first.alloc_s, first.read_s, first.prefill_s)
        assert min(parts) >= 0 and first.ttft_s == pytest.approx(sum(parts))
        done = await nxt(stream)
        assert isinstance(done, RequestFinished)
        assert (done.tokens, done.hit_tokens, done.attempt) == (5, 8 * BT, env.base)
        assert done.ttst_s is not None and done.ttst_s >= 0 and done.tpot_s >= 0
        assert done.ttft_s == first.ttft_s and done.e2e_s >= done.ttft_s
        assert await ended(stream)
        assert_idle(env.svc)
        status = await fe.cluster_status()
        assert status.requests == {} and status.counters["finished"] == 1
        assert {(n.node_id, n.service) for n in status.nodes} >= {("p0", "pe_receiver"),
                                                                  ("d0", "storage_gateway")}
        late = await p0.report("r1", 0, "finished")
        assert (late.current, late.state) == (False, "finished")


async def test_a_heartbeat_held_up_past_a_quarter_of_the_lease_is_counted_by_its_cause():
    """A node whose next heartbeat could not go out for a quarter of its lease says so
    (``heartbeat_loop_stalled`` / ``heartbeat_reply_slow``, NodeSession.stats), so a lease the
    scheduler expires names why the node fell silent."""
    async with running(lease_s=2.0, heartbeat_s=0.1) as env:
        d0 = await env.node("d0", "decode")
        assert (d0.lease_s, d0.stats()["heartbeats_late_loop"]) == (2.0, 0.0)

        def late() -> float:
            s = d0.stats()
            return s["heartbeats_late_loop"] + s["heartbeats_late_reply"]

        await until(lambda: d0.stats()["heartbeats_sent"] >= 1, WAIT_S, what="a heartbeat")
        # the stimulus, not a wait: this process stands still for 1 s, twice the threshold;
        # the heartbeat's sleep ends >= 0.9 s late (or a call in flight gets its reply that late)
        time.sleep(1.0)
        await until(lambda: late() >= 1, WAIT_S, what=lambda: f"no late heartbeat: {d0.stats()}")
        assert d0.stats()["heartbeat_late_max_s"] >= 0.5, d0.stats()
        # the scheduler (in this process too) excused its own stall: the node kept its lease
        assert "d0" in {reg.node_id for reg in env.svc.leases}


async def test_hit_length_comes_from_the_session_or_the_injected_lookup():
    async with running() as env:
        p0, d0 = await env.pair()
        fe = await env.client()
        turn1 = list(range(5 * BT + 10))
        turn2 = turn1 + list(range(1000, 1000 + 2 * BT))
        for rid, toks, want_hit in (("t1", turn1, 0), ("t2", turn2, 5 * BT)):
            stream = fe.submit(rid, "agent", len(toks), 3, token_ids=toks)
            assert (await nxt(stream)).hit_tokens == want_hit
            await d0.fetch()
            plan = (await p0.fetch()).plans[0]
            assert plan.hit_keys == block_keys_from_tokens(toks, BT)[:want_hit // BT]
            await run_stages(p0, plan)
            assert [type(e) for e in [await nxt(stream) for _ in range(3)]] == \
                [RequestPlaced, FirstToken, RequestFinished]
        other = fe.submit("t3", "another-agent", len(turn2), 3, token_ids=turn2)
        assert (await nxt(other)).hit_tokens == 0       # hits stay within a session
        await other.aclose()

    async def lookup(ks):
        if len(ks) == 7:
            raise ConnectionError("index down")
        return 100                                      # clamped to the keys and prompt
    async with running(hit_lookup=FunctionHitLookup(lookup)) as env:
        await env.pair()
        fe = await env.client()
        s1 = fe.submit("a", "s", 5 * BT, 2, block_keys=keys(5))
        assert (await nxt(s1)).hit_tokens == 4 * BT     # ≥ 1 token is always computed
        s2 = fe.submit("b", "s", 7 * BT + 1, 2, block_keys=keys(7))
        assert (await nxt(s2)).hit_tokens == 0          # lookup failed: recompute
        assert env.svc.counters["hit_lookup_failures"] == 1


# --------------------------------------------------------------------------- cancel, deadline

async def test_cancel_ends_the_stream_and_revokes_dispatched_work():
    async with running() as env:
        p0, d0 = await env.pair()
        fe, other = await env.client("fe"), await env.client("ops")
        stream = fe.submit("c1", "s", 300, 4)
        await nxt(stream)
        assert len((await d0.fetch()).bindings) == 1
        assert await other.cancel("c1") is True
        failed = await nxt(stream)
        assert isinstance(failed, RequestFailed) and failed.code == ErrorCode.CANCELLED
        assert not failed.retryable and await ended(stream)
        revoked = (await d0.fetch()).revoked
        assert [(r.request_id, r.attempt) for r in revoked] == [("c1", env.base)]
        assert (await p0.fetch()).plans == []
        assert await other.cancel("c1") is False         # already ended: no error
        with pytest.raises(NotFound):
            await other.cancel("never-submitted")
        assert_idle(env.svc)


async def test_deadline_expiry_fails_the_request_and_releases_it():
    async with running() as env:
        p0, d0 = await env.pair()
        fe = await env.client()
        stream = fe.submit("late", "s", 200, 4, deadline_s=0.2)
        await nxt(stream)
        await d0.fetch()                                 # bound, then nobody prefills it
        failed = await nxt(stream)
        assert isinstance(failed, RequestFailed)
        assert failed.code == ErrorCode.DEADLINE_EXCEEDED and failed.retryable
        assert [r.request_id for r in (await d0.fetch()).revoked] == ["late"]
        assert_idle(env.svc)
        assert env.svc.counters["deadline_exceeded"] == 1


# --------------------------------------------------------------------------- frontends

async def test_frontend_disconnect_cancels_its_requests_and_frees_them():
    async with running() as env:
        p0, d0 = await env.pair()
        leaving, staying = await env.client("leaving"), await env.client("staying")
        streams = [leaving.submit(f"x{i}", "s", 100, 2) for i in range(3)]
        for s in streams:
            await nxt(s)
        kept = staying.submit("kept", "s", 100, 2)
        await nxt(kept)
        await d0.fetch()
        await p0.fetch()
        await leaving.close()
        await until(lambda: env.svc.active_requests == 1, what="cancellation")
        revoked = {r.request_id for r in (await d0.fetch()).revoked}
        assert revoked == {"x0", "x1", "x2"}
        assert env.svc.request_state("kept") == "loading"
        assert env.svc.counters["cancelled"] == 3


async def test_leaving_the_stream_early_cancels_the_request():
    async with running() as env:
        await env.pair()
        fe = await env.client()
        stream = fe.submit("gone", "s", 100, 2)
        await nxt(stream)
        await stream.aclose()
        await until(lambda: env.svc.active_requests == 0, what="cancel")


class SubmitWithExtra(Message, tag="sched.submit"):
    request_id: str
    session_id: str
    prompt_tokens: int
    gen_tokens: int
    surprise: int = 1


class SubmitWrongType(Message, tag="sched.submit"):
    request_id: str
    session_id: str
    prompt_tokens: str
    gen_tokens: int


def bad_submissions() -> list[tuple[str, Any, type[DualpathError]]]:
    ok = dict(request_id="bad", session_id="s", prompt_tokens=20 * BT, gen_tokens=2)
    def sub(**kw) -> SubmitRequest:
        return SubmitRequest(**{**ok, **kw})
    k = keys(20)
    return [
        ("negative prompt", sub(prompt_tokens=-1), InvalidArgument),
        ("zero gen", sub(gen_tokens=0), InvalidArgument),
        ("negative gen", sub(gen_tokens=-5), InvalidArgument),
        ("too many keys", sub(prompt_tokens=40 * BT, block_keys=keys(40)), InvalidArgument),
        ("malformed key", sub(block_keys=["../etc/passwd"]), InvalidArgument),
        ("upper-case key", sub(block_keys=[k[0].upper()]), InvalidArgument),
        ("keys beyond prompt", sub(prompt_tokens=10 * BT, block_keys=k[:11]), InvalidArgument),
        ("keys and tokens", sub(block_keys=k[:1], token_ids=[0] * 20 * BT), InvalidArgument),
        ("token count mismatch", sub(token_ids=[1, 2, 3]), InvalidArgument),
        ("negative token id", sub(prompt_tokens=2, token_ids=[1, -1]), InvalidArgument),
        ("hit covers prompt", sub(hit_tokens=20 * BT), InvalidArgument),
        ("negative hit", sub(hit_tokens=-64), InvalidArgument),
        ("hit off block", sub(block_keys=k[:4], hit_tokens=100), InvalidArgument),
        ("hit beyond keys", sub(block_keys=k[:2], hit_tokens=3 * BT), InvalidArgument),
        ("negative deadline", sub(deadline_s=-1.0), InvalidArgument),
        ("nan deadline", sub(deadline_s=float("nan")), InvalidArgument),
        ("empty request id", sub(request_id=""), InvalidArgument),
        ("empty session", sub(session_id=""), InvalidArgument),
        ("over DE memory", sub(prompt_tokens=100_000), InvalidArgument),
        ("duplicate id", sub(request_id="taken"), AlreadyExists),
        ("unknown field", SubmitWithExtra("bad", "s", 100, 2), InvalidArgument),
        ("wrong type", SubmitWrongType("bad", "s", "100", 2), InvalidArgument),
    ]


async def test_bad_submissions_get_typed_errors_while_others_keep_working():
    async with running() as env:
        p0 = await env.node("p0", "prefill")
        d0 = await env.node("d0", "decode", hbm=64 << 20)    # 64 MiB: 65,536 tokens at most
        good, bad = await env.client("good"), await env.client("bad")
        taken = good.submit("taken", "s", 100, 2)
        await nxt(taken)
        raw = await env.raw(FrontendReply)
        for name, msg, err in bad_submissions():
            with pytest.raises(err) as e:
                async for _ in raw.stream(msg, timeout=WAIT_S):
                    pass
            assert e.value.code == err.code, name
            assert await good.cluster_status()            # the server keeps serving
        with pytest.raises(InvalidArgument):                # and the bad client still can talk
            async for _ in bad.submit("b2", "s", 0, 1):
                pass
        await d0.fetch()
        await run_stages(p0, (await p0.fetch()).plans[0])
        assert [type(await nxt(taken)) for _ in range(3)] == \
            [RequestPlaced, FirstToken, RequestFinished]
        assert env.svc.counters["rejected_invalid"] == len(bad_submissions()) - 2 + 1
        assert_idle(env.svc)


async def test_bad_node_messages_get_typed_errors():
    async with running() as env:
        p0, d0 = await env.pair()
        raw = await env.raw()
        def reg(node="n9", service="pe_receiver", role="prefill", engines=(), epoch=1):
            return RegisterNode(node, service, role, "h", 1, "h", 2, list(engines), epoch)
        cases = [
            (reg(engines=[EngineInfo("n9.e0", "decode")]), InvalidArgument),     # role mismatch
            (reg(role="gpu"), InvalidArgument),
            (reg(engines=[EngineInfo("p0.e0", "prefill")]), AlreadyExists),       # p0's engine
            (reg(node="p0", service="other", engines=[EngineInfo("x", "prefill")]),
             AlreadyExists),                                                      # 2nd leader
            (reg(node="p0", epoch=p0.epoch), AlreadyExists),      # same epoch, other details
            (reg(engines=[EngineInfo("a", "prefill"), EngineInfo("a", "prefill")]),
             InvalidArgument),
            (reg(node=""), InvalidArgument),
            (Heartbeat("nobody", "x", 1), NotFound),
            (FetchWork("p0", "", "prefill", p0.epoch, [EngineLoad("d0.e0", 0, 0)]),
             InvalidArgument),                                    # not p0's engine
            (FetchWork("p0", "", "prefill", p0.epoch, [EngineLoad("p0.e0", -1, 0)]),
             InvalidArgument),
            (FetchWork("p0", "", "prefill", p0.epoch + 5), NotFound),
            (FetchWork("p0", "elsewhere", "prefill", p0.epoch), InvalidArgument),
            (FetchWork("p0", "", "cook", p0.epoch), InvalidArgument),
            (ReportProgress("r", 0, "teleported"), InvalidArgument),
        ]
        for msg, err in cases:
            with pytest.raises(err):
                await raw.call(msg, timeout=WAIT_S)
        assert (await raw.call(ReportProgress("nope", 0, "read_done"))).current is False
        assert len((await p0.fetch()).plans) == 0                 # both leaders still fine
        assert len(env.svc.leases) == 2
