"""The live scheduler service when a node goes away: lease expiry and failure reports re-plan
onto the survivors up to ``max_replans``, a restarted node replaces its old registration,
and stopping the service fails live requests retryably. Rig: ``test_scheduler_service.py``."""

from __future__ import annotations

import time

import pytest

from common.errors import AlreadyExists, ErrorCode, NotFound
from common.protocol import FirstToken, Heartbeat, RegisterNode, RequestFailed, RequestFinished
from services.scheduler.client.client import SchedulerClient
from services.scheduler.shell.service import SchedulerService
from tests.helpers import until
from tests.test_scheduler_service import (BT, RPC, assert_idle, keys, make_cfg, nxt, queued_r,
                                          run_stages, running)


# --------------------------------------------------------------------------- leases, re-plans

async def test_prefill_node_lease_expiry_replans_onto_the_other_pe_keeping_the_de():
    async with running() as env:
        p0, p1 = await env.node("p0", "prefill"), await env.node("p1", "prefill")
        d0 = await env.node("d0", "decode")
        fe = await env.client()
        stream = fe.submit("r", "s", 4 * BT, 3, block_keys=keys(4), hit_tokens=2 * BT)
        await nxt(stream)
        await d0.fetch()
        plan0 = (await p0.fetch()).plans[0]
        assert (plan0.pe_node, plan0.attempt) == ("p0", env.base)
        assert (await nxt(stream)).pe_node == "p0"
        await p0.close()                                  # p0 dies: heartbeats stop
        await until(lambda: env.svc.request_state("r") == "queued", what="re-plan")
        rebind = await d0.fetch()                         # same DE, new attempt
        assert [(r.request_id, r.attempt) for r in rebind.revoked] == [("r", env.base)]
        assert [(b.request_id, b.attempt) for b in rebind.bindings] == [("r", env.base + 1)]
        plan1 = (await p1.fetch()).plans[0]
        assert (plan1.pe_node, plan1.de_node, plan1.attempt) == ("p1", "d0", env.base + 1)
        placed = await nxt(stream)
        assert (placed.pe_node, placed.attempt) == ("p1", env.base + 1)
        stale = await d0.report("r", env.base, "prefill_done")   # the old attempt is gone
        assert not stale.current
        await run_stages(p1, plan1)
        assert isinstance(await nxt(stream), FirstToken)
        done = await nxt(stream)
        assert isinstance(done, RequestFinished) and done.attempt == env.base + 1
        assert_idle(env.svc)
        assert env.svc.counters["leases_expired"] == 1 and env.svc.counters["replans"] == 1


async def test_a_stall_of_the_scheduler_itself_drops_no_node():
    """The scheduler's loop stands still for three leases (here it shares the loop with its
    nodes, as in an in-process cluster, so they are silent too): no lease is held against
    them — the first sweep after the stall extends every lease by it — and a node that then
    really goes silent is still dropped."""
    async with running() as env:
        p0, d0 = await env.node("p0", "prefill"), await env.node("d0", "decode")
        epoch = p0.epoch
        time.sleep(3 * env.svc.settings.lease_s)        # the stall under test: the loop blocked
        await until(lambda: env.svc.counters["lease_sweeps_stalled"] >= 1, what="a late sweep")
        assert env.svc.counters["leases_expired"] == 0 and len(env.svc.leases) == 2
        await p0.heartbeat()
        assert p0.epoch == epoch                          # not re-registered: never lost
        await d0.close()                                  # d0 goes silent for real
        await until(lambda: env.svc.counters["leases_expired"] == 1, what="d0's lease expiry")
        assert [r.node_id for r in env.svc.leases] == ["p0"]


