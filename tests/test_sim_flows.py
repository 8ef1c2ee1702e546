"""Max-min fair bandwidth sharing of the simulator (sim/flows.py) and its event loop."""

from __future__ import annotations

import random

import pytest

from sim.events import EventLoop
from sim.flows import FlowNet, Link, merge_links, normalized, solve_maxmin


def net():
    loop = EventLoop()
    return loop, FlowNet(loop)


def one(link, w=1.0):
    return ((link, w),)


def test_equal_share_then_the_survivor_takes_the_link():
    loop, fn = net()
    link = Link("l", 10.0)
    a = fn.start(one(link), 1e9, None)
    b = fn.start(one(link), 1e9, None)
    assert a.rate == b.rate == 5.0 and link.total == 10.0
    fn.cancel(a)
    assert b.rate == 10.0


def test_classic_two_link_max_min():
    # f1 on L1, f2 on L1+L2, f3 on L2: L1 (cap 1) is the bottleneck of f1 and f2, f3 takes the rest
    loop, fn = net()
    l1, l2 = Link("l1", 1.0), Link("l2", 2.0)
    f1 = fn.start(one(l1), 1e9, None)
    f2 = fn.start(merge_links([(l1, 1), (l2, 1)]), 1e9, None)
    f3 = fn.start(one(l2), 1e9, None)
    assert (f1.rate, f2.rate, f3.rate) == pytest.approx((0.5, 0.5, 1.5))
    fn.cancel(f1)                            # f2 now limited by L2's fair share
    assert (f2.rate, f3.rate) == pytest.approx((1.0, 1.0))


def test_rate_cap_and_weights():
    loop, fn = net()
    link = Link("l", 10.0)
    capped = fn.start(one(link), 1e9, None, cap=2.0)
    other = fn.start(one(link), 1e9, None)
    assert (capped.rate, other.rate) == pytest.approx((2.0, 8.0))
    m = Link("m", 3.0)
    half = fn.start(one(m, 0.5), 1e9, None)  # puts half its rate on m
    full = fn.start(one(m), 1e9, None)
    assert half.rate == pytest.approx(2.0) and full.rate == pytest.approx(2.0)
    assert m.total == pytest.approx(3.0)


def test_normalized_weights_measure_the_busiest_link():
    a, b = Link("a", 1.0), Link("b", 1.0)
    links, size = normalized({a: 30.0, b: 10.0})
    assert size == 30.0 and dict(links) == {a: 1.0, b: pytest.approx(1 / 3)}


def test_streams_go_first_bulk_takes_the_rest():
    loop, fn = net()
    link = Link("l", 10.0)
    bulk = fn.start(one(link), 1e9, None)
    assert bulk.rate == 10.0
    stream = fn.start(one(link), 1e9, None, cap=6.0, stream=True)
    assert (stream.rate, bulk.rate) == pytest.approx((6.0, 4.0))
    fn.cancel(stream)
    assert bulk.rate == pytest.approx(10.0)


def test_completion_times_by_hand():
    loop, fn = net()
    link = Link("l", 2.0)
    done = []
    fn.start(one(link), 10.0, lambda tag: done.append((tag, loop.now)), "a")
    fn.start(one(link), 20.0, lambda tag: done.append((tag, loop.now)), "b")
    loop.run()
    # both at 1 B/s until a finishes at t=10; b has 10 B left at 2 B/s -> t = 15
    assert done == [("a", pytest.approx(10.0)), ("b", pytest.approx(15.0))]
    assert link.bytes_at(loop.now) == pytest.approx(30.0)


def test_zero_byte_flow_completes_at_once():
    loop, fn = net()
    seen = []
    fn.start(one(Link("l", 1.0)), 0.0, seen.append, "x")
    loop.run()
    assert seen == ["x"] and loop.now == 0.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_incremental_equals_from_scratch(seed):
    """Random adds and removals (mixed classes, weights, caps): the incremental solution is the
    reference max-min solution after every change, and no link is over capacity."""
    rng = random.Random(seed)
    for _ in range(60):
        loop, fn = net()
        links = [Link(f"l{i}", rng.choice([1.0, 2.0, 5.0, 10.0])) for i in range(rng.randint(1, 10))]
        flows = []
        for _ in range(40):
            if flows and rng.random() < 0.4:
                fn.cancel(flows.pop(rng.randrange(len(flows))))
            else:
                k = rng.randint(1, min(4, len(links)))
                ls = merge_links((lk, rng.choice([1.0, 1.0, 0.5, 0.25])) for lk in rng.sample(links, k))
                cap = rng.choice([None, None, rng.uniform(0.1, 3.0)])
                flows.append(fn.start(ls, 1e9, None, None, cap, stream=rng.random() < 0.4))
            ref = solve_maxmin(flows)
            for f in flows:
                assert f.rate == pytest.approx(ref[f], rel=1e-6, abs=1e-9)
            for lk in links:
                assert lk.total <= lk.cap * (1 + 1e-9)


def test_flows_finishing_over_time_match_reference():
    rng = random.Random(7)
    loop, fn = net()
    links = [Link(f"l{i}", rng.choice([1.0, 3.0])) for i in range(5)]
    live = []
    for i in range(30):
        ls = merge_links((lk, 1.0) for lk in rng.sample(links, rng.randint(1, 3)))
        live.append(fn.start(ls, rng.uniform(0.5, 5.0), None, stream=i % 3 == 0))
    while loop.next_time() is not None:
        loop.run(until=loop.next_time())
        active = [f for f in live if f.active]
        ref = solve_maxmin(active)
        for f in active:
            assert f.rate == pytest.approx(ref[f], rel=1e-6, abs=1e-9)
    assert not any(f.active for f in live)


def test_event_loop_orders_ties_by_scheduling():
    loop = EventLoop()
    seen = []
    loop.at(1.0, seen.append, "b")
    loop.at(0.5, seen.append, "a")
    loop.at(1.0, seen.append, "c")
    loop.run()
    assert seen == ["a", "b", "c"] and loop.events == 3


def test_event_loop_same_time_events_keep_scheduling_order_across_stop():
    # An event scheduled for the current time runs after those already due then; a stop in
    # the middle of a time's events keeps the rest, still ahead of the later-scheduled one.
    loop = EventLoop()
    seen = []

    def ev(x):
        seen.append(x)
        if x == "a":
            loop.at(loop.now, seen.append, "c")
            loop.at(0.0, seen.append, "c2")       # in the past: runs now, after "c"
        if x == "b":
            loop.stop()

    loop.at(1.0, ev, "a")
    loop.at(1.0, ev, "b")
    loop.at(1.0, seen.append, "d")
    loop.at(2.0, seen.append, "e")
    loop.run()
    assert seen == ["a", "b"] and loop.events == 2 and loop.next_time() == 1.0
    loop.stopped = False
    loop.run(until=1.5)
    assert seen == ["a", "b", "d", "c", "c2"] and loop.now == 1.0 and loop.next_time() == 2.0
    loop.run()
    assert seen[-1] == "e" and loop.events == 6 and loop.next_time() is None
