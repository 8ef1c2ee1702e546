"""The leader's lease renewal while etcd does not answer (no etcd needed: ``_renew`` is
replaced): retries back off and the warnings are counted, not repeated twenty times a second;
a renewal that works again confirms the lease and the loop goes on. A node's first
registration likewise waits out an unanswered etcd for ``start_timeout_s``."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.errors import Unavailable
from services.scheduler.etcd.discovery import EtcdRegistrar, NodeRecord, make_record
from services.scheduler.etcd.election import RETRY_FIRST_S, RETRY_LOG_S, SchedulerElection
from services.scheduler.service_config import EtcdConfig


def scripted(outcomes: list[Any]) -> Callable[[], Awaitable[Any]]:
    """A stand-in etcd call: each call takes the next outcome, raising it if an exception."""
    async def call() -> Any:
        got = outcomes.pop(0)
        if isinstance(got, Exception):
            raise got
        return got
    return call


def election(step_down_s: float) -> SchedulerElection:
    return SchedulerElection(EtcdConfig(endpoints=["127.0.0.1:1"], lease_s=1,
                                        step_down_s=step_down_s), "s0")


async def test_an_unreachable_etcd_is_retried_with_backoff_and_logged_with_a_count():
    elec = election(step_down_s=2.0)
    tries: list[float] = []

    async def renew() -> str | None:
        tries.append(asyncio.get_running_loop().time())
        raise Unavailable("etcd: connection refused")

    elec._renew = renew                                  # type: ignore[method-assign]
    doubts: list[str] = []
    with capture_logs() as logs:
        reason = await asyncio.wait_for(elec.keep(doubts.append, lambda s: None), 10)
    assert "etcd.step_down_s" in reason
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    # 50 ms, then doubling to a quarter lease: a fixed 50-ms retry made ~33 tries in 2 s
    assert gaps and gaps[0] >= RETRY_FIRST_S and max(gaps) >= 0.2, gaps
    assert len(tries) <= 12, len(tries)
    warned = [e for e in logs if e["event"] == "leader_lease_renewal_failed"]
    assert 1 <= len(warned) <= 3 and warned[-1]["failures"] > 1, warned
    assert doubts, "a lease without renewal must stop the service serving"


async def test_a_renewal_that_works_again_confirms_and_the_loop_goes_on():
    elec = election(step_down_s=30.0)
    outcomes = [Unavailable("down")] * 8 + [None, None, "leader lease expired in etcd"]
    elec._renew = scripted(outcomes)                     # type: ignore[method-assign]
    doubts: list[str] = []
    confirmed: list[float] = []
    reason = await asyncio.wait_for(elec.keep(doubts.append, confirmed.append), 20)
    assert reason == "leader lease expired in etcd" and outcomes == []
    assert doubts and len(confirmed) == 1 and confirmed[0] > 0


async def test_a_campaign_against_an_unreachable_etcd_polls_and_logs_once_a_second():
    """A replica that stepped down campaigns through an etcd outage: every poll_s, each
    failure counted, the warning at most once a second — then it wins when etcd answers."""
    elec = SchedulerElection(EtcdConfig(endpoints=["127.0.0.1:1"], poll_s=0.01), "s0")
    outcomes: list[object] = [Unavailable("etcd: connection refused")] * 150 + [None, 42]
    elec._campaign = scripted(outcomes)                  # type: ignore[method-assign]
    t0 = time.monotonic()
    with capture_logs() as logs:
        epoch = await asyncio.wait_for(elec.win("127.0.0.1", 1), 60)
    took = time.monotonic() - t0
    assert epoch == 42 == elec.epoch and outcomes == []
    warned = [e for e in logs if e["event"] == "election_etcd_unreachable"]
    # one warning per RETRY_LOG_S at most, however slow the loop ran (150 failures: >= 1.5 s)
    assert 1 <= len(warned) <= math.ceil(took / RETRY_LOG_S) + 1 < 150, (len(warned), took)
    assert [e["failures"] for e in warned] == sorted(e["failures"] for e in warned)
    assert warned[0]["failures"] == 1 and warned[-1]["failures"] <= 150


def registrar(**etcd: object) -> EtcdRegistrar:
    cfg = EtcdConfig(endpoints=["127.0.0.1:1"], lease_s=1, poll_s=0.01, **etcd)  # type: ignore[arg-type]
    return EtcdRegistrar(cfg, make_record("d1", "de_loader", "127.0.0.1", 1, 2, [], "f", 1))


async def test_a_first_registration_waits_out_an_unanswered_etcd_then_registers():
    """ci99: one 2-s dial timeout during a host stall made a starting node exit. Its first
    registration now retries for start_timeout_s, logging the count once a second."""
    reg = registrar(start_timeout_s=30.0)
    outcomes: list[object] = [Unavailable("etcd unreachable at 127.0.0.1:1")] * 120 + [None]
    reg._put_if_vacant = scripted(outcomes)              # type: ignore[method-assign]
    with capture_logs() as logs:
        await asyncio.wait_for(reg.register(), 20)
    assert outcomes == []
    warned = [e for e in logs if e["event"] == "etcd_unreachable_at_start"]
    assert 1 <= len(warned) < 120 and "d1/de_loader" in warned[0]["what"], warned


async def test_a_first_registration_gives_up_after_start_timeout_naming_the_endpoint():
    reg = registrar(start_timeout_s=0.3)
    tries: list[float] = []

    async def put() -> NodeRecord | None:
        tries.append(time.monotonic())
        raise Unavailable("etcd unreachable at 127.0.0.1:1 (127.0.0.1:1: TimeoutError)")

    reg._put_if_vacant = put                             # type: ignore[method-assign]
    with pytest.raises(Unavailable, match="127.0.0.1:1"):
        await asyncio.wait_for(reg.register(), 20)
    assert len(tries) > 1 and tries[-1] - tries[0] >= 0.3, tries


async def test_a_twin_is_refused_one_lease_after_it_was_first_seen_not_after_the_start():
    """An etcd unanswered for longer than a lease at start must not turn a twin's key, seen
    once etcd answers, into an immediate refusal: the predecessor may still let it lapse."""
    reg = registrar(start_timeout_s=30.0)
    holder = make_record("d1", "de_loader", "10.0.0.9", 1, 2, [], "f", 1)
    outcomes: list[object] = [Unavailable("down")] * 4 + [holder] * 3 + [None]
    seen_holder: list[float] = []

    async def put() -> NodeRecord | None:
        got = outcomes.pop(0)
        if isinstance(got, Exception):
            await asyncio.sleep(0.6)                     # 4 × 0.6 s > lease_s + 1 before etcd answers
            raise got
        if got is not None:
            seen_holder.append(time.monotonic())
        return got                                      # type: ignore[return-value]

    reg._put_if_vacant = put                             # type: ignore[method-assign]
    await asyncio.wait_for(reg.register(), 20)          # the key lapsed: registered, not refused
    assert outcomes == [] and len(seen_holder) == 3
