"""The scheduler's per-request attempt history and failed-attempt metric (issue #16)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from common.errors import InvalidArgument
from common.metrics import registry
from common.protocol import RequestFailed, RequestFinished
from tests.test_scheduler_service import nxt, queued_r, run_stages, running


def failed_attempts(hop: str, code: str) -> float:
    v = registry().registry.get_sample_value("dualpath_failed_attempts_total",
                                             {"hop": hop, "code": code})
    return v or 0.0


async def test_a_retried_request_records_each_attempts_reason_and_read_bytes():
    before = failed_attempts("pe_buffer", "DEADLINE_EXCEEDED")
    async with running() as env:
        p0, d0, stream = await queued_r(env)
        await d0.fetch()
        plan = (await p0.fetch()).plans[0]
        await nxt(stream)
        a0 = env.base
        await p0.report("r", a0, "allocated")
        await p0.report("r", a0, "failed", code="DEADLINE_EXCEEDED", retryable=True,
                        hop="pe_buffer", message="pool 'pe_buffer': no room", read_bytes=0)
        # the DE loader's own report of the same attempt comes late: its read is kept
        await d0.report("r", a0, "failed", code="PEER_FAILED", retryable=True,
                        hop="pe_receiver", message="peer gone", read_bytes=4096)
        await d0.fetch()
        plan = (await p0.fetch()).plans[0]
        assert plan.attempt == a0 + 1
        await nxt(stream)
        await run_stages(p0, plan)
        events = [await nxt(stream) for _ in range(2)]
        done = events[-1]
        assert isinstance(done, RequestFinished) and done.attempt == a0 + 1
        first, last = done.attempts
        assert (first.attempt, first.outcome, first.hop, first.code) == (
            a0, "failed", "pe_buffer", "DEADLINE_EXCEEDED")
        assert first.stage == "loading" and first.pe_node == "p0" and first.de_node == "d0"
        assert first.read_bytes == 4096 and "no room" in first.message
        assert (last.attempt, last.outcome, last.read_bytes) == (a0 + 1, "finished", 0)
        assert env.svc.counters["attempts_failed"] == 1
    assert failed_attempts("pe_buffer", "DEADLINE_EXCEEDED") == before + 1
    assert b"dualpath_failed_attempts_total" in generate_latest(registry().registry)


async def test_a_failed_request_names_every_attempt():
    async with running({"max_replans": 1}) as env:
        p0, d0, stream = await queued_r(env)
        for n in (0, 1):
            await d0.fetch()
            await p0.fetch()
            await nxt(stream)
            await p0.report("r", env.base + n, "failed", code="UNAVAILABLE",
                            message="gateway gone", retryable=True, hop="gateway",
                            read_bytes=100 * (n + 1))
        failed = await nxt(stream)
        assert isinstance(failed, RequestFailed)
        assert [(a.attempt, a.outcome, a.hop, a.read_bytes) for a in failed.attempts] == [
            (env.base, "failed", "gateway", 100), (env.base + 1, "failed", "gateway", 200)]


async def test_a_cancelled_request_records_its_open_attempt():
    async with running() as env:
        await env.pair()
        fe = await env.client()
        stream = fe.submit("r", "s", 200, 3, deadline_s=0.2)
        await nxt(stream)
        failed = await nxt(stream)
        assert isinstance(failed, RequestFailed) and failed.code == "DEADLINE_EXCEEDED"
        (only,) = failed.attempts
        assert (only.attempt, only.outcome, only.hop) == (env.base, "failed", "scheduler")


async def test_the_parts_of_one_attempts_read_add_up_across_its_nodes_reports():
    """A split read (or a DE read the PE gave up on before the DE answered) is read by two
    nodes; each reports its own part (``failed`` or, told to drop, ``dropped``), and the
    attempt is charged their sum — not the larger report — while a total a node already
    knew (the PE's, once the DE answered) is never counted twice."""
    async with running() as env:
        p0, d0, stream = await queued_r(env)
        await d0.fetch()
        await p0.fetch()
        await nxt(stream)
        a0 = env.base
        await p0.report("r", a0, "allocated")
        # the DE was dropped first (the PE aborted it): its part arrives while a0 is current
        reply = await d0.report("r", a0, "dropped", read_bytes=500, de_read_bytes=500)
        assert not reply.current and env.svc.counters["dropped_reports"] == 1
        assert env.svc.table.get("r").attempt == a0          # a count only: nothing moved
        await p0.report("r", a0, "failed", code="PEER_FAILED", retryable=True,
                        hop="de_loader", message="DE gone", read_bytes=700, pe_read_bytes=700)
        await d0.fetch()
        plan = (await p0.fetch()).plans[0]
        await nxt(stream)
        # attempt a0 + 1: the PE knew both parts (the DE had answered); the DE's late
        # report of its own part must not add to that total again
        await p0.report("r", plan.attempt, "allocated")
        await p0.report("r", plan.attempt, "failed", code="UNAVAILABLE", retryable=True,
                        hop="engine", message="engine gone", read_bytes=1200,
                        pe_read_bytes=700)
        await d0.report("r", plan.attempt, "dropped", read_bytes=500, de_read_bytes=500)
        # a count for an attempt this request never ran is ignored
        await d0.report("r", a0 + 7, "dropped", read_bytes=10**9, de_read_bytes=10**9)
        await d0.fetch()
        plan = (await p0.fetch()).plans[0]
        await nxt(stream)
        await run_stages(p0, plan)
        done = [await nxt(stream) for _ in range(2)][-1]
        assert isinstance(done, RequestFinished)
        assert [(a.attempt, a.outcome, a.read_bytes) for a in done.attempts] == [
            (a0, "failed", 1200), (a0 + 1, "failed", 1200), (a0 + 2, "finished", 0)]


async def test_a_negative_read_count_is_refused():
    async with running() as env:
        p0, d0, stream = await queued_r(env)
        await d0.fetch()
        await p0.fetch()
        for field in ("read_bytes", "pe_read_bytes", "de_read_bytes"):
            with pytest.raises(InvalidArgument, match=field):
                await d0.report("r", env.base, "dropped", **{field: -1})
        assert env.svc.table.get("r").attempt == env.base
