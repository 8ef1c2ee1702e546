"""A turn whose hit is shorter than what the session's previous turn stored (issue 16, item 4).

The scheduler remembers which blocks each session's finished turn left in storage
(``stored_prefix.PromisedPrefixes``); when the next turn's storage lookup finds fewer — the
write-backs were lost with a DE, or storage dropped them — it is counted
(``hit_shortfalls``, ``hit_shortfall_tokens``), logged, and put in the request's records.
"""

from __future__ import annotations

from common.protocol import RequestFinished, RequestQueued
from services.scheduler.shell.hit_lookup import FunctionHitLookup
from services.scheduler.shell.stored_prefix import PromisedPrefixes
from tests.test_scheduler_restart import run_to_first_token
from tests.test_scheduler_service import BT, keys, nxt, running


def test_shortfall_counts_only_what_was_promised_and_usable():
    p = PromisedPrefixes(limit=2)
    k = keys(6)
    assert p.shortfall("s", k, 0, 6) == 0                 # nothing stored yet: no promise
    p.finished("s", k[:4])
    assert p.shortfall("s", k, 4, 6) == 0                 # found all four
    assert p.shortfall("s", k, 1, 6) == 3
    assert p.shortfall("s", k, 1, 2) == 1                 # only 2 blocks usable as a hit
    assert p.shortfall("s", keys(6, seed=9), 0, 6) == 0   # another prefix: no promise
    p.finished("t", k)
    p.finished("u", k)                                    # bounded: "s" is forgotten
    assert p.shortfall("s", k, 0, 6) == 0


async def test_a_turn_that_finds_less_than_its_session_stored_says_by_how_much():
    found = {"blocks": 0}
    async with running(hit_lookup=FunctionHitLookup(lambda ks: found["blocks"])) as env:
        p0, d0 = await env.pair()
        fe = await env.client()
        k = keys(8)
        first = fe.submit("t0", "agent", 4 * BT + 10, 2, block_keys=k[:4])
        assert (await nxt(first)).hit_shortfall_tokens == 0
        await d0.fetch()
        plan = (await p0.fetch()).plans[0]
        await run_to_first_token(p0, plan)
        await d0.report("t0", plan.attempt, "finished", tokens=2)
        assert isinstance([e async for e in first][-1], RequestFinished)

        found["blocks"] = 1                     # 3 of the 4 stored blocks are gone
        second = fe.submit("t1", "agent", 8 * BT + 10, 2, block_keys=k)
        queued = await nxt(second)
        assert isinstance(queued, RequestQueued)
        assert (queued.hit_tokens, queued.hit_shortfall_tokens) == (BT, 3 * BT)
        assert env.svc.counters["hit_shortfalls"] == 1
        assert env.svc.counters["hit_shortfall_tokens"] == 3 * BT
        await d0.fetch()
        plan = (await p0.fetch()).plans[0]
        await run_to_first_token(p0, plan)
        await d0.report("t1", plan.attempt, "finished", tokens=2)
        final = [e async for e in second][-1]
        assert isinstance(final, RequestFinished) and final.hit_shortfall_tokens == 3 * BT
