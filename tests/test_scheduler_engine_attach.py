"""The live scheduler service when a node reports one of its engines not attached
(``EngineLoad.attached``: the engine's process, behind the node's engine socket, died or has
not started): what it held re-plans onto the others, nothing new is placed on it, and it is
placed on again once the node reports it attached (docs/engine-api.md, "An engine that is not
attached"). Before, a dead engine kept its share of new placements, each held to its deadline.
A node's failure report naming the engine whose process detached (protocol v6) takes it out
before its request re-plans: one re-plan, where telemetry alone could cost two.
Rig: ``test_scheduler_service.py`` (fake group leaders whose fetches the tests call by hand).
"""

from __future__ import annotations

import pytest

from common.errors import InvalidArgument
from common.protocol import EngineLoad, RequestFinished, RequestPlaced
from tests.test_scheduler_service import BT, keys, nxt, run_stages, running


def attached(engine_id: str, attach_no: int, is_attached: bool = True) -> list[EngineLoad]:
    """One engine's telemetry: (not) attached, and how many times it attached to its node."""
    return [EngineLoad(engine_id, 0, 0, attached=is_attached, attaches=attach_no)]


async def test_a_detached_decode_engine_loses_its_request_and_new_ones_until_it_is_back():
    async with running() as env:
        p0 = await env.node("p0", "prefill", engines=1)
        d0, d1 = (await env.node("d0", "decode", engines=1),
                  await env.node("d1", "decode", engines=1))
        fe = await env.client()
        stream = fe.submit("r", "s", 4 * BT, 3, block_keys=keys(4), hit_tokens=2 * BT)
        await nxt(stream)
        assert [b.request_id for b in (await d0.fetch()).bindings] == ["r"]  # first DE group

        gone = await d0.fetch(attached("d0.e0", 1, False))        # d0's engine process died
        assert [(r.request_id, r.attempt) for r in gone.revoked] == [("r", env.base)]
        assert env.svc.counters["engines_detached"] == 1
        assert "d0.e0" not in {r.engine_id for r in env.core.engine_reports()}
        status = await fe.cluster_status()
        assert {e.engine_id: e.attached for e in status.engines} == {
            "p0.e0": True, "d0.e0": False, "d1.e0": True}
        assert [(b.request_id, b.attempt) for b in (await d1.fetch()).bindings] == [
            ("r", env.base + 1)]
        plan = (await p0.fetch()).plans[0]
        assert (plan.de_node, plan.attempt) == ("d1", env.base + 1)
        placed = await nxt(stream)
        assert isinstance(placed, RequestPlaced) and placed.de_node == "d1", placed

        # a new request while d0's engine is still away: d1 takes it though d1 is busier
        stream2 = fe.submit("r2", "s2", 2 * BT, 3)
        await nxt(stream2)
        assert (await d0.fetch(attached("d0.e0", 1, False))).bindings == []
        assert [b.request_id for b in (await d1.fetch()).bindings] == ["r2"]

        # the engine is back: d0 is placed on again (the least loaded)
        await d0.fetch(attached("d0.e0", 2))
        assert env.svc.counters["engines_attached"] == 1
        assert all(e.attached for e in (await fe.cluster_status()).engines)
        stream3 = fe.submit("r3", "s3", 2 * BT, 3)
        await nxt(stream3)
        assert [b.request_id for b in (await d0.fetch(attached("d0.e0", 2))).bindings] == ["r3"]
        await run_stages(p0, plan)
        assert env.svc.counters["replans"] == 1


async def _placed_on_p0(env):
    """p0, p1 (prefill), d0 (decode); request ``r`` planned on p0.e0 (attachment 1)."""
    p0, p1 = (await env.node("p0", "prefill", engines=1),
              await env.node("p1", "prefill", engines=1))
    d0 = await env.node("d0", "decode", engines=1)
    fe = await env.client()
    stream = fe.submit("r", "s", 4 * BT, 3, block_keys=keys(4), hit_tokens=2 * BT)
    await nxt(stream)
    await d0.fetch()
    plan = (await p0.fetch(attached("p0.e0", 1))).plans[0]
    assert plan.pe_node == "p0"
    assert (await nxt(stream)).pe_node == "p0"
    return p0, p1, d0, stream, plan


