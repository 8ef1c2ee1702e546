"""The scheduler core's read side (paper §5: which node reads a hit from storage, and how its
read queue feeds back into placement) and the ablation switches that change it (basic, dpl,
oracle, round-robin). Builders shared with ``test_scheduler_policy.py``."""

from __future__ import annotations

import pytest

from common.errors import NotFound
from services.scheduler.core.records import EngineReport, Phase, ReadSide
from services.scheduler.core.scheduler import Scheduler
from tests.test_scheduler_policy import BETA, BIG, _pair, bind_all, cfg, de, load, pe, req


# ============================================================================ read side + flow

def test_read_side_is_shorter_queue_and_its_queue_grows():
    s = _pair()
    load(s, read_q={"P": 10, "D": 5})
    s.submit(req(0, hit=100))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    assert (a.read_side, a.read_node) == (ReadSide.DE, "D")
    assert s.read_queue("D") == 105 and s.read_queue("P") == 10


def test_read_side_tie_goes_to_pe_and_later_requests_see_the_update():
    s = _pair()
    s.submit(req(0, hit=100))
    s.submit(req(1, hit=100))
    s.submit(req(2, hit=100))
    bind_all(s)
    out = s.on_pe_group_fetch("P")
    # tie 0/0 → PE (P=100); then D shorter (0) → DE (D=100); tie again → PE.
    assert [a.read_side for a in out] == [ReadSide.PE, ReadSide.DE, ReadSide.PE]


def test_read_side_gives_pe_nodes_their_share_of_bursty_group_fetches():
    # Each round one PE group takes a burst (as when its engines drop below β together) and
    # the reads finish before the next round. A PE node only gets reads at its own group's
    # fetches, DE nodes at everyone's: by queue length alone the PE node loses after its first
    # read and its storage link idles (share 0.25 here; at 12P24D PE SNICs ran at 38 % while
    # DE SNICs ran at 92 %). Counting what each link was sent levels them.
    n_pe, n_de, burst = 6, 12, 36
    s = Scheduler(cfg(beta_tokens=BIG), [pe(f"p{i}", f"P{i}") for i in range(n_pe)]
                  + [de(f"d{i}", f"D{i}") for i in range(n_de)])
    sent = dict.fromkeys([f"P{i}" for i in range(n_pe)] + [f"D{i}" for i in range(n_de)], 0)
    k = 0
    for r in range(24):
        ids = [f"r{i}" for i in range(k, k + burst)]
        for i in range(k, k + burst):
            s.submit(req(i, hit=1000, new=10))
        k += burst
        bind_all(s)
        out = s.on_pe_group_fetch(f"P{r % n_pe}")
        assert len(out) == burst
        for a in out:
            sent[a.read_node] += a.hit_tokens
        for rid in ids:
            s.read_done(rid)
            s.prefill_done(rid)
            s.complete(rid)
    mean = sum(sent.values()) / len(sent)
    pe_share = sum(sent[f"P{i}"] for i in range(n_pe)) / n_pe / mean
    assert pe_share >= 0.8, sent
    assert max(sent.values()) <= 1.25 * mean and min(sent.values()) >= 0.6 * mean, sent


def test_read_side_still_avoids_a_long_queue():
    # A slow storage link (its gateway reports a long queue) is avoided although it has been
    # sent less than the other side.
    s = _pair()
    for i in range(4):
        s.submit(req(i, hit=100))
    bind_all(s)
    load(s, read_q={"P": 10**6, "D": 0})
    assert {a.read_side for a in s.on_pe_group_fetch("P")} == {ReadSide.DE}


def test_dpl_alternation_spreads_de_reads_over_de_nodes():
    # 1P2D with round-robin DEs: a single global alternation put every DE-path read on d1.
    s = Scheduler(cfg(policy="dpl"), [pe("p0", "P"), de("d0", "D0"), de("d1", "D1")])
    for i in range(8):
        s.submit(req(i, hit=100, new=1))
    bind_all(s)
    out = s.on_pe_group_fetch("P")
    de_reads = [a.read_node for a in out if a.read_side is ReadSide.DE]
    assert sorted(de_reads) == ["D0", "D0", "D1", "D1"]


def test_de_is_bound_before_the_read_is_issued():
    s = _pair()
    s.submit(req(0))
    assert s.on_pe_group_fetch("P") == []               # no DE yet → no PE, no read
    assert s.phase("r0") is Phase.QUEUED and s.read_queue("P") == 0
    [b] = s.on_de_group_fetch("D")
    assert s.phase("r0") is Phase.BOUND
    [a] = s.on_pe_group_fetch("P")
    assert a.de_engine == b.de_engine and s.phase("r0") is Phase.PLACED


def test_lifecycle_releases_read_pe_and_de():
    s = _pair()
    s.submit(req(0, hit=100, new=20, gen=5, hbm=7))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    assert s.engine_report(a.pe_engine).tok == 120 and s.engine_report(a.de_engine).tok == 125
    s.read_done("r0")
    assert s.read_queue(a.read_node) == 0
    s.prefill_done("r0")
    assert s.engine_report(a.pe_engine).tok == 0 and s.phase("r0") is Phase.DECODING
    s.complete("r0")
    assert s.engine_report(a.de_engine) == EngineReport(a.de_engine, 0, 0, BIG)
    assert s.queue_lengths()["total"] == 0
    with pytest.raises(NotFound):
        s.complete("r0")


