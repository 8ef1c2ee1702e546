"""UCX page transport over real UCX on loopback (the pure planning tests are in
``tests/test_transport_plan.py``, connecting and the handshake in
``tests/test_transport_connect.py``).

Multi-process tests drive ``tests/transport_peer.py`` (a PageTransport in a subprocess) over
JSON lines; every process started here is stopped (or SIGKILLed) by the end of its test.
Nothing here asserts a speed: the idle test checks a resource (CPU of an idle transport).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import time
import weakref

import numpy as np
import pytest

from common.config import TrafficClassConfig, TransportConfig
from common.errors import (Cancelled, DeadlineExceeded, InvalidArgument, PeerFailed,
                           ProtocolError, Unavailable)
from common.transport import PageTransport
from tools.cluster.launcher import proc_cpu_seconds
from tests.helpers import apoll, closed_port, holders, until
from tests.peer_proc import OpEndedUnposted, PeerProc, arena_for, gapped
from tests.transport_peer import gather, pattern, split_views

KIB, MIB = 1024, 1024 * 1024
LAYER_BLOCK = 41_984  # DeepSeek-V3.2: 64 tokens x 656 B
CFG = {"staging_bytes": 32 * MIB}


# ---------------------------------------------------------------- helpers (real UCX)

@pytest.fixture(scope="module", autouse=True)
def single_copy_opt_in():
    """This module also exercises the opt-in single-copy path (off by default: see
    common.transport.ucx_env.single_copy_supported); its peers inherit the setting."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DUALPATH_UCX_SINGLE_COPY", "1")
        yield


@pytest.fixture(scope="module")
def peer():
    p = PeerProc(CFG)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
async def local():
    t = PageTransport(TransportConfig(**CFG), "local")
    await t.start()
    ctx = weakref.ref(t.links._ctx)
    try:
        yield t
    finally:
        await t.stop()
        await t.stop()  # idempotent
        gc.collect()
        assert ctx() is None, f"UCX context still referenced after stop(): {holders(ctx())}"


async def receive_from(peer: PeerProc, t: PageTransport, slots, seed: int, split: int = 1,
                       deadline: float = 20.0) -> np.ndarray:
    arena, tid = arena_for(slots), t.new_transfer_id()
    handle = await t.expect(peer.address, tid, arena, slots, deadline)
    reply = await peer.request("send", peer=list(t.address), tid=tid, slots=slots, seed=seed,
                               split=split, deadline=deadline)
    assert reply["ok"], reply
    await handle.wait()
    return arena


# ---------------------------------------------------------------- real UCX, one process

async def test_two_transports_in_one_loop():
    cfg = TransportConfig(**CFG)
    async with PageTransport(cfg, "a") as a, PageTransport(cfg, "b") as b:
        for slots, split in [([(0, 3 * MIB)], 1), (gapped(200, LAYER_BLOCK), 1),
                             (gapped(6, MIB), 5)]:
            data = pattern(7, sum(n for _, n in slots))
            arena, tid = arena_for(slots), a.new_transfer_id()
            handle = await a.expect(b.address, tid, arena, slots, 10.0)
            await b.send(a.address, tid, split_views(data, split), slots, 10.0)
            await handle.wait()
            assert np.array_equal(gather(arena, slots), data)
        assert a.stats()["packed_messages"] >= 1 and b.stats()["gathered_bytes"] > 0
        assert a.stats()["staging_in_use_bytes"] == 0 == b.stats()["staging_in_use_bytes"]


async def test_small_staging_flow_controls_packed_and_gathered_messages():
    cfg = TransportConfig(staging_bytes=MIB, max_message_bytes=MIB)  # one message at a time
    async with PageTransport(cfg, "a") as a, PageTransport(cfg, "b") as b:
        slots = gapped(300, LAYER_BLOCK)  # 13 packed messages of <= 1 MiB
        data = pattern(9, 300 * LAYER_BLOCK)
        arena, tid = arena_for(slots), a.new_transfer_id()
        handle = await a.expect(b.address, tid, arena, slots, 20.0)
        await b.send(a.address, tid, split_views(data, 7), slots, 20.0)
        await handle.wait()
        assert np.array_equal(gather(arena, slots), data)
        assert a.stats()["packed_messages"] == 13 and a.stats()["staging_peak_bytes"] <= MIB
        assert b.stats()["gathered_bytes"] > 0 and b.stats()["staging_in_use_bytes"] == 0