async def test_a_detached_prefill_engine_re_plans_onto_the_other_pe_keeping_the_de():
    async with running() as env:
        p0, p1, d0, stream, _ = await _placed_on_p0(env)
        gone = await p0.fetch(attached("p0.e0", 1, False))
        assert [(r.request_id, r.attempt) for r in gone.revoked] == [("r", env.base)]
        rebind = await d0.fetch()                             # the same DE, a new attempt
        assert [(b.request_id, b.attempt) for b in rebind.bindings] == [("r", env.base + 1)]
        plan = (await p1.fetch()).plans[0]
        assert (plan.pe_node, plan.de_node, plan.attempt) == ("p1", "d0", env.base + 1)
        assert (await nxt(stream)).pe_node == "p1"


async def test_with_every_engine_detached_requests_wait_and_are_placed_once_one_attaches():
    """Engines that have not attached yet (a node up before its engine processes) get no
    placement; the request waits in the scheduler, not in a port nobody reads."""
    async with running() as env:
        p0 = await env.node("p0", "prefill", engines=1)
        d0 = await env.node("d0", "decode", engines=1)
        await d0.fetch(attached("d0.e0", 0, False))
        await p0.fetch(attached("p0.e0", 0, False))
        fe = await env.client()
        stream = fe.submit("r", "s", 2 * BT, 3)
        await nxt(stream)
        assert (await d0.fetch(attached("d0.e0", 0, False))).bindings == []
        assert env.svc.request_state("r") == "queued"
        assert [b.request_id for b in (await d0.fetch(attached("d0.e0", 1))).bindings] == ["r"]
        assert (await p0.fetch(attached("p0.e0", 0, False))).plans == []
        plans = (await p0.fetch(attached("p0.e0", 1))).plans
        assert [(p.request_id, p.attempt) for p in plans] == [("r", env.base)]
        placed = await nxt(stream)
        assert isinstance(placed, RequestPlaced) and placed.attempt == env.base, placed
        assert env.svc.counters["replans"] == 0


DIED = dict(code="PEER_FAILED", message="engine p0.e0 on p0: engine disconnected",
            retryable=True, hop="engine")


async def test_a_failure_naming_the_detached_engine_re_plans_its_request_once():
    """The node's failure report names the engine whose process died (protocol v6): the
    engine leaves placement before the request re-plans, and p0's telemetry from before the
    death ("attached", attachment 1) does not bring it back — only attachment 2 does. Before,
    the re-planned request could land on the dead engine again (a fetch held meanwhile) and
    re-plan a second time when the node's next fetch said the engine was gone."""
    async with running() as env:
        p0, p1, d0, stream, plan = await _placed_on_p0(env)
        reply = await p0.report("r", plan.attempt, "failed", detached_engine="p0.e0",
                                engine_attaches=1, **DIED)
        assert not reply.current
        assert env.svc.counters["engines_detached"] == 1 and env.svc.counters["replans"] == 1
        assert (await p0.fetch(attached("p0.e0", 1))).plans == []      # older than the death
        assert "p0.e0" not in {r.engine_id for r in env.core.engine_reports()}
        assert env.svc.counters["engines_attached"] == 0
        rebind = await d0.fetch()
        assert [(b.request_id, b.attempt) for b in rebind.bindings] == [("r", env.base + 1)]
        plan2 = (await p1.fetch()).plans[0]
        assert (plan2.pe_node, plan2.attempt) == ("p1", env.base + 1)
        await run_stages(p1, plan2)
        while not isinstance(ev := await nxt(stream), RequestFinished):
            pass
        first = ev.attempts[0]
        assert (first.outcome, first.hop, first.code) == ("failed", "engine", "PEER_FAILED")
        await p0.fetch(attached("p0.e0", 2))                          # attached again
        assert env.svc.counters["engines_attached"] == 1
        assert "p0.e0" in {r.engine_id for r in env.core.engine_reports()}
        assert env.svc.counters["replans"] == 1