async def test_decode_node_lease_expiry_replans_onto_the_other_de_and_read_side():
    async with running() as env:
        p0 = await env.node("p0", "prefill")
        d0, d1 = await env.node("d0", "decode"), await env.node("d1", "decode")
        gw = await env.gateway("p0", "prefill")
        gw.read_q_tokens = 10**6                          # p0's storage link is busy
        await gw.heartbeat()
        fe = await env.client()
        stream = fe.submit("r", "s", 4 * BT, 3, block_keys=keys(4), hit_tokens=3 * BT)
        await nxt(stream)
        assert len((await d0.fetch()).bindings) == 1      # tie on load: first DE group
        plan0 = (await p0.fetch()).plans[0]
        assert (plan0.de_node, plan0.read_side, plan0.read_node) == ("d0", "de", "d0")
        await nxt(stream)
        await p0.report("r", env.base, "allocated")
        await d0.close()
        await until(lambda: env.svc.request_state("r") == "queued", what="re-plan")
        assert len((await d1.fetch()).bindings) == 1
        reply = await p0.fetch()
        assert [(r.request_id, r.attempt) for r in reply.revoked] == [("r", env.base)]
        plan1 = reply.plans[0]
        assert (plan1.de_node, plan1.read_side, plan1.read_node, plan1.attempt) == \
            ("d1", "de", "d1", env.base + 1)
        assert plan1.de_loader.node_id == "d1"
        assert (await nxt(stream)).de_node == "d1"
        await run_stages(p0, plan1)
        assert [type(await nxt(stream)) for _ in range(2)] == [FirstToken, RequestFinished]
        assert_idle(env.svc)


async def test_lease_expiry_beyond_max_replans_fails_with_the_reason():
    async with running({"max_replans": 0}) as env:
        p0, d0, stream = await queued_r(env)
        await d0.fetch()
        await p0.fetch()
        await nxt(stream)
        await p0.close()
        failed = await nxt(stream)
        assert isinstance(failed, RequestFailed) and failed.retryable
        assert failed.code == ErrorCode.PEER_FAILED
        assert "p0/pe_receiver lease expired" in failed.message
        assert "gave up after 0 re-plans" in failed.message
        assert_idle(env.svc)


async def test_retryable_failure_replans_until_the_bound_then_fails():
    async with running({"max_replans": 1}) as env:
        p0, d0, stream = await queued_r(env)
        for attempt in (env.base, env.base + 1):
            await d0.fetch()
            plan = (await p0.fetch()).plans[0]
            assert plan.attempt == attempt
            assert (await nxt(stream)).attempt == attempt
            reply = await p0.report("r", attempt, "failed", code="UNAVAILABLE",
                                    message="gateway gone", retryable=True, hop="gateway")
            assert not reply.current
        failed = await nxt(stream)
        assert isinstance(failed, RequestFailed)
        assert (failed.code, failed.retryable) == ("UNAVAILABLE", True)
        assert "gateway" in failed.message and "gave up after 1 re-plans" in failed.message
        assert_idle(env.svc)


async def test_non_retryable_failure_fails_at_once():
    async with running() as env:
        p0, d0, stream = await queued_r(env)
        await d0.fetch()
        plan = (await p0.fetch()).plans[0]
        await nxt(stream)
        await p0.report("r", plan.attempt, "failed", code="KV_SPEC_MISMATCH",
                        message="61 vs 64 layers", hop="de_loader")
        failed = await nxt(stream)
        assert (failed.code, failed.retryable) == ("KV_SPEC_MISMATCH", False)
        assert "de_loader" in failed.message
        assert [r.request_id for r in (await d0.fetch()).revoked] == ["r"]
        assert_idle(env.svc)


async def test_restart_with_a_new_epoch_replaces_the_old_registration():
    async with running() as env:
        p0, d0, stream = await queued_r(env)
        await d0.fetch()
        await p0.fetch()
        await nxt(stream)
        await p0.close()                                  # the process dies and restarts
        p0b = await env.node("p0", "prefill", epoch=p0.epoch + 1)   # before its lease ran out
        assert env.svc.request_state("r") == "queued"
        raw = await env.raw()
        with pytest.raises(NotFound):
            await raw.call(Heartbeat("p0", "pe_receiver", p0.epoch))
        old = RegisterNode("p0", "pe_receiver", "prefill", "h", 1, "h", 2, [], p0.epoch)
        with pytest.raises(AlreadyExists, match="older"):
            await raw.call(old)
        await d0.fetch()
        plan = (await p0b.fetch()).plans[0]
        assert plan.attempt == env.base + 1 and (await nxt(stream)).attempt == env.base + 1


async def test_stopping_the_service_fails_live_requests_retryably():
    svc = SchedulerService(make_cfg(), port=0)
    await svc.start()
    fe = SchedulerClient("127.0.0.1", svc.port, rpc=RPC, resubmit_window_s=0)  # no resubmit
    try:
        stream = fe.submit("r", "s", 100, 2)
        await nxt(stream)
        await svc.stop()
        failed = await nxt(stream)
        assert (failed.code, failed.retryable, failed.resubmit) == \
            (ErrorCode.UNAVAILABLE, True, True)
    finally:
        await fe.close()
        await svc.stop()
