"""An engine that cannot open a request tells its node at once (``AbandonRequest``).

A vLLM instance that refuses a request before claiming it (an unverified cache layout, a
claim error, the request aborted while its claim waited) computes it without dualpath; the
node's attempt must fail now — reported retryable, so the scheduler re-plans it — and not
wait for a claim until its deadline (docs/engine-api.md, docs/vllm.md "Asynchronous loads").
"""

from __future__ import annotations

import asyncio

import pytest

from common.errors import Cancelled, InvalidArgument, NotFound
from tests.helpers import until
from tests.test_datapath import BT, no_leaks, plan, report, tokens
from tests.test_engine_ipc import client, sockets
from tools.cluster.inprocess import local_datapath

DEADLINE = 300.0          # the attempt's own deadline: the test must never get near it


async def failed_soon(svc, rid: str):
    await until(lambda: report(svc, rid, "failed") is not None, timeout=20,
                what=f"{rid} failed on {svc.node_id}")
    return report(svc, rid, "failed")


@pytest.mark.parametrize("plan_first", [True, False], ids=["planned", "plan-after"])
async def test_a_prefill_engine_that_abandons_fails_the_attempt_at_once(tmp_path, plan_first):
    """Queued in the engine's port, or arriving at the node after the abandon: either way the
    PE attempt fails now (retryable, the engine's reason in the message), its DE side is
    dropped and every page is freed."""
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        eng = await client(tmp_path)
        pe = c.pe["p0"]
        try:
            p = plan(c, "ab1", tokens(3 * BT + 5, 3), 0, "none", deadline=DEADLINE)
            if plan_first:
                pe.submit_plan(p)
                await eng.abandon("ab1", "cache layout not verified", 10.0)
            else:
                abandon = asyncio.create_task(eng.abandon("ab1", "cache layout not verified",
                                                          10.0))
                await asyncio.sleep(0)
                pe.submit_plan(p)
                await asyncio.wait_for(abandon, 10.0)
            failed = await failed_soon(pe, "ab1")
            assert failed.retryable and "cache layout not verified" in failed.message, failed
            assert pe.engine_api.counters["requests_abandoned"] == 1
            await no_leaks(c)
        finally:
            await eng.close()


async def test_a_decode_engine_that_abandons_fails_the_de_attempt_before_the_prefill(tmp_path):
    """The decode request reaches the engine's port only once its prompt KV is assembled
    (the whole prefill); an abandon fails the DE attempt while it is still being prepared."""
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        dec = await client(tmp_path, "d0.e0", role="decode")
        try:
            c.pe["p0"].submit_plan(plan(c, "ab2", tokens(2 * BT + 7, 4), 0, "none",
                                        deadline=DEADLINE))
            await until(lambda: ("ab2", 0) in c.de["d0"].attempts, what="DE attempt prepared")
            await dec.abandon("ab2", "prompt check failed", 10.0)
            failed = await failed_soon(c.de["d0"], "ab2")
            assert failed.retryable and "prompt check failed" in failed.message, failed
            await until(lambda: report(c.pe["p0"], "ab2", "failed") is not None
                        or not c.pe["p0"].attempts, timeout=20, what="the PE side ended")
            await no_leaks(c)
        finally:
            await dec.close()


async def test_abandon_refusals_are_typed(tmp_path):
    """An id the node never planned: NotFound after the abandon's wait (bounded); another
    engine's request: InvalidArgument at once. One this engine already claimed is failed
    too: an engine abandons after a claim whose answer it never got (its deadline passed on
    the way back), and nothing else would ever end that attempt."""
    over = sockets(tmp_path)
    over["pe_receiver"]["engines"] = 2
    async with local_datapath(tmp_path, scheduler=False, engines=False, overrides=over) as c:
        e0, e1 = await client(tmp_path, "p0.e0"), await client(tmp_path, "p0.e1")
        try:
            with pytest.raises(NotFound, match="no attempt"):
                await asyncio.wait_for(e0.abandon("never", "x", 0.3), 10.0)
            c.pe["p0"].submit_plan(plan(c, "ab3", tokens(BT + 3, 6), 0, "none"))  # for p0.e0
            with pytest.raises(InvalidArgument, match="p0.e0"):
                await e1.abandon("ab3", "not mine", 5.0)
            h = await e0.claim_prefill("ab3", 5.0)
            with pytest.raises(NotFound):               # another attempt's: not this one
                await asyncio.wait_for(e0.abandon("ab3", "not this attempt", 0.3, attempt=1),
                                       10.0)
            assert report(c.pe["p0"], "ab3", "failed") is None
            await e0.abandon("ab3", "the claim's answer came too late", 5.0, attempt=0)
            failed = await failed_soon(c.pe["p0"], "ab3")
            assert "came too late" in failed.message, failed
            assert c.pe["p0"].engine_api.counters["requests_abandoned"] == 1
            with pytest.raises(NotFound):               # the handle's attempt is gone
                await h.put_layer(0, wait=True)
            await no_leaks(c)
        finally:
            for e in (e0, e1):
                await e.close()


