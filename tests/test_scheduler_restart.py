"""Scheduler restart without losing a request (issue 16, item 2), and resubmission semantics.

A real scheduler process is killed with SIGKILL mid-request and started again at the same
address; the frontend client reconnects and resubmits under the same request ids, the node
sessions notice the new incarnation, re-register and redeliver a result that finished in the
gap. Every request ends exactly once as the frontend sees it. The resubmission rules (a live
id re-attaches, other content is refused, a dropped frontend is cancelled only after the
grace) run against an in-process service. Conditions are polled; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.errors import AlreadyExists, ErrorCode
from common.kv import spec_from_config
from common.protocol import (EngineInfo, FetchWork, FirstToken, ReportProgress, RequestEvent,
                             RequestFailed,
                             RequestFinished, RequestPlaced, RequestQueued)
from services.config import ServicesConfig
from services.scheduler.client.client import SchedulerClient
from services.scheduler.client.node_client import NodeSession
from tests.helpers import reap, until
from tests.test_scheduler_service import RPC, nxt, running
from tools.cluster.config import free_port

REPO = Path(__file__).resolve().parents[1]
FINAL = (RequestFinished, RequestFailed)


# --------------------------------------------------------------------------- a real process

async def start_scheduler(port: int, tmp: Path) -> subprocess.Popen:
    """``dualpath serve scheduler`` on ``port``; returns once it has written its ready file."""
    ready = tmp / f"ready-{port}-{len(list(tmp.iterdir()))}"
    env = {**os.environ, "DUALPATH__SCHEDULER_SERVICE__LEASE_S": "1.0",
           "DUALPATH__SCHEDULER_SERVICE__HEARTBEAT_S": "0.2",
           "DUALPATH__LOGGING__LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cluster.serve", "scheduler", "--port",
                             str(port), "--ready-file", str(ready)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    await until(lambda: ready.exists() or proc.poll() is not None, timeout=60,
                what="scheduler ready")
    assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "not ready"
    return proc


def session(port: int, node_id: str, role: str, changed: list[int]) -> NodeSession:
    kv = spec_from_config(ServicesConfig().kv).fingerprint()
    return NodeSession(RPC, "127.0.0.1", port, node_id=node_id,
                       service="pe_receiver" if role == "prefill" else "de_loader", role=role,
                       control=("127.0.0.1", 9001), ucx=("127.0.0.1", 9501),
                       engines=[EngineInfo(f"{node_id}.e0", role, 1 << 40)],
                       kv_fingerprint=kv, on_scheduler_changed=changed.append)


async def take_until_final(stream: Any, seen: list[RequestEvent]) -> RequestEvent:
    while True:
        ev = await asyncio.wait_for(stream.__anext__(), 30.0)
        seen.append(ev)
        if isinstance(ev, FINAL):
            return ev


async def plans_for(p0: NodeSession, d0: NodeSession, rid: str) -> Any:
    """Fetch on both group leaders until the plan of ``rid`` comes (placement is theirs)."""
    for _ in range(400):
        await d0.fetch()
        for plan in (await p0.fetch()).plans:
            if plan.request_id == rid:
                return plan
        await asyncio.sleep(0.02)
    raise AssertionError(f"no plan for {rid}")


async def run_to_first_token(p0: NodeSession, plan: Any) -> None:
    for stage in ("allocated", "read_done", "prefill_done"):
        assert (await p0.report(plan.request_id, plan.attempt, stage)).current, stage


@pytest.mark.reliability
async def test_scheduler_killed_mid_request_loses_and_repeats_nothing(tmp_path, reliability):
    port = free_port()
    proc = await start_scheduler(port, tmp_path)
    changed: list[int] = []
    fe = SchedulerClient("127.0.0.1", port, rpc=RPC, client_id="fe")
    p0, d0 = session(port, "p0", "prefill", changed), session(port, "d0", "decode", changed)
    try:
        await p0.start()
        await d0.start()
        seen: dict[str, list[RequestEvent]] = {"done-in-gap": [], "replanned": []}
        streams = {rid: fe.submit(rid, "s", 300, 2) for rid in seen}
        for rid, s in streams.items():
            seen[rid].append(await nxt(s))
        gap_plan = await plans_for(p0, d0, "done-in-gap")
        await run_to_first_token(p0, gap_plan)
        for _ in range(2):                       # RequestPlaced, FirstToken
            seen["done-in-gap"].append(await nxt(streams["done-in-gap"]))
        old_epoch = d0.scheduler_epoch

        proc.kill()                              # SIGKILL: no goodbye to anyone
        proc.wait()
        # the frontend goes on reading: its streams reconnect and resubmit by themselves
        finals = {rid: asyncio.create_task(take_until_final(s, seen[rid]))
                  for rid, s in streams.items()}
        # decode finished while no scheduler listened: the DE loader keeps this report
        result = ReportProgress("done-in-gap", gap_plan.attempt, "finished", tokens=2,
                                node_id="d0", output_token_ids=[7, 8],
                                scheduler_epoch=old_epoch)
        proc = await start_scheduler(port, tmp_path)   # the same address

        await until(lambda: len(changed) == 2, timeout=30, what="both nodes re-registered")
        assert changed == [old_epoch, old_epoch] and d0.scheduler_epoch != old_epoch
        await until(lambda: fe.resubmits >= 2, timeout=30, what="both requests resubmitted")
        reply = await d0.send_report(result)     # what NodeBase._redeliver sends
        assert reply.current
        final = await finals["done-in-gap"]
        assert isinstance(final, RequestFinished)
        assert (final.tokens, final.output_token_ids) == (2, [7, 8])   # kept, not redone

        plan = await plans_for(p0, d0, "replanned")   # the new scheduler plans it afresh
        # numbered past any attempt of the old epoch: an engine request still ending under an
        # old attempt number is never taken for this one (docs/engine-api.md, "Attempts")
        assert plan.attempt > gap_plan.attempt, (plan.attempt, gap_plan.attempt)
        await run_to_first_token(p0, plan)
        await d0.report("replanned", plan.attempt, "finished", tokens=2)
        assert isinstance(await finals["replanned"], RequestFinished)
        for rid, events in seen.items():         # at most once, as the frontend sees it
            assert sum(isinstance(e, FINAL) for e in events) == 1, (rid, events)
            assert sum(isinstance(e, FirstToken) for e in events) <= 1, (rid, events)
        status = await fe.cluster_status(timeout=5)
        assert status.counters["results_recovered"] == 1
        assert status.counters["finished"] == 1       # only the replanned one ran here
        reliability.record("fault", "kill -9 scheduler (no standby), restart at its address",
                           "2/2 requests ended once: one with the result its node finished in "
                           "the gap (kept, not redone), one re-planned",
                           target="scheduler", action="kill")
    finally:
        await fe.close()
        await p0.close()
        await d0.close()
        reap(proc)


# --------------------------------------------------------------------------- resubmission rules

async def test_a_call_refused_for_an_old_epoch_keeps_the_registration_made_since():
    """A new leader knows no node: every call in flight is refused (NotFound). The first one
    re-registers; one sent under the old epoch and refused after that must not register
    again — each extra registration drops the node's engines and re-plans their requests
    (the churn behind the test_failover_burst timeout, issue #26)."""
    async with running() as env:
        d0 = await env.node("d0", "decode")
        e1 = d0.epoch
        gate = asyncio.Event()
        sent = asyncio.Event()
        call = d0._call

        async def late_fetch(msg: Any, timeout: float | None = None) -> Any:
            if isinstance(msg, FetchWork):      # built under e1, reaches the scheduler late
                sent.set()
                await gate.wait()
            return await call(msg, timeout)

        d0._call = late_fetch                   # type: ignore[method-assign]
        fetch = asyncio.create_task(d0.fetch())
        await until(sent.is_set, what="the fetch under the old epoch is out")
        env.svc.nodes.drop_registration(env.svc.leases.get("d0", "de_loader"), "test: forgotten")
        await until(lambda: d0.epoch != e1 and env.svc.leases.get("d0", "de_loader")
                    is not None, what="d0 registered again (its heartbeat was refused)")
        e2, registrations = d0.epoch, env.svc.counters["registrations"]
        gate.set()
        assert (await fetch).plans == []       # refused for e1: NotFound
        assert d0.epoch == e2
        assert env.svc.leases.get("d0", "de_loader").epoch == e2
        assert env.svc.counters["registrations"] == registrations


async def test_a_kept_result_finishes_the_resubmission_at_once():
    async with running() as env:
        d0 = await env.node("d0", "decode")
        earlier = env.svc.epoch - 1
        msg = ReportProgress("k1", 0, "finished", tokens=3, node_id="d0",
                             output_token_ids=[1, 2, 3], scheduler_epoch=earlier)
        assert (await d0.send_report(msg)).current            # kept for the resubmission
        stale = ReportProgress("k2", 0, "read_done", node_id="d0", scheduler_epoch=earlier)
        assert not (await d0.send_report(stale)).current      # only results are of use
        future = ReportProgress("k3", 0, "finished", node_id="d0",
                                scheduler_epoch=env.svc.epoch + 1)
        assert not (await d0.send_report(future)).current     # not from an earlier scheduler
        fe = await env.client()
        events = [ev async for ev in fe.submit("k1", "s", 100, 3)]
        assert [type(e) for e in events] == [RequestFinished]
        assert events[0].output_token_ids == [1, 2, 3]
        assert env.svc.counters["results_recovered"] == 1
        assert env.svc.active_requests == 0


async def test_a_resubmission_of_a_live_request_takes_its_stream_over():
    async with running() as env:
        await env.pair()
        a, b = await env.client("a"), await env.client("b")
        first = a.submit("r", "s", 100, 2)
        assert isinstance(await nxt(first), RequestQueued)
        second = b.submit("r", "s", 100, 2)
        assert isinstance(await nxt(second), RequestQueued)     # held again
        taken = await nxt(first)                                # the old stream ends
        assert isinstance(taken, RequestFailed) and taken.code == ErrorCode.ALREADY_EXISTS
        assert env.svc.request_state("r") == "queued" and env.svc.counters["resubmits"] == 1
        with pytest.raises(AlreadyExists):                      # same id, other content
            await nxt(b.submit("r", "s", 200, 2))
        assert env.svc.active_requests == 1


async def test_a_dropped_frontend_is_cancelled_after_the_grace_unless_it_resubmits():
    async with running(reattach_grace_s=0.3) as env:
        p0, d0 = await env.pair()
        leaving = await env.client("leaving")
        held = [leaving.submit(rid, "s", 100, 2) for rid in ("back", "gone")]
        for s in held:                      # (held: a dropped stream object cancels its call)
            await nxt(s)
        await leaving.close()                                   # connection drops
        await until(lambda: env.svc.counters["detached"] == 2, what="both detached")
        back = await env.client("back")
        stream = back.submit("back", "s", 100, 2)
        assert isinstance(await nxt(stream), RequestQueued)
        await until(lambda: env.svc.request_state("gone") is None, what="grace over")
        assert env.svc.counters["cancelled"] == 1 and env.svc.request_state("back") == "queued"
        await d0.fetch()
        plan = (await p0.fetch()).plans[0]
        assert plan.request_id == "back"
        await run_to_first_token(p0, plan)
        await d0.report("back", plan.attempt, "finished", tokens=2)
        kinds = [type(e) async for e in stream]
        assert kinds == [RequestPlaced, FirstToken, RequestFinished]


async def test_a_clean_stop_fails_requests_for_resubmission_and_the_client_resubmits():
    from services.scheduler.shell.service import SchedulerService
    from tests.test_scheduler_service import make_cfg
    first = SchedulerService(make_cfg(), port=0)
    await first.start()
    port = first.port
    fe = SchedulerClient("127.0.0.1", port, rpc=RPC)
    second = None
    try:
        stream = fe.submit("r", "s", 100, 2)
        assert isinstance(await nxt(stream), RequestQueued)
        reading = asyncio.create_task(take_until_final(stream, seen := []))
        await first.stop()                 # RequestFailed(UNAVAILABLE, resubmit=True): held back
        second = SchedulerService(make_cfg(), port=port)
        await second.start()               # the same address
        await until(lambda: second.request_state("r") == "queued", what="resubmitted")
        assert not reading.done()          # the shutdown failure did not reach the frontend
        p0 = NodeSession(RPC, "127.0.0.1", port, node_id="p0", service="pe_receiver",
                         role="prefill", engines=[EngineInfo("p0.e0", "prefill", 0)],
                         kv_fingerprint=second.kv.fingerprint())
        d0 = NodeSession(RPC, "127.0.0.1", port, node_id="d0", service="de_loader",
                         role="decode", engines=[EngineInfo("d0.e0", "decode", 1 << 40)],
                         kv_fingerprint=second.kv.fingerprint())
        await p0.start()
        await d0.start()
        plan = await plans_for(p0, d0, "r")
        await run_to_first_token(p0, plan)
        await d0.report("r", plan.attempt, "finished", tokens=2)
        assert isinstance(await reading, RequestFinished)
        # resubmitted, and the frontend never saw the failure. Not "exactly once": a
        # resubmission sent within the backoff (0-50 ms) can still go out on the stopping
        # scheduler's connection as it closes (BrokenPipe, counted, sent again: 2 in one CI
        # run); the new scheduler took it (queued above) and its one final came through
        assert not any(isinstance(e, RequestFailed) for e in seen) and fe.resubmits >= 1
        await p0.close()
        await d0.close()
    finally:
        await fe.close()
        await first.stop()
        if second is not None:
            await second.stop()
