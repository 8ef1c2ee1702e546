"""The scheduler core when things go wrong: engine and node deaths re-plan (bounded), cancel in
every phase releases everything, bad input is typed; records round-trip msgpack."""

from __future__ import annotations

import msgspec
import pytest

from common.errors import AlreadyExists, InvalidArgument, NotFound
from services.scheduler.core.records import EngineReport, Phase, Request, Role, Telemetry
from services.scheduler.core.config import ATTEMPT_SPAN, SchedulerConfig
from services.scheduler.core.scheduler import Scheduler, attempt_base
from tests.test_scheduler_policy import _pair, bind_all, cfg, de, load, pe, req


# ============================================================================ failures, bad input

def test_pe_death_replans_on_another_pe_keeping_the_de():
    s = _pair()
    s.submit(req(0, hit=100))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    res = s.remove_engine(a.pe_engine)
    assert res.requeued == ("r0",) and s.phase("r0") is Phase.BOUND
    assert s.read_queue(a.read_node) == 0
    [b] = s.on_pe_group_fetch("P")
    assert b.pe_engine != a.pe_engine and b.de_engine == a.de_engine and b.attempt == 1


def test_de_death_replans_from_scratch_and_releases_pe():
    s = _pair()
    s.submit(req(0))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    res = s.remove_engine(a.de_engine)
    assert res.requeued == ("r0",) and s.phase("r0") is Phase.QUEUED
    assert s.engine_report(a.pe_engine).tok == 0
    [b] = s.on_de_group_fetch("D")
    assert b.de_engine != a.de_engine


def test_replans_are_bounded_then_failed():
    s = _pair(max_replans=1)
    s.submit(req(0))
    bind_all(s)
    s.on_pe_group_fetch("P")
    assert s.fail("r0").requeued == ("r0",)
    bind_all(s)
    s.on_pe_group_fetch("P")
    assert s.fail("r0").failed == ("r0",)
    assert s.queue_lengths()["total"] == 0
    assert all(s.engine_report(e).tok == 0 for e in ("p0", "p1", "d0", "d1"))


def test_attempt_numbers_count_from_the_epochs_base_and_replans_stay_bounded():
    """A restarted scheduler (a new epoch) numbers a resubmitted request's attempts past every
    number its predecessor could have used: an engine request of the old attempt, still
    ending, is never taken for the new one (docs/engine-api.md, "Attempts")."""
    old_start, restart = 1_796_000_000_000_000_000, 1_796_000_000_004_000_000  # ns: 4 ms later
    assert attempt_base(restart) - attempt_base(old_start) == 4 * ATTEMPT_SPAN
    assert attempt_base(7) == 7 * ATTEMPT_SPAN            # an etcd revision: counted as is
    assert attempt_base(restart) + ATTEMPT_SPAN < 2**53   # exact in every JSON client
    s = _pair(max_replans=2)
    s.attempt_base = attempt_base(restart)
    s.submit(req(0))
    attempts = []
    for _ in range(3):
        bind_all(s)
        [a] = s.on_pe_group_fetch("P")
        attempts.append(a.attempt)
        s.fail("r0")
    assert attempts == [s.attempt_base, s.attempt_base + 1, s.attempt_base + 2]
    with pytest.raises(NotFound):                          # the third failure was final
        s.phase("r0")
    with pytest.raises(msgspec.ValidationError):           # re-plans must fit one epoch's span
        msgspec.convert({"max_replans": ATTEMPT_SPAN}, SchedulerConfig)


def test_remove_node_drops_group_and_requeues_private_queue():
    s = Scheduler(cfg(), [pe("p0", "P"), de("a0", "DA", hbm=10), de("b0", "DB", hbm=10)])
    load(s, ("a0", 0, 0, 0), ("b0", 0, 5, 0))
    s.submit(req(0, hbm=5))
    s.on_de_group_fetch("DB")
    assert s.private_queue("DA") == ["r0"]
    s.remove_node("DA")
    assert "DA" not in s.group_ids(Role.DECODE)
    load(s, ("b0", 0, 5, 10))
    assert [b.de_engine for b in s.on_de_group_fetch("DB")] == ["b0"]
    with pytest.raises(NotFound):
        s.remove_node("DA")


def test_cancel_in_every_phase_releases_everything():
    s = _pair()
    for i in range(4):
        s.submit(req(i, hit=100, hbm=3))
    s.on_de_group_fetch("D")
    s.on_pe_group_fetch("P")
    s.prefill_done("r3")
    s.submit(req(9))
    for rid in ("r9", "r0", "r3"):
        assert s.cancel(rid)
    s.cancel("r1"), s.cancel("r2")
    assert not s.cancel("r1")
    assert s.queue_lengths() == {"global": 0, "private": 0, "pe": 0, "total": 0}
    assert s.read_queue("P") == s.read_queue("D") == 0
    assert all(s.engine_report(e).tok == 0 and s.engine_report(e).seq == 0
               for e in ("p0", "p1", "d0", "d1"))


def test_bad_input_is_typed():
    s = _pair()
    s.submit(req(0))
    with pytest.raises(AlreadyExists):
        s.submit(req(0))
    with pytest.raises(InvalidArgument):
        Request("x", "s", -1, 5, 0, 0)
    small = Scheduler(cfg(), [de("d0", "D", hbm=100)])
    with pytest.raises(InvalidArgument):
        small.submit(req(1, hbm=101))
    with pytest.raises(NotFound):
        s.on_pe_group_fetch("nope")
    with pytest.raises(AlreadyExists):
        s.add_engine(pe("p0", "P"))


def test_records_round_trip_msgpack_and_unknown_telemetry_is_ignored():
    s = _pair()
    s.submit(req(0, hit=100))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(a), type=type(a)) == a
    s.apply_telemetry(Telemetry((EngineReport("ghost", 1, 1),), {"nowhere": 5}))
    assert s.engine_report("p0").tok == 110
    assert [r.engine_id for r in s.engine_reports(Role.DECODE)] == ["d0", "d1"]