def test_no_hit_means_no_read():
    s = _pair()
    s.submit(req(0, hit=0, new=10))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    assert a.read_side is ReadSide.NONE and a.read_node is None


# ============================================================================ ablation switches

def _many(s: Scheduler, n: int) -> list:
    for i in range(n):
        s.submit(req(i, hit=100, new=1))
    bind_all(s)
    return s.on_pe_group_fetch("P")


def test_basic_reads_on_pe_side_only():
    s = _pair(policy="basic")
    load(s, read_q={"P": 10**6})
    assert {a.read_side for a in _many(s, 6)} == {ReadSide.PE}


def test_dpl_alternates_read_side_without_balancing():
    s = _pair(policy="dpl")
    load(s, read_q={"P": 0, "D": 10**6})
    assert [a.read_side for a in _many(s, 4)] == [ReadSide.PE, ReadSide.DE] * 2


def test_oracle_reads_nothing():
    s = _pair(oracle=True)
    out = _many(s, 4)
    assert {a.read_side for a in out} == {ReadSide.NONE}
    assert s.read_queue("P") == s.read_queue("D") == 0


def test_round_robin_placement_ignores_load_but_not_beta():
    s = _pair(placement="round_robin")
    load(s, ("p0", 0, 800))
    out = _many(s, 3)
    # p0, p1, then p0 again although p0 carries far more tokens; β still caps it.
    assert [a.pe_engine for a in out] == ["p0", "p1", "p0"]
    load(s, ("p0", 0, BETA + 1), ("p1", 0, BETA + 1))
    s.submit(req("x"))
    bind_all(s)
    assert s.on_pe_group_fetch("P") == []


def test_round_robin_de_placement_cycles_groups_and_engines():
    s = Scheduler(cfg(policy="dpl"), [pe("p0", "P")] + [de(f"d{g}.{i}", f"D{g}")
                                                        for g in range(2) for i in range(2)])
    load(s, ("d0.0", 0, 10**6))
    for i in range(4):
        s.submit(req(i))
    s.on_de_group_fetch("D0")
    assert s.private_queue("D1") == ["r1", "r3"]
    s.on_de_group_fetch("D1")
    assert [a.de_engine for a in s.on_pe_group_fetch("P")] == ["d0.0", "d1.0", "d0.1", "d1.1"]


# ============================================================================ split reads

def _split_pair(**kw) -> Scheduler:
    kw.setdefault("split_reads", True)
    kw.setdefault("split_min_blocks", 2)
    return Scheduler(cfg(**kw), [pe("p0", "P"), de("d0", "D")], block_tokens=64)


def test_split_read_levels_both_links_in_whole_blocks_and_releases_both():
    s = _split_pair()
    load(s, read_q={"P": 0, "D": 192})
    s.submit(req(0, hit=1024))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    # the DE's link has 192 tokens ahead: it takes (1024 - 192) / 2 = 416 → 448 (7 blocks),
    # the PE's the rest: both finish at about the same time
    assert (a.read_side, a.read_node, a.split_tokens) == (ReadSide.SPLIT, "P", 448)
    assert s.read_queue("P") == 1024 - 448 and s.read_queue("D") == 192 + 448
    assert s.read_planned() == {"P": 576, "D": 448}
    assert s.read_side_tokens == {"pe": 576, "de": 448} and s.reads.split_reads == 1
    s.read_done("r0")
    assert s.read_queue("P") == 0 and s.read_queue("D") == 192


@pytest.mark.parametrize("d_queue, hit, side", [
    (1024, 1024, ReadSide.PE),      # the DE's link is a whole hit behind: all on the PE's
    (0, 192, ReadSide.PE),          # a part would be under 2 blocks: one link (a tie: PE)
    (None, 1024, ReadSide.PE),      # split_reads off: the paper's rule
])
def test_split_read_falls_back_to_one_link(d_queue, hit, side):
    s = _split_pair(split_reads=d_queue is not None)
    load(s, read_q={"P": 0, "D": d_queue or 0})
    s.submit(req(0, hit=hit))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    assert (a.read_side, a.split_tokens) == (side, 0)


def test_split_reads_only_under_the_balancing_policy_and_never_on_one_node():
    for policy in ("basic", "dpl"):
        s = _split_pair(policy=policy)
        s.submit(req(0, hit=1024))
        bind_all(s)
        assert s.on_pe_group_fetch("P")[0].read_side is not ReadSide.SPLIT
    s = Scheduler(cfg(split_reads=True), [pe("p0", "N"), de("d0", "N")], block_tokens=64)
    s.submit(req(0, hit=1024))
    bind_all(s)
    assert s.on_pe_group_fetch("N")[0].read_side is ReadSide.PE


def test_a_replan_takes_a_split_reads_tokens_off_both_links():
    s = _split_pair()
    s.submit(req(0, hit=1024))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    assert a.read_side is ReadSide.SPLIT and a.split_tokens == 512
    s.fail("r0")
    assert s.read_queue("P") == 0 and s.read_queue("D") == 0
