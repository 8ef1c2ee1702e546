"""The gateway's read queue (FIFO, bounded, OVERLOADED when full; cancelled and timed-out reads
release their slot and pins), link shaping (token bucket, reads and writes charged to the link)
and the read order on it (earliest request first, or interleaved), on virtual time.
Helpers: ``test_gateway_storage.py``."""

from __future__ import annotations

import asyncio
import contextvars
import functools

import pytest

from common.errors import DeadlineExceeded, InvalidArgument, Overloaded
from common.rate import TokenBucket
from storage_gateway.link_shaper import LinkShaper
from storage_gateway.priority_gate import PriorityGate
from storage_gateway.read_queue import ReadQueue
from storage_gateway import backend_memory as backend_memory_mod
from storage_gateway import link_shaper as link_shaper_mod
from storage_gateway import store as store_mod
from storage_gateway.store import GatewayStore
from tests.helpers import VirtualTime, until
from tests.test_gateway_storage import (BB, SPEC, T, empty_dests, gate_reads, make_cfg, rand_blocks,
                                        rand_keys)


# ----------------------------------------------------------------------------- read queue

def test_read_queue_fifo_bounded_and_overloaded():
    q = ReadQueue(block_tokens=64, block_bytes=BB, max_concurrent=2, max_queued=2,
                  max_keys=100, max_bytes=100 * BB, retry_after_s=0.2)
    t1, s1 = q.submit(1)
    t2, s2 = q.submit(2)
    t3, s3 = q.submit(3)
    t4, s4 = q.submit(4)
    assert (s1, s2, s3, s4) == (True, True, False, False)
    assert q.read_q == 64 * 10 and q.inflight_tokens == 64 * 3 and q.queued_tokens == 64 * 7
    with pytest.raises(Overloaded) as e:
        q.submit(1)
    assert e.value.retry_after_s == 0.2 and e.value.retryable
    assert q.finish(t2) == [t3]                                  # FIFO: t3 before t4
    assert q.cancel(t4) == [] and q.read_q == 64 * 4
    assert q.finish(t1) == [] and q.finish(t3) == []
    assert q.read_q == 0 and q.n_running == 0
    with pytest.raises(InvalidArgument):
        q.finish(t3)
    with pytest.raises(InvalidArgument):
        q.submit(101)


async def test_store_read_queue_accounting_fifo_and_overload(tmp_path):
    cfg = make_cfg(tmp_path, "memory", max_concurrent_reads=1, max_queued_requests=2)
    keys = rand_keys(6)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks(keys, rand_blocks(6))
        gate, started = gate_reads(store)
        groups = [keys[0:2], keys[2:3], keys[3:6]]
        tasks = [asyncio.create_task(store.read_blocks(g, empty_dests(len(g)), request_id=f"r{i}"))
                 for i, g in enumerate(groups)]
        await until(lambda: store.read_queue.n_waiting == 2 and started)
        assert store.read_q == 6 * T and store.stats()["read_requests_running"] == 1
        with pytest.raises(Overloaded):
            await store.read_blocks(keys[:1], empty_dests(1))
        gate.set()
        results = await asyncio.gather(*tasks)
        assert all(all(r.found) for r in results)
        assert started == groups                                  # served in arrival order
        assert store.read_q == 0 and store.stats()["pinned_blocks"] == 0


async def test_cancelled_and_timed_out_reads_release_queue_and_pins(tmp_path):
    cfg = make_cfg(tmp_path, "memory", max_concurrent_reads=1)
    keys = rand_keys(3)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks(keys, rand_blocks(3))
        gate, started = gate_reads(store)
        with pytest.raises(DeadlineExceeded):
            first = asyncio.create_task(store.read_blocks(keys[:2], empty_dests(2), timeout_s=0.2))
            queued = asyncio.create_task(store.read_blocks(keys[2:], empty_dests(1)))
            await until(lambda: store.read_q == 3 * T)
            queued.cancel()
            await until(lambda: store.read_q == 2 * T)
            await first
        assert store.read_q == 0 and store.stats()["pinned_blocks"] == 0
        gate.set()
        assert all((await store.read_blocks(keys, empty_dests(3))).found)