async def test_peers_with_different_plans_refuse_to_talk():
    async with (PageTransport(TransportConfig(**CFG), "a") as a,
                PageTransport(TransportConfig(pack_below_bytes=0, **CFG), "b") as b):
        with pytest.raises(ProtocolError, match="plans messages differently"):
            await a.expect(b.address, a.new_transfer_id(), np.zeros(8, np.uint8), [(0, 8)], 5.0)


async def test_stop_cancels_pending_receives():
    cfg = TransportConfig(**CFG)
    async with PageTransport(cfg, "b") as b:
        a = PageTransport(cfg, "a")
        await a.start()
        handle = await a.expect(b.address, a.new_transfer_id(), np.zeros(MIB, np.uint8),
                                [(0, MIB)], 30.0)
        await a.stop()
        with pytest.raises(Cancelled):
            await handle.wait()
        with pytest.raises(Unavailable):
            await a.expect(b.address, a.new_transfer_id(), np.zeros(8, np.uint8), [(0, 8)], 1.0)


@pytest.mark.gpu
async def test_device_arena_direct_messages():
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("no CUDA device")
    options = {"TLS": "tcp,sm,self,cuda_copy,cuda_ipc", "NET_DEVICES": "lo"}
    cfg = TransportConfig(traffic_classes={"kv": TrafficClassConfig(options=options)}, **CFG)
    async with PageTransport(cfg, "a") as a, PageTransport(cfg, "b") as b, \
            PageTransport(cfg, "g", device_sources=True) as g:
        slots = [(0, 2 * MIB), (3 * MIB, MIB)]
        # (sender, its source): a host sender's pages land in pinned staging, then one H2D
        # copy each (common.transport.device_staging); a device sender's go straight in; a
        # device source from a sender that says host memory is staged too (UCX's D2H, then
        # ours): slower, the same bytes
        cases = [(g, "device", 0), (b, "host", 2), (b, "device", 2)]
        for seed, (sender, kind, staged) in enumerate(cases):
            data = pattern(13 + seed, 3 * MIB)
            arena, tid = cupy.zeros(4 * MIB, dtype=cupy.uint8), a.new_transfer_id()
            before = a.stats()["device_staged_messages"]
            handle = await a.expect(sender.address, tid, arena, slots, 20.0)
            src = cupy.asarray(data) if kind == "device" else data
            cupy.cuda.Device().synchronize()
            await sender.send(a.address, tid, [src], slots, 20.0)
            await handle.wait()
            assert np.array_equal(gather(cupy.asnumpy(arena), slots), data), (sender, kind)
            assert a.stats()["device_staged_messages"] - before == staged, (sender, kind)
        assert a.stats()["device_staging_in_use_bytes"] == 0
        with pytest.raises(InvalidArgument, match="device arenas need direct messages"):
            await a.expect(b.address, a.new_transfer_id(), arena, gapped(4, 4 * KIB), 1.0)


async def test_send_validates_sizes_and_ids():
    async with PageTransport(TransportConfig(**CFG), "a") as a:
        with pytest.raises(InvalidArgument):
            await a.send(a.address, a.new_transfer_id(), [np.zeros(10, np.uint8)], [(0, 11)], 1.0)
        with pytest.raises(InvalidArgument):
            await a.expect(a.address, 0, np.zeros(10, np.uint8), [(0, 10)], 1.0)
        with pytest.raises(InvalidArgument):
            await a.expect(a.address, a.new_transfer_id(), np.zeros(10, np.uint8), [(5, 10)], 1.0)


# ---------------------------------------------------------------- real UCX, two processes

@pytest.mark.slow
@pytest.mark.parametrize("nbytes", [4 * KIB, LAYER_BLOCK, MIB, 16 * MIB])
async def test_byte_exact_sizes(peer, local, nbytes):
    slots = [(4096, nbytes)]
    arena = await receive_from(peer, local, slots, seed=nbytes)
    assert np.array_equal(gather(arena, slots), pattern(nbytes, nbytes))
    assert not arena[:4096].any() and not arena[4096 + nbytes:].any()  # nothing outside slots


@pytest.mark.slow
async def test_many_small_noncontiguous_pages_are_packed(peer, local):
    slots = gapped(300, LAYER_BLOCK)  # 12.6 MB in 300 Layer Blocks with gaps
    before = local.stats()["packed_messages"]
    arena = await receive_from(peer, local, slots, seed=11)
    assert np.array_equal(gather(arena, slots), pattern(11, 300 * LAYER_BLOCK))
    assert local.stats()["packed_messages"] > before


