"""Staging is granted to packed receives in FIFO order across transfers (no staging deadlock).

The deadlock this guards against: a requester posts the receives of many transfers from one
sender at once; the sender sends them in order with a bounded pipeline (the gateway's
``pipeline_depth``); staging holds only a few packed messages. If freed staging goes to a
*later* transfer, the next transfer the sender sends has no receive posted, its rendezvous
sends wait for one, the pipeline fills with them, and the later transfers that hold the
staging are never sent: stuck until the deadline. Real UCX on loopback, one process.
"""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from common.config import TransportConfig
from common.errors import ConfigError
from common.transport import PageTransport
from common.transport.staging import StagingQueue, staged_bytes
from tests.transport_peer import gather, pattern

KIB, MIB = 1024, 1024 * 1024
LAYER_BLOCK = 41_984            # DeepSeek-V3.2: 64 tokens x 656 B
PIECES = 24                     # one packed message of 24 x 41,984 B = 984 KiB per transfer
PACKED = PIECES * LAYER_BLOCK


def gapped(count: int, size: int, base: int = 0, gap: int = 4096) -> list[tuple[int, int]]:
    return [(base + i * (size + gap), size) for i in range(count)]


def transfer_slots(k: int) -> list[tuple[int, int]]:
    """Transfer ``k``'s slots: non-contiguous, so one packed message each; disjoint per k."""
    return gapped(PIECES, LAYER_BLOCK, base=k * PIECES * (LAYER_BLOCK + 4096))


async def send_pipelined(b: PageTransport, to, tids: list[int], data: list[np.ndarray],
                         depth: int) -> None:
    """Send in order, at most ``depth`` in flight: send k+depth starts when send k is done."""
    window: collections.deque[asyncio.Task] = collections.deque()
    try:
        for k, tid in enumerate(tids):
            if len(window) == depth:
                await window.popleft()
            window.append(asyncio.create_task(
                b.send(to, tid, [data[k]], transfer_slots(k), 30.0)))
        for task in window:
            await task
    finally:
        for task in window:
            task.cancel()
        await asyncio.gather(*window, return_exceptions=True)


@pytest.mark.parametrize("depth", [2, 3])
async def test_many_packed_transfers_through_small_staging_do_not_deadlock(depth):
    n = 14
    small = TransportConfig(staging_bytes=4 * MIB, max_message_bytes=MIB)  # 4 packed messages
    async with (PageTransport(small, "a") as a,
                PageTransport(TransportConfig(staging_bytes=32 * MIB, max_message_bytes=MIB), "b") as b):
        arena = np.zeros((n + 1) * PIECES * (LAYER_BLOCK + 4096), np.uint8)
        data = [pattern(100 + k, PACKED) for k in range(n)]
        tids = [a.new_transfer_id() for _ in range(n)]
        handles = [await a.expect(b.address, tid, arena, transfer_slots(k), 30.0)
                   for k, tid in enumerate(tids)]
        # the receiver's loops race for freed staging: the later ones must not win it
        await asyncio.wait_for(send_pipelined(b, a.address, tids, data, depth), 20.0)
        for h in handles:
            await asyncio.wait_for(h.wait(), 10.0)
        for k in range(n):
            assert np.array_equal(gather(arena, transfer_slots(k)), data[k])
        stats = a.stats()
        assert stats["packed_messages"] == n and stats["staging_in_use_bytes"] == 0
        assert stats["staging_peak_bytes"] <= 4 * MIB and stats["transfers_received_ok"] == n


async def test_a_cancelled_transfer_gives_up_its_place_in_the_staging_queue():
    """A holds the only staging; B (another peer) and then C wait. B is cancelled: C moves up,
    gets the staging A frees and completes (B left in the queue would block it for good)."""
    one = TransportConfig(staging_bytes=MIB, max_message_bytes=MIB)  # one packed message
    async with (PageTransport(one, "a") as a, PageTransport(one, "b") as b,
                PageTransport(one, "c") as c):
        arena = np.zeros(4 * PIECES * (LAYER_BLOCK + 4096), np.uint8)
        data = [pattern(200 + k, PACKED) for k in range(3)]
        tids = [a.new_transfer_id() for _ in range(3)]
        senders = [b, c, b]
        handles = [await a.expect(s.address, tid, arena, transfer_slots(k), 20.0)
                   for k, (s, tid) in enumerate(zip(senders, tids))]
        assert [len(a.transfers._receiving[t].deferred) for t in tids] == [0, 1, 1]
        await handles[1].cancel()
        assert tids[1] not in a.transfers._receiving and len(a.transfers._staging_queue) == 1
        await b.send(a.address, tids[0], [data[0]], transfer_slots(0), 10.0)
        await asyncio.wait_for(handles[0].wait(), 10.0)
        await b.send(a.address, tids[2], [data[2]], transfer_slots(2), 10.0)
        await asyncio.wait_for(handles[2].wait(), 10.0)
        for k in (0, 2):
            assert np.array_equal(gather(arena, transfer_slots(k)), data[k])
        assert a.stats()["staging_in_use_bytes"] == 0 and len(a.transfers._staging_queue) == 0