# ----------------------------------------------------------------------------- link shaping

class _VirtualAsyncio:
    """``asyncio`` as ``storage_gateway.link_shaper`` sees it, its ``sleep`` on virtual time."""

    def __init__(self, vt: VirtualTime) -> None:
        self.sleep = vt.sleep

    def __getattr__(self, name: str):
        return getattr(asyncio, name)


def virtual_link(monkeypatch) -> VirtualTime:
    """Every LinkShaper made from here on (the store's too) runs on one virtual clock, which
    stands still while the memory backend's I/O (its thread pool) runs."""
    vt = VirtualTime()
    monkeypatch.setattr(link_shaper_mod, "asyncio", _VirtualAsyncio(vt))
    monkeypatch.setattr(store_mod, "LinkShaper", functools.partial(LinkShaper, clock=vt.clock))
    monkeypatch.setattr(backend_memory_mod, "run_io", vt.real_io(backend_memory_mod.run_io))
    return vt


async def test_link_shaper_rate_and_fair_interleaving(monkeypatch):
    rate, burst = 20e6, 256 * 1024
    vt = virtual_link(monkeypatch)
    shaper = LinkShaper(rate, burst_bytes=burst, chunk_bytes=256 * 1024, clock=vt.clock)
    done: list[float] = []

    async def reader() -> None:
        await shaper.acquire(5_000_000)
        done.append(vt.now)

    await vt.run(asyncio.gather(reader(), reader()))
    assert max(done) == pytest.approx((10_000_000 - burst) / rate, rel=1e-12)   # rate exact
    chunk_s = burst / rate
    # the burst is free; then one chunk crosses at a time, the two readers taking turns
    assert vt.sleeps[:4] == pytest.approx([chunk_s] * 4)
    assert min(done) > 0.75 * max(done)                            # interleaved, not one then the other


async def test_link_shaper_serves_the_lower_key_first_whoever_asked_first(monkeypatch):
    rate, burst, chunk = 20e6, 256 * 1024, 256 * 1024
    vt = virtual_link(monkeypatch)
    shaper = LinkShaper(rate, burst_bytes=burst, chunk_bytes=chunk, clock=vt.clock)
    done: dict[str, float] = {}

    async def reader(name: str, key: int, nbytes: int) -> None:
        await shaper.acquire(nbytes, key)
        done[name] = vt.now

    async def scenario() -> None:
        late = asyncio.create_task(reader("late", 2, 5_000_000))     # asks first, arrived later
        await asyncio.sleep(0)
        early = asyncio.create_task(reader("early", 1, 5_000_000))
        await asyncio.gather(late, early)

    await vt.run(scenario())
    # the late request had two chunks on the link before the early one asked (the free burst
    # and the one it waits for); from then on the early one's chunks cross, then the late rest
    assert done["early"] == pytest.approx((2 * chunk + 5_000_000 - burst) / rate, rel=1e-12)
    assert done["late"] == pytest.approx((10_000_000 - burst) / rate, rel=1e-12)   # rate exact
    assert shaper.bytes_charged == 10_000_000


async def test_link_shaper_cancelled_waiter_takes_no_bytes_and_blocks_nobody(monkeypatch):
    rate, chunk = 1e6, 100_000
    vt = virtual_link(monkeypatch)
    shaper = LinkShaper(rate, burst_bytes=chunk, chunk_bytes=chunk, clock=vt.clock)
    done: list[float] = []

    async def scenario() -> None:
        first = asyncio.create_task(shaper.acquire(3 * chunk, 1))
        await asyncio.sleep(0)
        doomed = asyncio.create_task(shaper.acquire(5 * chunk, 0))    # waits for the link
        await asyncio.sleep(0)
        doomed.cancel()
        await first
        done.append(vt.now)
        with pytest.raises(asyncio.CancelledError):
            await doomed
        await shaper.acquire(chunk, 2)                                # the link is free again
        done.append(vt.now)

    await vt.run(scenario())
    assert shaper.bytes_charged == 4 * chunk                          # the cancelled 5 never counted
    assert done == pytest.approx([2 * chunk / rate, 3 * chunk / rate], rel=1e-12)


