"""Page pool accounting: exact, no double allocation, no leak (property test), async waits."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.buffers import AsyncPagePool, PagePool
from common.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted


def test_alloc_free_roundtrip_and_counters():
    pool = PagePool(4096, 16, name="pe")
    a = pool.alloc(4096 * 3 + 1, "r1")
    assert a.n_pages == 4 and a.contiguous and pool.free_pages == 12
    assert pool.counters()["pe_pages_used"] == 4
    a.free()
    assert pool.free_pages == 16 and pool.free_extents() == [(0, 16)]
    with pytest.raises(InvalidArgument, match="double free"):
        a.free()


def test_exhaustion_is_retryable_and_bad_sizes_rejected():
    pool = PagePool(4096, 4)
    pool.alloc(4096 * 4, "a")
    with pytest.raises(ResourceExhausted) as e:
        pool.alloc(1, "b")
    assert e.value.retryable
    with pytest.raises(InvalidArgument):
        pool.alloc(0, "b")
    with pytest.raises(InvalidArgument):
        pool.alloc(4096 * 5, "b")


def test_fragmented_pool_splits_and_slots_map_logical_bytes():
    pool = PagePool(100, 10)
    allocs = [pool.alloc(100, f"r{i}") for i in range(10)]
    for a in allocs[::2]:
        a.free()                            # free pages 0,2,4,6,8
    with pytest.raises(ResourceExhausted):
        pool.alloc(300, "x", allow_split=False)
    big = pool.alloc(250, "x")
    assert not big.contiguous and big.n_pages == 3
    slots = big.slots()
    assert sum(n for _, n in slots) == 250
    assert [off % 100 for off, _ in slots] == [0, 0, 0]
    assert big.slots(150, 60) == [(slots[1][0] + 50, 50), (slots[2][0], 10)]
    views = big.views()
    payload = np.arange(250, dtype=np.uint8)
    pos = 0
    for v in views:
        v[:] = payload[pos:pos + v.nbytes]
        pos += v.nbytes
    assert np.array_equal(np.concatenate(big.views()), payload)
    with pytest.raises(InvalidArgument):
        big.view()
    pool.check_invariants()


def test_free_owner_returns_everything_of_that_owner():
    pool = PagePool(10, 10)
    pool.alloc(20, "req-1")
    pool.alloc(10, "req-2")
    pool.alloc(30, "req-1")
    assert pool.free_owner("req-1") == 5
    assert pool.used_pages == 1
    pool.check_invariants()


def test_allocation_from_another_pool_is_rejected():
    a = PagePool(10, 2).alloc(10, "x")
    with pytest.raises(InvalidArgument):
        PagePool(10, 2).free(a)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 700), st.integers(0, 50)), max_size=80))
def test_random_alloc_free_keeps_exact_accounting(ops):
    pool = PagePool(64, 32)
    live = []
    for is_alloc, size, pick in ops:
        if is_alloc:
            try:
                a = pool.alloc(size, f"r{len(live)}", allow_split=bool(pick % 2))
            except ResourceExhausted:
                continue
            assert sum(n for _, n in a.slots()) == size
            live.append(a)
        elif live:
            live.pop(pick % len(live)).free()
        pool.check_invariants()
        assert pool.used_pages == sum(a.n_pages for a in live)
    # no two live allocations share a page
    seen = set()
    for a in live:
        for first, n in a.extents:
            pages = set(range(first, first + n))
            assert not pages & seen
            seen |= pages
    for a in live:
        a.free()
    assert pool.free_extents() == [(0, 32)]


async def test_async_alloc_waits_for_a_free_and_times_out():
    apool = AsyncPagePool(PagePool(10, 2))
    a = await apool.alloc(20, "a", timeout_s=1)
    waiter = asyncio.create_task(apool.alloc(10, "b", timeout_s=5))
    await asyncio.sleep(0)                   # let it run: it must wait, not allocate
    assert not waiter.done()
    await apool.free(a)
    b = await waiter
    assert b.owner == "b"
    with pytest.raises(DeadlineExceeded):
        await apool.alloc(20, "c", timeout_s=0.05)
