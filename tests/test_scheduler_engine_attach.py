"""The live scheduler service when a node reports one of its engines not attached
(``EngineLoad.attached``: the engine's process, behind the node's engine socket, died or has
not started): what it held re-plans onto the others, nothing new is placed on it, and it is
placed on again once the node reports it attached (docs/engine-api.md, "An engine that is not
attached"). Before, a dead engine kept its share of new placements, each held to its deadline.
Rig: ``test_scheduler_service.py`` (fake group leaders whose fetches the tests call by hand).
"""

from __future__ import annotations

from common.protocol import EngineLoad, RequestPlaced
from tests.test_scheduler_service import BT, keys, nxt, run_stages, running


def load(engine_id: str, attached: bool) -> list[EngineLoad]:
    return [EngineLoad(engine_id, 0, 0, attached=attached)]


async def test_a_detached_decode_engine_loses_its_request_and_new_ones_until_it_is_back():
    async with running() as env:
        p0 = await env.node("p0", "prefill", engines=1)
        d0, d1 = (await env.node("d0", "decode", engines=1),
                  await env.node("d1", "decode", engines=1))
        fe = await env.client()
        stream = fe.submit("r", "s", 4 * BT, 3, block_keys=keys(4), hit_tokens=2 * BT)
        await nxt(stream)
        assert [b.request_id for b in (await d0.fetch()).bindings] == ["r"]  # first DE group

        gone = await d0.fetch(load("d0.e0", False))        # d0's engine process died
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
        assert (await d0.fetch(load("d0.e0", False))).bindings == []
        assert [b.request_id for b in (await d1.fetch()).bindings] == ["r2"]

        # the engine is back: d0 is placed on again (the least loaded)
        await d0.fetch(load("d0.e0", True))
        assert env.svc.counters["engines_attached"] == 1
        assert all(e.attached for e in (await fe.cluster_status()).engines)
        stream3 = fe.submit("r3", "s3", 2 * BT, 3)
        await nxt(stream3)
        assert [b.request_id for b in (await d0.fetch(load("d0.e0", True))).bindings] == ["r3"]
        await run_stages(p0, plan)
        assert env.svc.counters["replans"] == 1


async def test_a_detached_prefill_engine_re_plans_onto_the_other_pe_keeping_the_de():
    async with running() as env:
        p0, p1 = (await env.node("p0", "prefill", engines=1),
                  await env.node("p1", "prefill", engines=1))
        d0 = await env.node("d0", "decode", engines=1)
        fe = await env.client()
        stream = fe.submit("r", "s", 4 * BT, 3, block_keys=keys(4), hit_tokens=2 * BT)
        await nxt(stream)
        await d0.fetch()
        assert (await p0.fetch()).plans[0].pe_node == "p0"
        assert (await nxt(stream)).pe_node == "p0"
        gone = await p0.fetch(load("p0.e0", False))
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
        await d0.fetch(load("d0.e0", False))
        await p0.fetch(load("p0.e0", False))
        fe = await env.client()
        stream = fe.submit("r", "s", 2 * BT, 3)
        await nxt(stream)
        assert (await d0.fetch(load("d0.e0", False))).bindings == []
        assert env.svc.request_state("r") == "queued"
        assert [b.request_id for b in (await d0.fetch(load("d0.e0", True))).bindings] == ["r"]
        assert (await p0.fetch(load("p0.e0", False))).plans == []
        plans = (await p0.fetch(load("p0.e0", True))).plans
        assert [(p.request_id, p.attempt) for p in plans] == [("r", env.base)]
        placed = await nxt(stream)
        assert isinstance(placed, RequestPlaced) and placed.attempt == env.base, placed
        assert env.svc.counters["replans"] == 0
