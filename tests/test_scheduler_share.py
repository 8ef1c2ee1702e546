"""The PE fair share (``SchedulerConfig.pe_share``, ``policy.pe_share_limit``): a fetch takes at
most its group's share of the cluster's PE load, so a burst is spread over the PE groups; the
core's incremental sums stay exact. Algorithm 1 with the limit is also checked by the property
tests of ``test_scheduler_properties.py``."""

from __future__ import annotations

from services.scheduler.core.records import Role

from services.scheduler.core.scheduler import Scheduler
from tests.test_scheduler_policy import BIG, bind_all, cfg, de, load, pe, req


def _share_cluster(share: float, beta: int = BIG) -> Scheduler:
    """4 PE groups (nodes) of 2 engines and one roomy DE."""
    specs = [pe(f"p{g}.{i}", f"P{g}") for g in range(4) for i in range(2)] + [de("d0", "D")]
    return Scheduler(cfg(beta_tokens=beta, pe_share=share), specs)


def test_pe_share_splits_a_burst_over_pe_groups():
    # 40 requests of load 100 reach the PE queue between two fetches; every group has room
    # under β for all of them. β alone: the first group to fetch takes the whole burst.
    counts = {}
    for share in (0.0, 1.0):
        s = _share_cluster(share)
        for i in range(40):
            s.submit(req(i, hit=0, new=100))
        bind_all(s)
        counts[share] = [len(s.on_pe_group_fetch(g)) for g in s.group_ids(Role.PREFILL)]
    assert counts[0.0] == [40, 0, 0, 0]
    # Fair share: limit (4,000 queued + 0) / 8 engines = 500; an engine takes work while its
    # tok_e ≤ 500 (checked before each assignment, as β is), so 6 each, 12 a group; the last
    # group fetching takes what is left.
    assert counts[1.0] == [12, 12, 12, 4]


def test_pe_share_counts_running_load_and_beta_still_binds():
    s = _share_cluster(1.0, beta=700)
    load(s, ("p0.0", 1, 900), ("p0.1", 1, 100), ("p1.0", 1, 0), ("p1.1", 1, 0))
    for i in range(8):
        s.submit(req(i, hit=0, new=100))
    bind_all(s)
    # limit = (800 queued + 1,000 running) / 8 = 225: p0.0 (900) is over it, p0.1 takes 2
    assert [a.pe_engine for a in s.on_pe_group_fetch("P0")] == ["p0.1", "p0.1"]
    assert [a.pe_engine for a in s.on_pe_group_fetch("P1")] == ["p1.0", "p1.1"] * 3
    # β (700) binds where it is lower than the share: one group of idle engines, a big burst
    s = _share_cluster(1.0, beta=700)
    for i in range(100):
        s.submit(req(i, hit=0, new=100))
    bind_all(s)
    assert len(s.on_pe_group_fetch("P0")) == 16          # 8 per engine: 0 … 700, then > β


def test_pe_share_never_strands_work():
    # A request far above the fair share still goes to the least loaded engine, and the
    # groups fetching after the first take everything that is left over.
    s = _share_cluster(1.0)
    s.submit(req(0, hit=0, new=5_000))
    bind_all(s)
    assert [a.pe_engine for a in s.on_pe_group_fetch("P0")] == ["p0.0"]
    for i in range(1, 30):
        s.submit(req(i, hit=0, new=10 + i))
    bind_all(s)
    for g in s.group_ids(Role.PREFILL):
        s.on_pe_group_fetch(g)
    assert s.pe_queue() == []


def test_pe_share_sums_follow_every_change():
    # The core keeps Σ tok_e over all PEs and the PE queue's load incrementally; they must
    # match a recount after placements, telemetry, completions, cancels, failures, re-plans
    # and engine removal.
    s = Scheduler(cfg(pe_share=1.0), [pe(f"p{g}.{i}", f"P{g}") for g in range(3) for i in range(2)]
                  + [de("d0", "D0"), de("d1", "D1")])

    def check():
        pes = [e for e in s._engines.values() if e.role is Role.PREFILL]
        assert s._pe_tok == sum(e.tok for e in pes)
        live = s._pe_queue.live()
        assert s._pe_queue.tokens == sum(p.pe_tokens for p in live)
        assert s._pe_queue.waiting == len(live)
        assert s._n_pe == len(pes)

    for i in range(30):
        s.submit(req(i, hit=50, new=20 + i))
    bind_all(s)
    check()
    placed = [a.request_id for a in s.on_pe_group_fetch("P0")]
    check()
    load(s, ("p0.0", 1, 7), ("p1.0", 0, 3))
    check()
    s.read_done(placed[0])
    s.prefill_done(placed[0])
    s.complete(placed[0])
    check()
    s.cancel(placed[1])
    s.cancel("r29")                      # still in the PE queue
    check()
    s.fail(placed[2])
    check()
    placed = [a.request_id for a in s.on_pe_group_fetch("P1")]
    check()
    s.remove_engine("p1.0")              # its requests go back to the PE queue
    check()
    s.remove_node("D1")                  # DE gone: its requests start over
    check()
    bind_all(s)
    for g in s.group_ids(Role.PREFILL):
        s.on_pe_group_fetch(g)
    check()
