"""The one-copy same-host path (``common.transport.shm_transfers``, docs/datapath.md "Same
host: one copy"): byte-exact transfers into a ``/dev/shm`` arena, which path a link and a
transfer take, the COMMIT checks, and peers killed mid-copy (real child processes).

Nothing here asserts a speed (``dualpath bench kvpath`` measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import threading

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.buffers import PagePool
from common.config import TransportConfig
from common.errors import DeadlineExceeded, PeerFailed, Unavailable
from common.transport import PageTransport, shm_transfers
from common.transport.plan import (HELLO_BYTES, TransferHello, decode_hello, encode_hello,
                                   shm_link)
from common.transport.shm_path import (COMMIT, Control, Fence, copy_stream, slots_digest,
                                       stream_pieces, stream_runs)
from tests.helpers import until
from tests.peer_proc import PeerProc, gapped
from tests.transport_peer import gather, pattern, split_views

KIB, MIB = 1024, 1024 * 1024
LAYER_BLOCK = 41_984
CFG = {"staging_bytes": 32 * MIB}
PAGE = 64 * KIB


@pytest.fixture
def pools():
    made = [PagePool(PAGE, 256, shm=True, name=f"p{i}") for i in range(2)]
    assert all(p.shm is not None for p in made), "no /dev/shm here"
    try:
        yield made
    finally:
        for p in made:
            assert p.counters()[f"{p.name}_allocations_live"] == 0, "pages leaked"
            p.close()


@contextlib.asynccontextmanager
async def shm_pair(pools, cfg_a: dict | None = None):
    a = PageTransport(TransportConfig(**{**CFG, **(cfg_a or {})}), "a", shm_arena=pools[0].arena)
    b = PageTransport(TransportConfig(**CFG), "b", shm_arena=pools[1].arena)
    async with a, b:
        yield a, b


async def move(rx: PageTransport, tx: PageTransport, arena: np.ndarray, slots, seed: int,
               split: int = 1, deadline_s: float = 30.0) -> None:
    data = pattern(seed, sum(n for _, n in slots))
    tid = rx.new_transfer_id()
    handle = await rx.expect(tx.address, tid, arena, slots, deadline_s)
    await tx.send(rx.address, tid, split_views(data, split), slots, deadline_s)
    await handle.wait()
    assert np.array_equal(gather(arena, slots), data)


# ---------------------------------------------------------------- pure parts

def test_fence_excludes_a_copy_and_a_give_up_across_open_files(tmp_path):
    """Two opens of one file (two transports, even in one process) exclude each other."""
    path = tmp_path / "seg"
    path.write_bytes(b"\0" * 4096)
    sender, receiver = (Fence(os.open(path, os.O_RDWR)) for _ in range(2))
    try:
        tid = (1 << 43) + 5                   # far beyond the end of the file
        assert sender.try_share(tid)          # copying
        assert not receiver.try_exclusive(tid)
        sender.release(tid)
        assert receiver.try_exclusive(tid)    # given up: no copy may start now
        assert not sender.try_share(tid)
        assert sender.try_share(tid + 1)      # other transfers are not affected
        sender.close()                        # a closed (dead) sender holds nothing
        assert receiver.try_exclusive(tid + 1)
    finally:
        sender.close()
        receiver.close()


def test_copy_stream_places_pieces_and_stops_between_them():
    src = pattern(1, 10_000)
    views = split_views(src, 4)
    slots = [(9000, 3000), (0, 5000), (20_000, 2000)]
    dst = np.zeros(30_000, np.uint8)
    pieces = copy_stream(views, dst, slots, threading.Event())
    assert np.array_equal(gather(dst, slots), src) and pieces >= 3
    stop = threading.Event()
    stop.set()
    assert copy_stream(views, np.zeros(30_000, np.uint8), slots, stop) == 0
    assert slots_digest(slots) == slots_digest([*slots[:1], (5, 0), *slots[1:]])
    assert slots_digest(slots) != slots_digest(slots[::-1])


def test_equal_evenly_spaced_pieces_are_one_strided_copy_byte_exact():
    """Runs (shm_path.stream_runs): pieces of one view, one size, a constant stride — any
    stride, including none (contiguous slots) — are one copy; a change of size, stride or
    view starts a new run; every byte lands where the piece-by-piece copy puts it, also when
    shares cut runs in the middle of a piece."""
    src = pattern(3, 64 * 4096 + 3 * 1000) | 1
    views = [src[:40 * 4096], src[40 * 4096:64 * 4096], src[64 * 4096:]]
    slots = ([(i * 5000, 4096) for i in range(40)]                  # stride 5000
             + [(300_000 + i * 4096, 4096) for i in range(24)]      # contiguous (2nd view)
             + [(500_000, 1000), (503_000, 1000), (507_000, 1000)])  # stride changes
    runs = list(stream_runs(views, slots))
    assert [(r.rows, r.n, r.stride) for r in runs] == [
        (40, 4096, 5000), (24, 4096, 4096), (2, 1000, 3000), (1, 1000, 1000)]
    want = np.zeros(520_000, np.uint8)
    for (off, n), piece in zip(slots, np.split(src, np.cumsum([n for _, n in slots])[:-1])):
        want[off:off + n] = piece
    dst = np.zeros(520_000, np.uint8)
    assert copy_stream(views, dst, slots, threading.Event()) == len(runs)
    assert np.array_equal(dst, want)
    for shares in (2, 3, 7):
        dst = np.zeros(520_000, np.uint8)
        written = np.zeros(520_000, np.int64)
        for share in range(shares):
            mine = np.zeros(520_000, np.uint8)
            copy_stream(views, mine, slots, threading.Event(), share, shares)
            dst += mine
            written += mine != 0
        assert np.array_equal(dst, want) and written.max() == 1


@settings(max_examples=300, deadline=None)
@given(slots=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 400), max_size=6), shares=st.integers(1, 4),
       scale=st.sampled_from([1, 8]))
def test_runs_copy_exactly_what_the_pieces_say(slots, cuts, shares, scale):
    """Any slot list (gaps, contiguous neighbours, backwards jumps, empty slots) and any cut
    of the source into views: the run copy writes exactly the bytes the piece-by-piece
    stream says, in every share split, and never outside them."""
    layout, pos = [], 0
    for k, (jump, n) in enumerate(slots):             # non-overlapping, any order
        start = (k * 97 + jump * 13) % 40 * 64 * scale if jump % 3 == 0 else pos + jump
        layout.append((start, n * scale))
        pos = max(pos, start + n * scale) + 1
    seen, fixed = np.zeros(8000 * scale, bool), []    # drop overlaps (slots never overlap)
    for off, n in layout:
        if not seen[off:off + n].any():
            seen[off:off + n] = True
            fixed.append((off, n))
    total = sum(n for _, n in fixed)
    src = pattern(5, total) | 1
    edges = sorted({c % (total + 1) for c in cuts} | {0, total})
    views = [src[a:b] for a, b in zip(edges, edges[1:])] or [src]
    want = np.zeros(8000 * scale + 64, np.uint8)
    for part, at in stream_pieces(views, fixed):
        want[at:at + part.nbytes] = part
    got = np.zeros_like(want)
    written = np.zeros(want.shape, np.int64)
    for share in range(shares):
        mine = np.zeros_like(want)
        copy_stream(views, mine, fixed, threading.Event(), share, shares)
        got += mine
        written += mine != 0
    assert np.array_equal(got, want) and written.max(initial=0) <= 1


def test_copy_stream_in_shares_writes_every_byte_once_and_only_its_share():
    """A large transfer copied by several threads: each share writes exactly its contiguous
    byte range of the stream (pieces cut where a share ends), together every byte lands where
    the one-thread copy puts it."""
    src = pattern(2, 100_000) | 1                 # no zero byte: a written byte shows
    views = split_views(src, 3)
    slots = [(50_000, 30_000), (0, 45_000), (90_000, 25_000)]
    whole = np.zeros(120_000, np.uint8)
    copy_stream(views, whole, slots, threading.Event())
    for shares in (2, 3, 7):
        dst = np.zeros(120_000, np.uint8)
        written = np.zeros(120_000, np.int64)
        for share in range(shares):
            mine = np.zeros(120_000, np.uint8)
            assert copy_stream(views, mine, slots, threading.Event(), share, shares) >= 1
            got = gather(mine, slots)
            lo, hi = 100_000 * share // shares, 100_000 * (share + 1) // shares
            assert np.array_equal(got[lo:hi], src[lo:hi])      # its range, byte-exact
            assert not got[:lo].any() and not got[hi:].any()   # nothing outside it
            dst += mine
            written += mine != 0
        assert np.array_equal(dst, whole)
        assert (gather(written, slots) == 1).all() and written.sum() == 100_000
    stop = threading.Event()
    stop.set()
    assert copy_stream(views, np.zeros(120_000, np.uint8), slots, stop, 1, 2) == 0


# ---------------------------------------------------------------- in one process

async def test_shm_transfers_are_byte_exact_in_one_copy(pools):
    async with shm_pair(pools) as (a, b):
        arena = pools[0].arena
        cases = [([(0, 3 * MIB)], 1), (gapped(200, LAYER_BLOCK), 1), (gapped(6, MIB // 2), 5)]
        for i, (slots, split) in enumerate(cases):
            await move(a, b, arena, slots, seed=i, split=split)
        sa, sb = a.stats(), b.stats()
        assert sa["shm_transfers_received"] == 3 == sb["shm_transfers_sent"]
        assert sa["shm_links"] == 1 == sb["shm_links"]
        (path,) = a.links.paths()
        assert (path["send"], path["receive"], path["node_id"]) == ("shm", "shm", "b")
        # no UCX message carried a page, nothing was packed, gathered or staged
        assert sa["messages_received"] == 0 and sa["packed_messages"] == 0
        assert sa["staging_peak_bytes"] == 0 and sb["gathered_bytes"] == 0
        # one copy per run of equal, evenly spaced pieces of one source view: the 200 gapped
        # layer blocks of one view are one strided copy (two: a share edge may cut one),
        # not 200 (shm_path.stream_runs)
        assert 3 <= sb["shm_pieces_copied"] < 1 + 200 + 6, sb["shm_pieces_copied"]
        assert sa["transfers_received_ok"] == 3 and sa["bytes_received"] == sb["shm_bytes_sent"]


async def test_split_copies_are_byte_exact_planned_here_or_in_a_thread(pools):
    """A transfer of 4 MiB or more is copied by two threads walking one plan of runs, made on
    the loop for up to ``_PLAN_HERE_SLOTS`` slots and in a copy thread beyond: both byte-exact
    (gapped 4 KiB and 2 KiB pages, one source view and several)."""
    assert shm_transfers._SPLIT_FROM_BYTES <= 4 * MIB
    here = shm_transfers._PLAN_HERE_SLOTS
    async with shm_pair(pools) as (a, b):
        arena = pools[0].arena
        for seed, (count, size, split) in enumerate([(here, 4 * KIB, 1), (2 * here, 2 * KIB, 1),
                                                     (2 * here, 2 * KIB, 7)]):
            slots = gapped(count, size)
            assert count * size >= shm_transfers._SPLIT_FROM_BYTES
            await move(a, b, arena, slots, seed=40 + seed, split=split)
        assert b.stats()["shm_transfers_sent"] == 3 and a.stats()["messages_received"] == 0


async def test_many_transfers_in_flight_both_ways(pools):
    async with shm_pair(pools) as (a, b):
        allocs, jobs = [], []
        for i in range(24):
            rx, tx, pool = (a, b, pools[0]) if i % 2 else (b, a, pools[1])
            alloc = pool.alloc(3 * PAGE + 1000 * i, f"t{i}")
            slots = alloc.slots()[::-1] if i % 3 == 0 else alloc.slots()
            allocs.append(alloc)
            data = pattern(100 + i, sum(n for _, n in slots))
            tid = rx.new_transfer_id()
            handle = await rx.expect(tx.address, tid, pool.arena, slots, 20.0)
            jobs.append((rx, tx, tid, pool, slots, data, handle))
        await asyncio.gather(*(tx.send(rx.address, tid, split_views(data, 3), slots, 20.0)
                               for rx, tx, tid, _, slots, data, _ in jobs))
        for _, _, _, pool, slots, data, handle in jobs:
            await handle.wait()
            assert np.array_equal(gather(pool.arena, slots), data)
        assert a.stats()["shm_transfers_received"] + b.stats()["shm_transfers_received"] == 24
        for alloc in allocs:
            alloc.free()


async def test_private_arena_takes_the_tag_path(pools):
    async with shm_pair(pools) as (a, b):
        arena = np.zeros(4 * MIB, np.uint8)
        await move(a, b, arena, gapped(10, 100 * KIB), seed=5)
        sa = a.stats()
        assert sa["shm_transfers_tag_fallback"] == 1 and sa["shm_transfers_received"] == 0
        assert sa["messages_received"] >= 1


async def test_a_peer_without_shm_takes_the_tag_path(pools):
    async with shm_pair(pools, {"same_host": "ucx"}) as (a, b):
        await move(a, b, pools[0].arena, [(0, 2 * MIB)], seed=6)   # a's arena is shm, yet
        await move(b, a, pools[1].arena, [(0, 2 * MIB)], seed=7)
        for t in (a, b):
            s = t.stats()
            assert s["shm_links"] == 0 and s["shm_transfers_received"] == 0
            assert s["shm_transfers_sent"] == 0 and s["messages_received"] >= 1


def test_an_old_hello_decodes_without_shm():
    class OldHello(msgspec.Struct, array_like=True, frozen=True):  # before the shm fields
        version: int
        node_id: str
        host: str
        port: int
        max_message_bytes: int
        pack_below_bytes: int
        worker_address: bytes = b""
        host_id: str = ""
        process: str = ""

    body = msgspec.msgpack.encode(OldHello(1, "old", "h", 1, 2, 3, b"", "host", "1:2"))
    frame = np.zeros(HELLO_BYTES, np.uint8)
    frame[:2] = np.frombuffer(len(body).to_bytes(2, "little"), np.uint8)
    frame[2:2 + len(body)] = np.frombuffer(body, np.uint8)
    old = decode_hello(frame)
    assert (old.shm, old.shm_segment, old.shm_nonce) == (False, "", 0)
    new = TransferHello(1, "new", "h", 2, 2, 3, b"", "host", "1:3", True, "dualpath-x", 8, 9)
    assert not shm_link(new, old) and not shm_link(old, new)
    assert shm_link(new, msgspec.structs.replace(new, shm_segment=""))
    assert decode_hello(encode_hello(new)) == new
    assert not shm_link(new, msgspec.structs.replace(new, host_id="other"))


async def test_commit_for_unknown_or_given_up_transfer_is_dropped(pools):
    async with shm_pair(pools) as (a, b):
        arena = pools[0].arena
        await move(a, b, arena, [(0, PAGE)], seed=1)
        link = await b.links.link_to(a.address, asyncio.get_running_loop().time() + 5)
        shm = b.transfers._shm
        stray = Control(COMMIT, a.new_transfer_id(), shm.nonce, PAGE, 0)
        shm._send_control(link, stray)        # a transfer a never posted
        await until(lambda: a.stats()["shm_commits_dropped"] == 1, 5.0, "stray commit dropped")

        slots, tid = [(PAGE, PAGE)], a.new_transfer_id()
        arena[PAGE:2 * PAGE] = 0
        handle = await a.expect(b.address, tid, arena, slots, 10.0)
        await handle.cancel()                 # given up: the fence is a's now
        assert a.stats()["shm_fences"] == 1 and a.stats()["shm_fences_held"] == 1
        with pytest.raises(PeerFailed, match="gave it up"):
            await b.send(a.address, tid, [pattern(2, PAGE)], slots, 5.0)
        assert not arena[PAGE:2 * PAGE].any(), "a sender wrote into given-up slots"
        assert b.stats()["shm_sends_refused"] == 1
        shm._send_control(link, Control(COMMIT, tid, shm.nonce, PAGE, 0))
        await until(lambda: a.stats()["shm_commits_dropped"] == 2, 5.0, "late commit dropped")

        tid = a.new_transfer_id()             # a receiver's deadline: typed, fenced
        handle = await a.expect(b.address, tid, arena, slots, 0.2)
        with pytest.raises(DeadlineExceeded):
            await handle.wait()
        assert a.stats()["shm_fences"] == 2
        await move(a, b, arena, [(3 * PAGE, PAGE)], seed=3)    # the link lived through it all
        assert a.stats()["endpoint_aborts"] == 0 == b.stats()["endpoint_aborts"]


# ---------------------------------------------------------------- real child processes

async def test_sender_killed_mid_copy_leaves_the_survivor_serving(pools):
    """The sender pauses between slots; killed after its first slot landed, the receiver's
    transfer fails typed, its fence comes free (the kernel dropped the dead sender's lock),
    its pages go back, and it receives the next transfer from another peer."""
    pool = pools[0]
    async with PageTransport(TransportConfig(**CFG), "survivor", shm_arena=pool.arena) as t:
        peer = PeerProc({**CFG, "slow_copy_s": 0.05})
        try:
            alloc = pool.alloc(64 * PAGE, "doomed")
            slots = [(off, n) for off, n in alloc.slots()]
            slots = [(slots[0][0] + i * PAGE, PAGE) for i in range(64)]
            pool.arena[slots[0][0]:slots[0][0] + PAGE] = 0
            tid = t.new_transfer_id()
            # deadlines far beyond the test's needs (stop 36's CI: a load episode slowed every
            # test; tight ones failed): a dead peer must show as PeerFailed, never as the
            # deadline's DeadlineExceeded, so no duration is asserted
            handle = await t.expect(peer.address, tid, pool.arena, slots, 120.0)
            peer.call("send", peer=list(t.address), tid=tid, slots=slots, seed=9, deadline=120.0)
            first = pool.arena[slots[0][0]:slots[0][0] + PAGE]
            await until(lambda: first.any(), 60.0, "the sender's copy started")
            os.kill(peer.pid, signal.SIGKILL)
            with pytest.raises(PeerFailed):  # the link's endpoint saw it die (not the deadline)
                await handle.wait()
            assert t.stats()["shm_fences"] == 1 and t.stats()["shm_fences_not_settled"] == 0
            alloc.free()
        finally:
            peer.kill()
        other = PeerProc(CFG)
        try:
            alloc = pool.alloc(5 * PAGE, "next")
            slots = alloc.slots()
            tid = t.new_transfer_id()
            handle = await t.expect(other.address, tid, pool.arena, slots, 60.0)
            reply = await other.request("send", peer=list(t.address), tid=tid, slots=slots,
                                        seed=10, deadline=60.0)
            assert reply["ok"], reply
            await handle.wait()
            assert np.array_equal(gather(pool.arena, slots), pattern(10, 5 * PAGE))
            alloc.free()
        finally:
            other.close()
        assert t.stats()["shm_transfers_received"] == 1


async def test_receiver_giving_up_mid_copy_stops_the_sender(pools):
    """A receive cancelled while the (slowed) sender copies: the cancel returns only once the
    copy stopped (the fence), no slot after that is written, and the sender fails typed."""
    pool = pools[0]
    async with PageTransport(TransportConfig(**CFG), "receiver", shm_arena=pool.arena) as t:
        peer = PeerProc({**CFG, "slow_copy_s": 0.05})
        try:
            alloc = pool.alloc(64 * PAGE, "cancelled")
            base = alloc.slots()[0][0]
            slots = [(base + i * PAGE, PAGE) for i in range(64)]
            pool.arena[base:base + 64 * PAGE] = 0
            tid = t.new_transfer_id()
            handle = await t.expect(peer.address, tid, pool.arena, slots, 30.0)
            sent = peer.call("send", peer=list(t.address), tid=tid, slots=slots, seed=11,
                             deadline=30.0)
            first = pool.arena[base:base + PAGE]
            await until(lambda: first.any(), 60.0, "the sender's copy started")
            await handle.cancel()
            assert t.stats()["shm_fences"] == 1 and t.stats()["shm_fences_not_settled"] == 0
            after = pool.arena[base:base + 64 * PAGE].copy()
            reply = await peer.reply(sent, "done")
            assert not reply["ok"] and reply["error"] == "PeerFailed", reply
            assert np.array_equal(pool.arena[base:base + 64 * PAGE], after), \
                "the sender wrote after the receiver's cancel returned"
            assert not pool.arena[base + 63 * PAGE:base + 64 * PAGE].any()
            alloc.free()
        finally:
            peer.close()


async def test_receiver_killed_fails_the_send_typed(pools):
    """A receiver that dies after posting: the survivor's send fails typed, the dead peer's
    segment is unmapped, and the survivor sends to the next peer."""
    async with PageTransport(TransportConfig(**CFG), "survivor", shm_arena=pools[0].arena) as t:
        peer = PeerProc({**CFG, "shm_arena_bytes": 8 * MIB})
        try:
            slots = [(0, MIB), (2 * MIB, MIB)]
            reply = await peer.request("new_id")
            posted = peer.call("expect", peer=list(t.address), tid=reply["tid"],
                               arena_bytes=4 * MIB, slots=slots, deadline=30.0)
            await peer.reply(posted, "posted")
            assert t.stats()["shm_segments_mapped"] == 1
            os.kill(peer.pid, signal.SIGKILL)
            await until(lambda: t.stats()["shm_segments_mapped"] == 0, 20.0,
                        "the dead peer's segment unmapped")
            with pytest.raises((PeerFailed, Unavailable)):  # (the reconnect is refused)
                await t.send(peer.address, reply["tid"], [pattern(3, 2 * MIB)], slots, 5.0)
        finally:
            peer.kill()
        other = PeerProc({**CFG, "shm_arena_bytes": 8 * MIB})
        try:
            slots = gapped(5, 300 * KIB)
            tid = (await other.request("new_id"))["tid"]
            futs = other.call("expect", peer=list(t.address), tid=tid, arena_bytes=4 * MIB,
                              slots=slots, deadline=20.0)
            await other.reply(futs, "posted")
            data = pattern(4, sum(n for _, n in slots))
            await t.send(other.address, tid, [data], slots, 20.0)
            done = await other.reply(futs, "done")
            assert done["ok"], done
            assert done["digest"] == hashlib.sha256(data.tobytes()).hexdigest()
            assert t.stats()["shm_transfers_sent"] == 1
        finally:
            other.close()


# ---------------------------------------------------------------- write-backs

async def test_write_back_to_a_same_host_gateway_is_one_copy(tmp_path):
    """A node's write goes straight into the gateway's /dev/shm staging (no UCX message, no
    gather), and what it stored reads back byte for byte."""
    from storage_gateway.client import GatewayClient, block_slots
    from storage_gateway.service import GatewayService
    from tests.test_gateway_service import BB, SPEC, TCFG, blocks, chain, node_cfg

    cfg = node_cfg(tmp_path)
    async with GatewayService(cfg, "gw0", spec=SPEC) as gw, PageTransport(TCFG, "req") as tr:
        arena = np.zeros(8 * MIB, np.uint8)
        client = GatewayClient.connect(cfg.rpc, "127.0.0.1", gw.rpc_port, tr, arena, SPEC,
                                       node_id="req")
        try:
            keys, data = chain(6), blocks(6)
            parts = [[b[:BB // 3], b[BB // 3:]] for b in data]   # a block from two slices
            done = await client.write_blocks("w1", keys, parts, 10.0)
            assert done.written == 6
            stats = gw.counters()
            assert stats["transport_shm_bytes_received"] == 6 * BB
            assert stats["transport_messages_received"] == 0
            assert tr.stats()["gathered_bytes"] == 0 and tr.stats()["shm_transfers_sent"] == 1
            reply = await client.read_blocks("r1", keys, block_slots(0, BB, 6), 10.0)
            assert reply.found == [True] * 6
            for i in range(6):
                assert np.array_equal(arena[i * BB:(i + 1) * BB], data[i])
        finally:
            await client.close()
        assert gw.staging.pool.used_pages == 0, "staging leaked"