@pytest.mark.slow
async def test_noncontiguous_source_is_gathered(peer, local):
    slots = gapped(5, 3 * MIB)
    arena = await receive_from(peer, local, slots, seed=12, split=9)
    assert np.array_equal(gather(arena, slots), pattern(12, 15 * MIB))
    stats = (await peer.request("stats"))["stats"]
    assert stats["gathered_bytes"] > 0


@pytest.mark.slow
async def test_other_direction(peer, local):
    for slots, seed in [([(0, 5 * MIB)], 21), (gapped(64, 4 * KIB), 22)]:
        tid = (await peer.request("new_id"))["tid"]
        futs = peer.call("expect", peer=list(local.address), tid=tid, arena_bytes=20 * MIB,
                         slots=slots, deadline=20.0)
        await peer.reply(futs, "posted")
        data = pattern(seed, sum(n for _, n in slots))
        await local.send(peer.address, tid, [data], slots, 20.0)
        reply = await peer.reply(futs, "done")
        assert reply["ok"] and reply["digest"] == hashlib.sha256(data.tobytes()).hexdigest()


async def test_a_peer_op_that_fails_before_posting_fails_the_wait_for_its_post(peer):
    """The harness (tests/peer_proc.py): an expect whose connect is refused replies its
    failure and never posts; a test waiting for the post gets that reply at once. (The project
    CI on 3c62e6f: test_other_direction waited for a post that could no longer come until
    pytest's 120-s timeout, and the peer's error was never shown.)"""
    tid = (await peer.request("new_id"))["tid"]
    futs = peer.call("expect", peer=["127.0.0.1", closed_port()], tid=tid, arena_bytes=4096,
                     slots=[(0, 4096)], deadline=20.0)
    with pytest.raises(OpEndedUnposted) as info:
        await peer.reply(futs, "posted", wait_s=30.0)
    assert not info.value.reply["ok"] and info.value.reply["error"] == "Unavailable", \
        info.value.reply


@pytest.mark.slow
async def test_sender_killed_mid_transfer_raises_peer_failed(local):
    victim = PeerProc(CFG)
    try:
        slots = gapped(8, MIB)
        arena, tid = arena_for(slots), local.new_transfer_id()
        handle = await local.expect(victim.address, tid, arena, slots, 60.0)
        reply = await victim.request("send", peer=list(local.address), tid=tid, slots=slots[:4],
                                     seed=3)  # only the first half of the messages
        assert reply["ok"]
        await until(lambda: local.stats()["messages_received"] >= 4, what="first half")
        victim.kill()
        with pytest.raises(PeerFailed) as info:
            await asyncio.wait_for(handle.wait(), 30)
        assert "127.0.0.1" in str(info.value)
        assert local.stats()["transfers_received_failed"] == 1
    finally:
        victim.kill()


@pytest.mark.slow
async def test_deadline_then_arena_is_not_targeted_and_reusable(peer, local):
    slots = gapped(4, MIB)
    # a live link first: the budget below is the transfer's, not a connect's (a connect on a
    # loaded 2-core machine took longer once: CI, the real-engine tests running beside)
    await receive_from(peer, local, [(0, MIB)], seed=3)
    # the case needs the first half received before the deadline passes; on a starved host the
    # peer's send of it once outlasted 0.5 s (the deadline aborted the link: the send failed
    # PEER_FAILED), so the budget grows until the first half made it
    for budget in (0.5, 2.0, 8.0, 30.0):
        arena, tid = arena_for(slots), local.new_transfer_id()
        handle = await local.expect(peer.address, tid, arena, slots, budget)
        reply = await peer.request("send", peer=list(local.address), tid=tid, slots=slots[:2],
                                   seed=4, deadline=budget + 5.0)
        with pytest.raises(DeadlineExceeded):
            await handle.wait()
        if reply["ok"]:
            break
        assert reply["error"] == "PeerFailed", reply     # the deadline aborted the link
    else:
        pytest.fail("the first half never crossed within its receive's deadline")
    arena[:] = 0xAB
    late = await peer.request("send", peer=list(local.address), tid=tid, slots=slots, seed=4,
                              deadline=1.0)
    assert not late["ok"]  # its endpoint was aborted, or nothing matches any more
    assert (arena == 0xAB).all()
    with pytest.raises(InvalidArgument):  # a half-received id is never reused
        await local.expect(peer.address, tid, arena, slots, 1.0)
    tid2 = local.new_transfer_id()
    handle = await local.expect(peer.address, tid2, arena, slots, 20.0)
    reply = await peer.request("send", peer=list(local.address), tid=tid2, slots=slots, seed=5)
    assert reply["ok"]
    await handle.wait()
    assert np.array_equal(gather(arena, slots), pattern(5, 4 * MIB))


