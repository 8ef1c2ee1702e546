"""The read side counts write-backs (``SchedulerConfig.write_weight``): a DE node's storage link
also carries every request's write-back, so on a miss-heavy workload the hits stay on the PE's
link, and a long miss-heavy phase does not keep reads off the DE links for good
(docs/workloads.md "Never worse than basic")."""

from __future__ import annotations

from services.scheduler.core.records import ReadSide
from services.scheduler.core.scheduler import Scheduler
from tests.test_scheduler_policy import BIG, bind_all, cfg, de, load, pe, req

CREDIT = 1000          # read_credit_s × snic / bytes per token, in tokens (test-small: 1 KiB)


def _1p2d(**kw) -> Scheduler:
    kw.setdefault("beta_tokens", BIG)
    kw.setdefault("snic_bytes_per_s", CREDIT * 1024.0)
    kw.setdefault("model", "test-small")
    return Scheduler(cfg(**kw), [pe("p0", "P"), de("d0", "D0"), de("d1", "D1")])


def _round(s: Scheduler, k: int, n: int, hit: int, new: int) -> list:
    """``n`` requests placed, read and finished: returns their assignments."""
    ids = []
    for i in range(k, k + n):
        s.submit(req(i, hit=hit, new=new))
        ids.append(f"r{i}")
    bind_all(s)
    out = s.on_pe_group_fetch("P")
    for rid in ids:
        s.read_done(rid)
        s.prefill_done(rid)
        s.complete(rid)
    return out


def test_miss_heavy_hits_stay_on_the_pe_link():
    # 10 % hits: each request writes ~9x its hit back through its DE's node. Counting reads
    # alone levelled the reads over the three links (2/3 onto the DE nodes); with the writes
    # counted the DE links are the busier ones and the PE's link takes the hits.
    sides = {"with": [], "without": []}
    for label, weight in (("with", 1.0), ("without", 0.0)):
        s = _1p2d(write_weight=weight)
        for r in range(20):
            sides[label] += [a.read_side for a in _round(s, 6 * r, 6, hit=100, new=900)]
    assert sides["with"].count(ReadSide.DE) <= 2          # the first round, before writes count
    assert sides["without"].count(ReadSide.DE) >= len(sides["without"]) // 2


def test_hit_heavy_reads_still_use_both_paths():
    # 95 % hits: writes are a few per cent of the links' bytes, the dual path balances as before.
    s = _1p2d()
    out = [a.read_side for r in range(20) for a in _round(s, 6 * r, 6, hit=1900, new=100)]
    assert 0.5 <= out.count(ReadSide.DE) / len(out) <= 0.8


def test_a_miss_heavy_past_does_not_keep_reads_off_the_de_links():
    # After many write-heavy requests the DE nodes have been sent far more than the PE's node;
    # writes lift a node to at most the mean plus the credit, so once the PE's read queue is a
    # few credits longer than a DE's, reads go to the DE again.
    s = _1p2d()
    for r in range(50):
        _round(s, 6 * r, 6, hit=0, new=2000)
    for i in range(300, 304):
        s.submit(req(i, hit=100, new=10))
    bind_all(s)
    load(s, read_q={"P": 5 * CREDIT, "D0": 0, "D1": 0})
    assert {a.read_side for a in s.on_pe_group_fetch("P")} == {ReadSide.DE}


def test_an_idle_pe_link_beside_a_busy_de_link_takes_the_read():
    s = _1p2d(write_weight=0.0)
    _round(s, 0, 30, hit=100, new=10)          # the PE node has been sent more than the DEs
    s.submit(req(100, hit=100, new=10))
    bind_all(s)
    load(s, read_q={"P": 0, "D0": 10, "D1": 10})
    assert [a.read_side for a in s.on_pe_group_fetch("P")] == [ReadSide.PE]