async def test_without_the_engine_named_a_stale_fetch_costs_a_second_re_plan():
    """The same death reported the old way (no ``detached_engine``): the request re-plans, a
    fetch of p0 whose telemetry predates the death places it on p0.e0 again, and the next
    fetch's "not attached" re-plans it a second time — what the field above saves."""
    async with running() as env:
        p0, p1, d0, stream, plan = await _placed_on_p0(env)
        assert not (await p0.report("r", plan.attempt, "failed", **DIED)).current
        await d0.fetch()
        again = (await p0.fetch(attached("p0.e0", 1))).plans
        assert [(p.pe_node, p.attempt) for p in again] == [("p0", env.base + 1)]
        gone = await p0.fetch(attached("p0.e0", 1, False))
        assert [(r.request_id, r.attempt) for r in gone.revoked] == [("r", env.base + 1)]
        assert env.svc.counters["replans"] == 2


async def test_a_detached_engine_that_is_not_the_attempts_is_an_ordinary_failure():
    """A report naming an engine other than the attempt's (or one the node does not lead)
    takes nothing out: the request re-plans as for any retryable failure; a negative
    attachment number is refused."""
    async with running() as env:
        p0, p1, d0, stream, plan = await _placed_on_p0(env)
        with pytest.raises(InvalidArgument, match="engine_attaches"):
            await p0.report("r", plan.attempt, "failed", detached_engine="p0.e0",
                            engine_attaches=-1, **DIED)
        assert not (await p0.report("r", plan.attempt, "failed", detached_engine="d0.e0",
                                    engine_attaches=1, **DIED)).current
        assert env.svc.counters["engines_detached"] == 0 and env.svc.counters["replans"] == 1
        assert {"p0.e0", "d0.e0"} <= {r.engine_id for r in env.core.engine_reports()}


async def test_the_end_of_an_attachment_reported_after_a_later_one_takes_nothing_out():
    """The engine died and was back (attachment 2, in p0's telemetry) before the node's
    failure report of attachment 1 came: the report re-plans its request as any retryable
    failure, and the live engine stays in placement."""
    async with running() as env:
        p0, p1, d0, stream, plan = await _placed_on_p0(env)
        await p0.fetch(attached("p0.e0", 2))
        assert not (await p0.report("r", plan.attempt, "failed", detached_engine="p0.e0",
                                    engine_attaches=1, **DIED)).current
        assert env.svc.counters["engines_detached"] == 0 and env.svc.counters["replans"] == 1
        assert "p0.e0" in {r.engine_id for r in env.core.engine_reports()}


async def test_the_nodes_account_of_a_failure_replaces_the_schedulers_when_it_comes_second():
    """The node's telemetry ("not attached") reached the scheduler before its failure report:
    the scheduler closed the attempt on the node's behalf (hop ``scheduler``); the report,
    stale for placement, still gives the record its hop, code and message — why the engine
    went (it died, went silent, got stuck), though a stale report without
    ``detached_engine`` came before it."""
    async with running() as env:
        p0, p1, d0, stream, plan = await _placed_on_p0(env)
        gone = await p0.fetch(attached("p0.e0", 1, False))
        assert [(r.request_id, r.attempt) for r in gone.revoked] == [("r", plan.attempt)]
        assert not (await p0.report("r", plan.attempt, "failed", **DIED)).current
        late = await p0.report("r", plan.attempt, "failed", detached_engine="p0.e0",
                               engine_attaches=1, code="PEER_FAILED", retryable=True,
                               message="engine p0.e0 on p0: silent for 15.2 s", hop="engine")
        assert not late.current
        await d0.fetch()
        plan2 = (await p1.fetch()).plans[0]
        await run_stages(p1, plan2)
        while not isinstance(ev := await nxt(stream), RequestFinished):
            pass
        first = ev.attempts[0]
        assert (first.outcome, first.hop, first.code) == ("failed", "engine", "PEER_FAILED")
        assert first.message == "engine p0.e0 on p0: silent for 15.2 s"
        assert env.svc.counters["replans"] == 1