async def test_claims_and_give_ups_are_scoped_to_their_attempt(tmp_path):
    """A frontend re-plans by sending the request to vLLM again: the earlier attempt's vLLM
    request (still ending) must neither take the new attempt's plan nor fail it by giving up
    (seen under real engines: every re-plan after a killed PE receiver or scheduler failed
    'request ended in vLLM before its first step' until max_replans). A claim or give-up that
    names its attempt only ever touches that attempt; one of a superseded attempt is refused
    (claim: Cancelled at once) or a no-op (give-up), and the new attempt stays claimable."""
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        eng = await client(tmp_path)
        pe = c.pe["p0"]
        try:
            pe.submit_plan(plan(c, "at1", tokens(2 * BT + 5, 8), 0, "none", deadline=DEADLINE,
                                attempt=1))
            await until(lambda: pe.engine_api.ports["p0.e0"].attempts_of("at1") == [1],
                        what="attempt 1 queued at the engine's port")
            with pytest.raises(Cancelled, match="superseded"):
                await asyncio.wait_for(eng.claim_prefill("at1", 30.0, 0), 10.0)
            await eng.abandon("at1", "the old request ended", 5.0, attempt=0)    # a no-op
            with pytest.raises(NotFound):                 # attempt 2 is not planned (yet)
                await asyncio.wait_for(eng.claim_prefill("at1", 0.3, 2), 10.0)
            h = await eng.claim_prefill("at1", 5.0, 1)    # attempt 1 stood through all that
            assert h.info.attempt == 1 and report(pe, "at1", "failed") is None
            await h.fail("test gives up")
            await failed_soon(pe, "at1")
            await no_leaks(c)
        finally:
            await eng.close()


async def test_a_claim_is_not_refused_for_an_attempt_the_node_already_dropped(tmp_path):
    """CI, under real engines: the scheduler was killed while a decode engine held a request;
    the node dropped its attempts when it registered with the new scheduler, which placed the
    request again on the same engine before the old vLLM request had ended — and the new
    claim was refused as "already claimed", so vLLM computed it alone while the node's new
    attempt waited for a claim until the front's deadline. A hold the node has dropped no
    longer refuses a claim; a live hold of an earlier attempt is superseded (failed) by the
    claim of the later one; a second claim of the same live attempt is still refused."""
    # the old hold's engine never releases its pages (this test's client does nothing), so
    # each drop waits the node's engine_release_timeout_s for it: 1 s here, not 30
    over = sockets(tmp_path)
    for role in ("pe_receiver", "de_loader"):
        over[role]["engine_release_timeout_s"] = 1.0
    async with local_datapath(tmp_path, scheduler=False, engines=False, overrides=over) as c:
        eng = await client(tmp_path)
        pe = c.pe["p0"]
        toks = tokens(2 * BT + 5, 9)
        try:
            pe.submit_plan(plan(c, "rc1", toks, 0, "none", deadline=DEADLINE))
            old = await eng.claim_prefill("rc1", 5.0, 0)
            with pytest.raises(InvalidArgument, match="already claimed"):
                await eng.claim_prefill("rc1", 5.0, 0)
            for svc in (pe, c.de["d0"]):                # what a lease loss does to each node
                await svc.drop_all("the scheduler restarted")
            await until(lambda: not pe.attempts, what="the node dropped the attempt")
            pe.submit_plan(plan(c, "rc1", toks, 0, "none", deadline=DEADLINE, attempt=1))
            new = await eng.claim_prefill("rc1", 5.0, 1)            # not "already claimed"
            assert new.info.attempt == 1
            with pytest.raises(NotFound):                          # the old hold is gone
                await old.put_layer(0, wait=True)
            # a later attempt claimed while the earlier one is still held live: superseded
            pe.submit_plan(plan(c, "rc2", toks, 0, "none", deadline=DEADLINE))
            first = await eng.claim_prefill("rc2", 5.0, 0)
            pe.submit_plan(plan(c, "rc2", toks, 0, "none", deadline=DEADLINE, attempt=1))
            second = await eng.claim_prefill("rc2", 5.0, 1)
            assert second.info.attempt == 1
            failed = await failed_soon(pe, "rc2")                  # attempt 0, superseded
            assert failed.attempt == 0 and "superseded by attempt 1" in failed.message, failed
            assert pe.engine_api.counters["claims_superseding"] == 1
            with pytest.raises(NotFound):
                await first.put_layer(0, wait=True)
            await new.fail("test gives up")
            await second.fail("test gives up")
            await failed_soon(pe, "rc1")
            await no_leaks(c)
        finally:
            await eng.close()
