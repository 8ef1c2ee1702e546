"""Pages allocated for a handler whose call is cancelled in the same instant go back.

asyncio raises ``CancelledError`` in a task cancelled after the sub-task it awaited finished
but before it resumed, and the sub-task's result is lost. For the DE loader's ``PrepareDecode``
(its PE died, or gave up on the call: the RPC server cancels the handler) that result is the
attempt's region — pages nothing would ever free. Seen once in CI (ci79: 17 pages held by a DE
loader for the rest of the chaos module after ``kill -9`` of its PE mid-request). The node
now also counts pages no live attempt owns (``pages_orphaned``), so such a leak is seen.
"""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from common.errors import Cancelled, DeadlineExceeded
from common.kv import block_keys_from_tokens
from common.protocol import PrepareDecode, RequestFinished
from services.node.subtasks import SubTasks
from services.scheduler.client.client import SchedulerClient
from tests.test_datapath import BT, SPLIT, no_leaks, tokens
from tools.cluster.inprocess import local_datapath


def cancel_the_caller_when_done(caller: list[asyncio.Task]):
    """A coroutine wrapper: its result is ready, and the caller is cancelled before it can
    resume (the cancellation is queued before the sub-task's completion wakes the caller)."""
    async def run(coro):
        result = await coro
        asyncio.get_running_loop().call_soon(caller[0].cancel)
        return result
    return run


async def test_guard_gives_back_a_result_its_cancelled_caller_never_saw():
    sub, undone = SubTasks(lambda: None), []
    caller: list[asyncio.Task] = []
    lose = cancel_the_caller_when_done(caller)

    async def take() -> str:
        return await sub.guard(lose(asyncio.sleep(0, "pages")), undo=undone.append)

    caller.append(asyncio.create_task(take()))
    with pytest.raises(asyncio.CancelledError):
        await caller[0]
    assert undone == ["pages"]
    # a caller that resumes gets the result, and nothing is given back
    assert await sub.guard(asyncio.sleep(0, "kept"), undo=undone.append) == "kept"
    # a failure inside, or a sub-task cancelled before it produced anything: nothing to undo
    with pytest.raises(DeadlineExceeded):
        await sub.guard(_raise(DeadlineExceeded("late")), undo=undone.append)
    slow = asyncio.create_task(sub.guard(asyncio.sleep(60, "never"), undo=undone.append))
    await asyncio.sleep(0)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert undone == ["pages"]


async def _raise(err: Exception) -> None:
    raise err


async def test_a_prepare_cancelled_the_moment_its_region_came_leaves_no_page(tmp_path):
    async with local_datapath(tmp_path, scheduler=False, engines=False) as c:
        de, pe = c.de["d0"], c.pe["p0"]
        toks = tokens(3 * BT + 10, 21)
        prep = PrepareDecode("lost", 0, "s", "d0.e0", "p0", "none", len(toks), 0, 3, [],
                             block_keys_from_tokens(toks, BT), *pe.ucx_address,
                             toks[3 * BT:], None, 5.0)
        real = de.regions.allocate
        caller: list[asyncio.Task] = []
        lose = cancel_the_caller_when_done(caller)
        de.regions.allocate = lambda *a, **kw: lose(real(*a, **kw))     # type: ignore
        try:
            caller.append(asyncio.create_task(de._prepare(prep, None)))
            with pytest.raises((asyncio.CancelledError, Cancelled)):
                await caller[0]
        finally:
            del de.regions.allocate                   # the class's method again
        # the PE is gone: the attempt ends (here by a revocation), and every page is free
        att = de.attempts[("lost", 0)]
        att.drop("the PE died")
        await asyncio.wait_for(asyncio.shield(att.release_task), 10)
        assert de.pool.used_pages == 0
        await no_leaks(c)


async def test_pages_no_attempt_owns_are_counted_and_named_live_ones_never(tmp_path):
    """The node's leak gauge: a live allocation whose attempt is not held here is orphaned
    (warned of once per set of owners); pages of live attempts — many at once, mid-flight —
    never are."""
    async with local_datapath(tmp_path, overrides=SPLIT) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched:
        de, pe = c.de["d0"], c.pe["p0"]
        seen: list[float] = []

        async def sample() -> None:
            while True:
                seen.extend((de.stats()["pages_orphaned"], pe.stats()["pages_orphaned"]))
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        try:
            prompts = [tokens(2 * BT + 30 * i, 60 + i) for i in range(4)]
            events = await asyncio.gather(*(
                sched.run(f"o{i}", f"so{i}", len(t), 8, token_ids=t, deadline_s=30)
                for i, t in enumerate(prompts)))
        finally:
            sampler.cancel()
        assert all(isinstance(ev, RequestFinished) for ev in events), events
        assert len(seen) > 10 and not any(seen)
        # an allocation whose attempt is gone: counted, named once, gone when freed
        lost = await de.regions.allocate(c.spec, BT, "gone#3/gen", 1.0)
        with capture_logs() as logs:
            assert de.stats()["pages_orphaned"] == lost.allocs[0].n_pages > 0
            de.stats()
        warned = [e for e in logs if e["event"] == "pages_orphaned"]
        assert [(e["owners"], e["pages"]) for e in warned] == [(["gone#3/gen"],
                                                               lost.allocs[0].n_pages)]
        de.regions.free(lost)
        assert de.stats()["pages_orphaned"] == 0
        await no_leaks(c)