@pytest.mark.slow
async def test_cancel_then_fresh_transfer(peer, local):
    slots = gapped(3, MIB)
    arena = arena_for(slots)
    handle = await local.expect(peer.address, local.new_transfer_id(), arena, slots, 30.0)
    await handle.cancel()
    with pytest.raises(Cancelled):
        await handle.wait()
    assert local.stats()["transfers_active"] == 0
    arena = await receive_from(peer, local, slots, seed=6)
    assert np.array_equal(gather(arena, slots), pattern(6, 3 * MIB))


async def test_a_request_given_up_on_keeps_its_buffer_alive(local):
    """ucxx requests hold raw pointers, not references: a wait given up on (deadline, cancel)
    parks its buffer until UCX completed the request, and a stop keeps it for good — freed
    earlier, a late write would land in reused heap memory (a crash far from its cause)."""
    import common.transport.page_transport as transport_mod

    class Pending:           # a UCX request that has not completed (yet)
        done = polled = False

        @property
        def completed(self) -> bool:
            self.polled = True
            return self.done

        def check_error(self) -> None:
            return None

    first, second = Pending(), Pending()
    buf1, buf2 = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    ref1, ref2 = weakref.ref(buf1), weakref.ref(buf2)
    for req, buf in ((first, buf1), (second, buf2)):
        task = asyncio.create_task(local.links._wait_one(req, buf))
        await until(lambda req=req: req.polled, what="the wait to poll its request")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    del buf1, buf2, buf, task
    gc.collect()
    assert ref1() is not None and ref2() is not None
    assert local.stats()["requests_parked_now"] == 2
    first.done = True                     # UCX is done with it: now it may go
    local.links._prune_parked()
    gc.collect()
    assert ref1() is None and ref2() is not None
    orphaned = len(transport_mod._ORPHANED)
    await local.stop()                    # still pending at stop: kept for the process's life
    gc.collect()
    assert ref2() is not None and len(transport_mod._ORPHANED) == orphaned + 1
    assert local.stats()["requests_orphaned"] == 1
    transport_mod._ORPHANED.pop()


# ---------------------------------------------------------------- single copy (same host)

async def test_single_copy_receiver_needs_the_commit(monkeypatch):
    """Data over the worker-address endpoint completes only with the sender's commit."""
    cfg = TransportConfig(**CFG)
    async with PageTransport(cfg, "a") as a, PageTransport(cfg, "b") as b:
        if not a.links.worker_address:
            pytest.skip(f"no single copy here: {a.single_copy_reason}")
        slots = [(0, 3 * MIB), (4 * MIB, 64 * KIB)]
        data = pattern(41, 3 * MIB + 64 * KIB)
        arena, tid = arena_for(slots), a.new_transfer_id()
        handle = await a.expect(b.address, tid, arena, slots, 10.0)
        await b.send(a.address, tid, split_views(data, 2), slots, 10.0)
        await handle.wait()
        assert np.array_equal(gather(arena, slots), data)
        assert a.stats()["single_copy_links"] == 1 and b.stats()["single_copy_endpoints"] == 1

        async def no_commit(tx):
            return None
        monkeypatch.setattr(b.transfers, "_send_commit", no_commit)
        arena, tid = arena_for(slots), a.new_transfer_id()
        handle = await a.expect(b.address, tid, arena, slots, 1.0)
        before = a.stats()["messages_received"]
        await b.send(a.address, tid, [data], slots, 5.0)  # every message taken by the receiver
        with pytest.raises(DeadlineExceeded):
            await handle.wait()
        assert a.stats()["messages_received"] == before + 2  # all bytes, but no commit


async def test_single_copy_endpoint_failure_falls_back_to_the_link(monkeypatch):
    cfg = TransportConfig(**CFG)
    async with PageTransport(cfg, "a") as a, PageTransport(cfg, "b") as b:
        if not a.links.worker_address:
            pytest.skip(f"no single copy here: {a.single_copy_reason}")

        async def refuse(*args, **kw):
            raise ValueError("no endpoint from this address")
        monkeypatch.setattr(b.links._ctx, "create_endpoint_from_worker_address", refuse)
        slots = [(0, 2 * MIB)]
        data = pattern(42, 2 * MIB)
        arena, tid = arena_for(slots), a.new_transfer_id()
        handle = await a.expect(b.address, tid, arena, slots, 10.0)
        await b.send(a.address, tid, [data], slots, 10.0)  # over the link, still committed
        await handle.wait()
        assert np.array_equal(gather(arena, slots), data)
        assert b.stats()["single_copy_endpoints_open"] == 0 and b.stats()["single_copy_links"] == 1