def test_token_bucket_long_run_rate_is_exact_even_when_woken_late():
    for late in (0.0, 0.01):                       # on time, and every wake-up 10 ms late
        now = [0.0]
        bucket = TokenBucket(1000.0, 100, clock=lambda now=now: now[0])
        waits = []
        for _ in range(50):
            waits.append(bucket.reserve(40))
            now[0] += waits[-1]
            cleared = now[0]                       # when this chunk's debt is paid
            now[0] += late if waits[-1] else 0.0
        assert waits[:4] == pytest.approx([0.0, 0.0, 0.02, 0.04 - late])
        assert cleared == pytest.approx((50 * 40 - 100) / 1000.0)   # burst free, then exact rate


def test_token_bucket_accounts_debt_exactly():
    now = [0.0]
    bucket = TokenBucket(1000.0, 100, clock=lambda: now[0])
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(50) == pytest.approx(0.05)
    assert bucket.reserve(50) == pytest.approx(0.10)               # queued behind the first debt
    now[0] = 10.0
    assert bucket.balance == 100                                    # refill capped at burst
    assert LinkShaper(0).enabled is False


async def test_store_charges_reads_and_writes_to_the_link(tmp_path, monkeypatch):
    """A half-duplex link: the reads pay for the writes before them (one bucket)."""
    cfg = make_cfg(tmp_path, "memory", link_rate_bytes_per_s=8e6, link_burst_bytes=BB,
                   link_chunk_bytes=BB, link_duplex="half")
    keys = rand_keys(4)
    vt = virtual_link(monkeypatch)
    async with GatewayStore(cfg, SPEC) as store:
        await vt.run(store.write_blocks(keys, rand_blocks(4)))
        await vt.run(store.read_blocks(keys, empty_dests(4)))
        assert store.stats()["link_bytes_charged"] == 8 * BB
        assert vt.now == pytest.approx((7 * BB) / 8e6, rel=1e-12)   # one burst free, then the rate


@pytest.mark.parametrize("duplex", ["half", "full"])
async def test_a_full_duplex_link_carries_writes_beside_reads(tmp_path, monkeypatch, duplex):
    """8 blocks read while 8 others are written: a half-duplex link carries all 16 through one
    bucket; a full-duplex one (a real NIC's two directions) carries each side at the rate, so
    the two end together in half the time and the writes are counted apart."""
    rate = 8e6
    cfg = make_cfg(tmp_path, "memory", link_rate_bytes_per_s=rate, link_burst_bytes=BB,
                   link_chunk_bytes=BB, link_duplex=duplex)
    stored, new = rand_keys(8), rand_keys(8, seed=1)
    vt = virtual_link(monkeypatch)
    async with GatewayStore(cfg, SPEC) as store:
        await vt.run(store.write_blocks(stored, rand_blocks(8)))
        vt.now = 1000.0                       # the writes' debt is long paid: full bursts again

        async def both() -> None:
            res, _ = await asyncio.gather(store.read_blocks(stored, empty_dests(8)),
                                          store.write_blocks(new, rand_blocks(8)))
            assert all(res.found)

        await vt.run(both())
        stats = store.stats()
    assert stats["link_bytes_charged"] == 24 * BB
    crossing = 15 * BB if duplex == "half" else 7 * BB       # one burst free, then the rate
    assert vt.now - 1000.0 == pytest.approx(crossing / rate, rel=1e-9)
    if duplex == "full":
        assert stats["link_write_bytes_charged"] == 16 * BB and stats["link_write_waits"] > 0
    else:
        assert "link_write_bytes_charged" not in stats