def test_staging_that_cannot_hold_an_aligned_message_is_refused_at_construction():
    """A packed message of max_message_bytes takes it rounded up to the staging alignment:
    staging below that could never post one, so the transport refuses the config at once."""
    with pytest.raises(ConfigError, match="staging_bytes"):
        PageTransport(TransportConfig(staging_bytes=MIB + 100, max_message_bytes=MIB + 100), "x")
    PageTransport(TransportConfig(staging_bytes=MIB + 4096, max_message_bytes=MIB + 100), "x")


# ---------------------------------------------------------------- the queue alone (pure)

class Pool:
    """A stand-in staging pool: ``post`` takes ``size`` units if that many are free."""

    def __init__(self, free: int) -> None:
        self.free, self.posted = free, []

    def post(self, owner: str, msg: tuple[str, int]) -> bool:
        if msg[1] > self.free:
            return False
        self.free -= msg[1]
        self.posted.append(msg[0])
        return True


def queued(q: StagingQueue, owners: dict[str, list[tuple[str, int]]]) -> dict:
    waiting = {o: collections.deque() for o in owners}
    for o, msgs in owners.items():
        for m in msgs:
            q.defer(o, waiting[o], m)
    return waiting


def test_queue_grants_staging_first_come_first_served_and_strictly():
    q: StagingQueue = StagingQueue()
    waiting = queued(q, {"t1": [("t1.0", 2), ("t1.1", 3)], "t2": [("t2.0", 1)],
                         "t3": [("t3.0", 1)]})
    pool = Pool(4)
    assert q.drain(pool.post) == 1 and pool.posted == ["t1.0"]
    # t1.1 (3) does not fit in 2: t2.0 (1) would, but must not take staging t1.1 waits for
    assert pool.free == 2 and len(q) == 3 and "t1" in q
    pool.free += 2
    assert q.drain(pool.post) == 2 and pool.posted == ["t1.0", "t1.1", "t2.0"]
    assert "t1" not in q and "t2" not in q and list(waiting["t3"]) == [("t3.0", 1)]
    q.defer("t4", collections.deque(), ("t4.0", 1))        # joins behind t3
    pool.free += 5
    assert q.drain(pool.post) == 2 and pool.posted[-2:] == ["t3.0", "t4.0"] and len(q) == 0


def test_a_removed_transfer_frees_its_place_for_the_next():
    q: StagingQueue = StagingQueue()
    waiting = queued(q, {"t1": [("t1.0", 3)], "t2": [("t2.0", 2)], "t3": [("t3.0", 2)]})
    pool = Pool(2)
    assert q.drain(pool.post) == 0                          # the head does not fit
    q.remove("t1")                                          # cancelled: its messages stay its own
    assert list(waiting["t1"]) == [("t1.0", 3)] and "t1" not in q
    assert q.drain(pool.post) == 1 and pool.posted == ["t2.0"]
    q.remove("t3")
    q.remove("t3")                                          # idempotent
    pool.free += 2
    assert q.drain(pool.post) == 0 and len(q) == 0


def test_a_post_failure_belongs_to_its_transfer_and_the_others_go_on():
    q: StagingQueue = StagingQueue()
    queued(q, {"t1": [("t1.0", 1), ("t1.1", 1)], "t2": [("t2.0", 1)]})
    pool = Pool(10)

    def post(owner: str, msg: tuple[str, int]) -> bool:
        if msg[0] == "t1.1":
            raise RuntimeError("endpoint closed")
        return pool.post(owner, msg)

    assert q.drain(post) == 2 and pool.posted == ["t1.0", "t2.0"] and len(q) == 0
    err = q.failure("t1")
    assert isinstance(err, RuntimeError) and q.failure("t1") is None and q.failure("t2") is None


def test_staged_bytes_rounds_to_the_alignment():
    assert [staged_bytes(n) for n in (0, 1, 4096, 4097)] == [4096, 4096, 4096, 8192]
    assert staged_bytes(PACKED) <= MIB
