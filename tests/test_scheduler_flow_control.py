"""The live scheduler service's flow control: a full queue answers OVERLOADED with a retry
hint, fetch replies are bounded and resent until acknowledged, the telemetry the leaders see
counts decisions not yet fetched, and an idle group's fetch is long-polled.
Rig: ``test_scheduler_service.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.errors import Overloaded
from common.protocol import EngineLoad, FetchWork, RequestQueued
from tests.helpers import until
from tests.test_scheduler_service import BT, WAIT_S, keys, nxt, running


# --------------------------------------------------------------------------- flow control

async def test_queue_full_answers_overloaded_with_a_retry_hint():
    async with running(max_queued_requests=2, overload_retry_after_s=0.25) as env:
        await env.pair()
        fe = await env.client()
        first = [fe.submit(f"q{i}", "s", 100, 2) for i in range(2)]
        for s in first:
            await nxt(s)
        with pytest.raises(Overloaded) as e:
            await nxt(fe.submit("q2", "s", 100, 2))
        assert e.value.retryable and e.value.retry_after_s == 0.25
        assert await fe.cancel("q0")
        assert isinstance(await nxt(fe.submit("q2", "s", 100, 2)), RequestQueued)


async def test_fetch_replies_are_bounded_and_resent_until_acknowledged():
    async with running(max_plans_per_fetch=2) as env:
        p0, d0 = await env.pair()
        fe = await env.client()
        streams = [fe.submit(f"b{i}", "s", 100, 2) for i in range(5)]
        for s in streams:
            await nxt(s)
        assert len((await d0.fetch()).bindings) == 5
        raw = await env.raw()

        def ask(ack):
            return raw.call(FetchWork("p0", "", "prefill", p0.epoch, ack_seq=ack))
        r1 = await ask(0)
        assert [p.request_id for p in r1.plans] == ["b0", "b1"] and r1.more
        assert await ask(0) == r1                       # reply lost: the same one again
        r2 = await ask(r1.seq)
        assert [p.request_id for p in r2.plans] == ["b2", "b3"] and r2.seq == r1.seq + 1
        r3 = await ask(r2.seq)
        assert [p.request_id for p in r3.plans] == ["b4"] and not r3.more
        assert env.svc.counters["fetch_resends"] == 1


async def test_telemetry_counts_decisions_the_leader_has_not_received_yet():
    # Raw-token PE load: the unit the PE receivers report their engines' tok in.
    async with running({"beta_tokens": 250, "pe_load": "tokens"}, max_plans_per_fetch=1) as env:
        p0 = await env.node("p0", "prefill", engines=1)
        d0 = await env.node("d0", "decode", engines=1)
        fe = await env.client()
        streams = [fe.submit(f"r{i}", "s", 100, 2) for i in range(4)]   # held: a dropped
        for s in streams[:3]:                                             # stream cancels
            await nxt(s)
        await d0.fetch()
        first = await p0.fetch([EngineLoad("p0.e0", 0, 0)])     # places r0, r1, r2 (≤ β)
        assert [p.request_id for p in first.plans] == ["r0"] and first.more
        await nxt(streams[3])
        await d0.fetch()
        # The leader only knows r0; r1 and r2 wait in its outbox and still count.
        second = await p0.fetch([EngineLoad("p0.e0", 1, 100)])
        assert [p.request_id for p in second.plans] == ["r1"]
        assert env.core.engine_report("p0.e0").tok == 300          # above β: r3 must wait
        assert env.svc.request_state("r3") == "queued"


async def test_pe_buffer_telemetry_counts_plans_the_leader_has_not_received_yet():
    # Two PEs sharing a buffer for three 100-token prompts; one plan per fetch reply. The
    # leader's free figure knows only what it received: plans still in the outbox, for
    # either engine, are taken off it, so a fourth prompt waits.
    async with running({"beta_tokens": 10**6, "pe_load": "tokens"}, max_plans_per_fetch=1) as env:
        need = 100 * env.svc.kv.bytes_per_token
        p0 = await env.node("p0", "prefill", engines=2, buffer=3 * need)
        d0 = await env.node("d0", "decode", engines=1)
        fe = await env.client()
        streams = [fe.submit(f"r{i}", "s", 100, 2) for i in range(5)]
        for s in streams:
            await nxt(s)
        await d0.fetch()

        def loads(free: int) -> list[EngineLoad]:
            return [EngineLoad(f"p0.e{i}", 0, 0, free) for i in range(2)]

        first = await p0.fetch(loads(3 * need))                 # places r0, r1, r2: full
        assert [p.request_id for p in first.plans] == ["r0"] and first.more
        assert env.svc.request_state("r3") == "queued"
        second = await p0.fetch(loads(2 * need))                # r0 allocated; r1, r2 unsent
        assert [p.request_id for p in second.plans] == ["r1"]
        assert env.core.engine_report("p0.e0").free_hbm_bytes == 0
        assert env.svc.request_state("r3") == "queued"


async def test_de_buffer_telemetry_counts_bindings_the_leader_has_not_received_yet():
    # Two DEs on one decode node with room in their HBM for everything but a shared DE buffer
    # (protocol v7) for three requests; one binding per fetch reply. The buffer figure the
    # leader reports knows only the bindings it received: those still in the outbox, for
    # either engine, are taken off it, so a fourth request stays in the group's queue.
    async with running(max_bindings_per_fetch=1) as env:
        await env.node("p0", "prefill", engines=1)
        d0 = await env.node("d0", "decode", engines=2)
        fe = await env.client()
        streams = [fe.submit(f"r{i}", "s", 100, 2) for i in range(5)]
        for s in streams:
            await nxt(s)
        need = (100 + 2) * env.svc.kv.bytes_per_token            # each request's HBM bytes

        def loads(free: int) -> list[EngineLoad]:
            return [EngineLoad(f"d0.e{i}", 0, 0, 100 * need, buffer_free_bytes=free)
                    for i in range(2)]

        first = await d0.fetch(loads(3 * need))                 # binds r0, r1, r2: full
        assert [b.request_id for b in first.bindings] == ["r0"] and first.more
        assert env.svc.request_state("r3") == "queued"
        second = await d0.fetch(loads(2 * need))                # r0 allocated; r1, r2 unsent
        assert [b.request_id for b in second.bindings] == ["r1"]
        assert env.svc.request_state("r3") == "queued"
        third = await d0.fetch(loads(need))                     # r0, r1 allocated; r2 unsent
        assert [b.request_id for b in third.bindings] == ["r2"] and not third.more
        assert env.svc.request_state("r3") == "queued"


async def test_pe_receiver_telemetry_matches_the_cores_own_pe_accounting():
    # Default unit: prefill-cost-weighted tokens. The leader reports its engines' tok with the
    # PE receiver's own function over the plans it holds; the outbox adds the undelivered ones.
    # After every fetch the core's figure (replaced by telemetry) must equal what the core
    # counted itself from its placements and prefill_done events.
    from services.pe_receiver.service import plan_loads

    shapes = [(0, 5 * BT), (8 * BT, 2 * BT + 60), (0, 60), (4 * BT, 7), (16 * BT, 3 * BT),
              (0, 20 * BT), (2 * BT, 9)]
    async with running(max_plans_per_fetch=2) as env:
        p0 = await env.node("p0", "prefill", engines=2)
        d0 = await env.node("d0", "decode", engines=2)
        fe = await env.client()
        weigh = env.svc.config.scheduler.pe_load_counter()
        streams = []
        for i, (hit, new) in enumerate(shapes):
            n = (hit + new) // BT
            streams.append(fe.submit(f"r{i}", f"s{i}", hit + new, 3, block_keys=keys(n, i),
                                     hit_tokens=hit))
            await nxt(streams[-1])
        await d0.fetch()
        engines = ["p0.e0", "p0.e1"]
        held: dict[str, Any] = {}
        reply = await p0.fetch(plan_loads(engines, [], weigh))     # places all, sends 2
        own = {e: env.core.engine_report(e).tok for e in engines}  # the core's own count
        expect = {e: 0 for e in engines}
        for i, (hit, new) in enumerate(shapes):
            rs = env.svc.table.get(f"r{i}")
            expect[rs.assignment.pe_engine] += weigh(hit, new)
        assert own == expect and sum(own.values()) > sum(h + n for h, n in shapes)  # not raw
        for _ in range(len(shapes)):
            held.update((p.request_id, p) for p in reply.plans)
            if not reply.more:
                break
            reply = await p0.fetch(plan_loads(engines, held.values(), weigh))
            assert {e: env.core.engine_report(e).tok for e in engines} == own
        assert len(held) == len(shapes)
        # Prefill of two finishes: the core releases them, the leader stops reporting them.
        for rid in ("r0", "r1"):
            plan = held.pop(rid)
            for stage in ("allocated", "read_done", "prefill_done"):
                assert (await p0.report(rid, plan.attempt, stage)).current
            own[plan.pe_engine] -= weigh(plan.hit_tokens, plan.new_tokens)
        assert {e: env.core.engine_report(e).tok for e in engines} == own
        await p0.fetch(plan_loads(engines, held.values(), weigh))
        assert {e: env.core.engine_report(e).tok for e in engines} == own
        assert {r.engine_id: r.seq for r in env.core.engine_reports()
                if r.engine_id in engines} == {e: sum(p.pe_engine == e for p in held.values())
                                               for e in engines}


async def test_an_idle_groups_fetch_is_held_until_work_arrives():
    """Long-poll: an idle decode group's empty fetch waits for work instead of returning at
    once (an idle cluster must not poll every 20 ms); a submission wakes it with the binding,
    and a busy group is never held."""
    async with running(lease_s=30.0, heartbeat_s=1.0, fetch_wait_s=5.0) as env:
        p0, d0 = await env.pair()
        assert d0.fetch_wait_s == 5.0                        # told at registration (≤ lease/4)
        held = asyncio.ensure_future(d0.fetch([EngineLoad("d0.e0", 0, 0)]))
        await until(lambda: env.svc.counters["fetch_holds"] >= 1, what="the fetch to be held")
        assert not held.done()
        fe = await env.client()
        stream = fe.submit("w1", "s", 300, 4)
        await nxt(stream)                                    # RequestQueued: it is submitted
        reply = await asyncio.wait_for(held, WAIT_S)         # woken by the submission
        assert [b.request_id for b in reply.bindings] == ["w1"]
        holds = env.svc.counters["fetch_holds"]
        busy = await asyncio.wait_for(d0.fetch([EngineLoad("d0.e0", 1, 300)]), WAIT_S)
        assert busy.bindings == [] and env.svc.counters["fetch_holds"] == holds