_READER: contextvars.ContextVar[str] = contextvars.ContextVar("reader")


@pytest.mark.parametrize("read_order", ["arrival", "shared"])
async def test_store_read_order_on_a_shaped_link(tmp_path, monkeypatch, read_order):
    """Two reads of 8 blocks admitted together, each as two 4-chunk jobs: ``arrival`` puts the
    first one's chunks on the link before any of the second's; ``shared`` interleaves them."""
    rate = 8e6
    cfg = make_cfg(tmp_path, "memory", link_rate_bytes_per_s=rate, link_burst_bytes=BB,
                   link_chunk_bytes=BB, read_batch_bytes=4 * BB, read_order=read_order)
    keys = rand_keys(16)
    vt = virtual_link(monkeypatch)
    async with GatewayStore(cfg, SPEC) as store:
        await vt.run(store.write_blocks(keys, rand_blocks(16)))
        vt.now = 1000.0                       # the writes' debt is long paid: a full burst again
        crossed: list[str] = []               # whose chunk took the link, in order
        bucket = store.shaper._bucket
        reserve = bucket.reserve
        monkeypatch.setattr(bucket, "reserve", lambda n: (crossed.append(_READER.get()), reserve(n))[1])

        async def read(name: str, ks: list[str]) -> None:
            _READER.set(name)                 # the store's read jobs run in copies of this context
            res = await store.read_blocks(ks, empty_dests(len(ks)), request_id=name)
            assert all(res.found)

        async def both() -> None:
            first = asyncio.create_task(read("first", keys[:8]))
            second = asyncio.create_task(read("second", keys[8:]))
            await asyncio.gather(first, second)

        await vt.run(both())
    assert sorted(crossed) == ["first"] * 8 + ["second"] * 8
    assert vt.now - 1000.0 == pytest.approx(15 * BB / rate, rel=1e-9)   # one burst free, then the rate
    if read_order == "arrival":
        assert crossed == ["first"] * 8 + ["second"] * 8
    else:
        assert "second" in crossed[:8] and "first" in crossed[8:]


async def test_priority_gate_order_cancellation_and_turns():
    gate = PriorityGate(1)
    order: list[str] = []

    async def take(name: str, key: int) -> None:
        async with gate.slot(key):
            order.append(name)
            await asyncio.sleep(0)

    await gate.acquire(0)                                  # held: everyone below waits
    tasks = [asyncio.create_task(take(n, k)) for n, k in (("c", 3), ("a1", 1), ("b", 2), ("a2", 1))]
    doomed = asyncio.create_task(take("doomed", 0))
    await until(lambda: gate.n_waiting == 5)
    doomed.cancel()                                        # cancelled while waiting: no slot kept
    await until(lambda: gate.n_waiting == 4)
    gate.release()
    await asyncio.gather(*tasks)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert order == ["a1", "a2", "b", "c"]                 # lowest key first, ties as they asked
    assert gate.held == 0

    # granted, then cancelled before it ran: the slot is given back, not lost
    await gate.acquire(5)
    granted = asyncio.create_task(gate.acquire(5))
    await until(lambda: gate.n_waiting == 1)
    gate.release()                                         # hands the slot to `granted` ...
    granted.cancel()                                       # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await granted
    assert gate.held == 0 and gate.n_waiting == 0

    # a holder yields between pieces of work to an earlier or equal key, not to a later one
    async with gate.slot(1) as turn:
        later = asyncio.create_task(take("later", 2))
        same = asyncio.create_task(take("same", 1))
        await until(lambda: gate.n_waiting == 2)
        order.clear()
        await turn.yield_to_earlier()                      # "same" (key 1) goes first
        assert order == ["same"] and turn.held
        await turn.yield_to_earlier()                      # "later" (key 2) does not
        assert order == ["same"]
    await asyncio.gather(later, same)
    assert order == ["same", "later"] and gate.held == 0