@pytest.mark.slow
async def test_same_host_peers_use_single_copy(peer, local):
    if not local.links.worker_address:
        pytest.skip(f"no single copy here: {local.single_copy_reason}")
    slots = [(0, 5 * MIB)]
    arena = await receive_from(peer, local, slots, seed=32)
    assert np.array_equal(gather(arena, slots), pattern(32, 5 * MIB))
    assert local.stats()["single_copy_links"] >= 1
    assert (await peer.request("stats"))["stats"]["single_copy_endpoints"] >= 1


@pytest.mark.slow
async def test_single_copy_off_on_one_side_falls_back(local, monkeypatch):
    monkeypatch.setenv("DUALPATH_UCX_SINGLE_COPY", "0")
    other = PeerProc(CFG)
    try:
        arena = await receive_from(other, local, gapped(3, MIB), seed=33)
        assert np.array_equal(gather(arena, gapped(3, MIB)), pattern(33, 3 * MIB))
        tid = (await other.request("new_id"))["tid"]
        futs = other.call("expect", peer=list(local.address), tid=tid, arena_bytes=4 * MIB,
                          slots=[(0, 2 * MIB)], deadline=20.0)
        await other.reply(futs, "posted")
        await local.send(other.address, tid, [pattern(34, 2 * MIB)], [(0, 2 * MIB)], 20.0)
        assert (await other.reply(futs, "done"))["ok"]
        assert local.stats()["single_copy_links"] == 0
        assert (await other.request("stats"))["stats"]["single_copy_endpoints"] == 0
    finally:
        other.close()


@pytest.mark.slow
async def test_receiver_killed_fails_a_pending_send_fast(local):
    """Sends the receiver never takes (nothing expected) fail as soon as it dies; the
    transport's gather staging comes back (abandoned single-copy sends are not awaited)."""
    victim = PeerProc(CFG)
    try:
        tid = (await victim.request("new_id"))["tid"]
        slots = gapped(4, MIB)
        send = asyncio.create_task(local.send(victim.address, tid,
                                              split_views(pattern(35, 4 * MIB), 3), slots, 60.0))
        await until(lambda: local.stats()["staging_in_use_bytes"] > 0, what="sends posted")
        await asyncio.sleep(0.2)             # time passes: the untaken sends stay pending
        assert not send.done()
        victim.kill()
        with pytest.raises(PeerFailed):      # the death, well before the send's 60 s deadline
            await asyncio.wait_for(send, 30)
        stats = local.stats()
        assert stats["staging_in_use_bytes"] == 0 and stats["transfers_active"] == 0
        if stats["single_copy_endpoints"]:
            assert stats["sends_abandoned"] > 0
            # the dead peer's single-copy endpoint is closed (its process is gone)
            await until(lambda: local.stats()["single_copy_endpoints_open"] == 0, 15.0,
                        "the dead peer's single-copy endpoint to close")
    finally:
        victim.kill()


@pytest.mark.slow
async def test_send_deadline_fails_fast_then_link_recovers(peer, local):
    await receive_from(peer, local, [(0, MIB)], seed=35)  # a live link: the 0.5 s is the send's
    tid = (await peer.request("new_id"))["tid"]  # the peer never expects it
    with pytest.raises(DeadlineExceeded):     # abandoned at its deadline, not settled later
        await asyncio.wait_for(local.send(peer.address, tid, split_views(pattern(36, 3 * MIB), 2),
                                          gapped(3, MIB), 0.5), 30)
    assert local.stats()["staging_in_use_bytes"] == 0

    async def peer_dropped_link() -> bool:
        return (await peer.request("stats"))["stats"]["endpoints"] == 0
    # the peer has seen the abort (else its next send may pick the old link)
    await apoll(peer_dropped_link, 2.0, interval=0.01)
    arena = await receive_from(peer, local, gapped(3, MIB), seed=37)
    assert np.array_equal(gather(arena, gapped(3, MIB)), pattern(37, 3 * MIB))


@pytest.mark.slow
async def test_idle_transport_uses_almost_no_cpu(peer, local):
    await receive_from(peer, local, [(0, MIB)], seed=8)  # a live connection, after traffic
    start_peer, start_self, t0 = proc_cpu_seconds(peer.pid), time.process_time(), time.monotonic()
    await asyncio.sleep(2.0)                 # time passes on an idle link: its CPU is measured
    elapsed = time.monotonic() - t0
    assert (proc_cpu_seconds(peer.pid) - start_peer) / elapsed < 0.10
    assert (time.process_time() - start_self) / elapsed < 0.10
