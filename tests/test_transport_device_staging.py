"""Pinned staging of receives into device memory from host-memory senders, without a GPU.

Real UCX on loopback, one process; the receiver's "device" arena is a host array behind the
CUDA array interface (:class:`FakeDeviceArena`) and the H2D copies are a thread
(:class:`ThreadCopies`), injected through ``PageTransport(copy_engine=...)``. What runs here is
everything but CUDA: when to stage (the hello's ``device_sources``), the lazily allocated,
bounded pool, FIFO waits across transfers, completion only after the copies, and what a failed
or hung copy does to the receive. The cupy engine itself runs in ``bench/gpu_check.sh``
(``tests/test_transport.py::test_device_arena_direct_messages``, ``bench gpu``).
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from typing import Any

import msgspec
import numpy as np
import pytest

from common.config import TransportConfig
from common.errors import DeadlineExceeded, InternalError, InvalidArgument
from common.transport import PageTransport, plan, transfers
from common.transport.plan import (HELLO_VERSION, StagingPool, TransferHello, decode_hello,
                                   encode_hello, stage_to_device)
from tests.helpers import until
from tests.transport_peer import gather, pattern

KIB, MIB = 1024, 1024 * 1024
MSG = 256 * KIB
# one UCX context per side on loopback, no same-host shortcut: tag messages only
BASE = {"max_message_bytes": MSG, "pack_below_bytes": 0, "same_host": "ucx", "kv_mode": "tag"}


class FakeDeviceArena:
    """A flat uint8 host array that says it is device memory (``__cuda_array_interface__``):
    the transport must never post a UCX receive into it, only copy into it."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.ndim, self.dtype, self.flags, self.nbytes = 1, host.dtype, host.flags, host.nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.host.size,), "typestr": "|u1", "version": 3,
                "data": (int(self.host.ctypes.data), False)}

    def __getitem__(self, key: slice) -> FakeDeviceArena:
        return FakeDeviceArena(self.host[key])


class ThreadCopies:
    """The copy engine of these tests: copies in order in one thread (like one stream and its
    waiter), each after ``gate`` opens; ``fail`` makes every copy report an error."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.gate = fail, threading.Event()
        self.gate.set()
        self.pinned_sizes: list[int] = []
        self.copied = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_sizes.append(nbytes)
        return np.zeros(nbytes, np.uint8)

    def copy(self, dst: Any, src: np.ndarray, done) -> None:
        assert isinstance(dst, FakeDeviceArena) and dst.nbytes == src.nbytes
        self._q.put((dst, src, done))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            dst, src, done = item
            self.gate.wait()
            if self.fail:
                done(RuntimeError("cudaErrorIllegalAddress (emulated)"))
                continue
            dst.host[:] = src          # read the staging only now: it must still be ours
            self.copied += 1
            done(None)

    def close(self) -> None:
        self._q.put(None)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The arena checks accept a device array without CUDA (only the copies touch it)."""
    monkeypatch.setattr(plan, "cuda_available", lambda: True)


def gapped(count: int, size: int, base: int = 0, gap: int = 4 * KIB) -> list[tuple[int, int]]:
    return [(base + i * (size + gap), size) for i in range(count)]


async def pair(copies: ThreadCopies, staging: int, *, sender_device: bool = False):
    rx = PageTransport(TransportConfig(staging_bytes=staging, **BASE), "rx", copy_engine=copies)
    tx = PageTransport(TransportConfig(staging_bytes=4 * MIB, **BASE), "tx",
                       device_sources=sender_device)
    await rx.start()
    await tx.start()
    return rx, tx


# ---------------------------------------------------------------- pure parts

def test_when_to_stage():
    host, device = np.zeros(8, np.uint8), FakeDeviceArena(np.zeros(8, np.uint8))
    assert stage_to_device(device, peer_sends_device=False)       # host sender -> device
    assert not stage_to_device(device, peer_sends_device=True)    # GPU -> GPU: cuda_ipc
    assert not stage_to_device(host, peer_sends_device=False)     # host arenas never stage
    assert not stage_to_device(host, peer_sends_device=True)


def test_the_hello_carries_device_sources_and_an_old_peer_means_host():
    hello = TransferHello(HELLO_VERSION, "de0", "127.0.0.1", 5000, MIB, 0,
                          device_sources=True)
    assert decode_hello(encode_hello(hello)).device_sources is True
    # an older peer's hello ends before the field: it sends host memory
    old = msgspec.msgpack.encode(list(msgspec.structs.astuple(hello))[:-1])
    buf = np.zeros(512, np.uint8)
    buf[:2] = np.frombuffer(len(old).to_bytes(2, "little"), np.uint8)
    buf[2:2 + len(old)] = np.frombuffer(old, np.uint8)
    assert decode_hello(buf).device_sources is False


def test_a_staging_pool_takes_a_given_buffer_and_refuses_a_wrong_one():
    buf = np.zeros(2 * 4096, np.uint8)
    pool = StagingPool(buf.nbytes, buffer=buf)
    off = pool.try_alloc(4096)
    assert pool.buffer is buf and off is not None and pool.try_alloc(8192) is None
    for wrong in (np.zeros(4096, np.uint8), np.zeros(8192, np.uint16)[:4096],
                  np.zeros((2, 4096), np.uint8)):
        with pytest.raises(InvalidArgument):
            StagingPool(8192, buffer=wrong)


# ---------------------------------------------------------------- real UCX, fake device

async def test_host_sender_into_device_arena_stages_bounded_and_fifo(fake_cuda):
    """Three transfers of 12 x 256 KiB at once through 1 MiB of staging (4 messages): every
    byte arrives, staging never exceeds its bound, and nothing is left held."""
    copies = ThreadCopies()
    rx, tx = await pair(copies, staging=MIB)
    try:
        n, per = 3, 12
        arena = FakeDeviceArena(np.zeros(n * per * (MSG + 4 * KIB), np.uint8))
        slots = [gapped(per, MSG, base=k * per * (MSG + 4 * KIB)) for k in range(n)]
        data = [pattern(40 + k, per * MSG) for k in range(n)]
        tids = [rx.new_transfer_id() for _ in range(n)]
        assert rx.stats()["device_staging_capacity_bytes"] == 0     # nothing pinned yet
        handles = [await rx.expect(tx.address, tid, arena, s, 20.0)
                   for tid, s in zip(tids, slots)]
        for tid, s, d in zip(tids, slots, data):        # in order, like a gateway
            await tx.send(rx.address, tid, [d], s, 20.0)
        for h in handles:
            await h.wait()
        for s, d in zip(slots, data):
            assert np.array_equal(gather(arena.host, s), d)
        st = rx.stats()
        assert st["device_staged_messages"] == n * per == copies.copied
        assert st["device_staged_bytes"] == n * per * MSG
        assert st["device_staging_capacity_bytes"] == MIB and copies.pinned_sizes == [MIB]
        assert 0 < st["device_staging_peak_bytes"] <= MIB
        assert st["device_staging_in_use_bytes"] == 0 and st["device_copies_in_flight"] == 0
        assert st["transfers_received_ok"] == n
    finally:
        await tx.stop()
        await rx.stop()
        copies.close()


async def test_a_device_sender_is_not_staged_and_a_host_arena_never_pins(fake_cuda):
    """The hello says which: a peer with ``device_sources`` is received directly (shown by
    the link), and a host arena from a host peer neither stages nor allocates pinned memory."""
    copies = ThreadCopies()
    rx, tx = await pair(copies, staging=MIB, sender_device=True)
    try:
        arena, slots = np.zeros(2 * MIB, np.uint8), gapped(4, MSG)
        data = pattern(7, 4 * MSG)
        tid = rx.new_transfer_id()
        handle = await rx.expect(tx.address, tid, arena, slots, 20.0)
        await tx.send(rx.address, tid, [data], slots, 20.0)
        await handle.wait()
        assert np.array_equal(gather(arena, slots), data)
        (path,) = rx.links.paths()
        assert path["peer_device"] is True
        (back,) = tx.links.paths()
        assert back["peer_device"] is False
        st = rx.stats()
        assert st["device_staged_messages"] == 0 and st["device_staging_capacity_bytes"] == 0
        assert copies.pinned_sizes == []
    finally:
        await tx.stop()
        await rx.stop()
        copies.close()


async def test_a_failed_copy_fails_the_receive_typed_and_frees_staging(fake_cuda):
    copies = ThreadCopies(fail=True)
    rx, tx = await pair(copies, staging=MIB)
    try:
        arena, slots = FakeDeviceArena(np.zeros(2 * MIB, np.uint8)), gapped(4, MSG)
        tid = rx.new_transfer_id()
        handle = await rx.expect(tx.address, tid, arena, slots, 20.0)
        send = asyncio.create_task(tx.send(rx.address, tid, [pattern(3, 4 * MSG)], slots, 20.0))
        with pytest.raises(InternalError, match="H2D copy"):
            await handle.wait()
        await asyncio.gather(send, return_exceptions=True)
        await until(lambda: rx.stats()["device_staging_in_use_bytes"] == 0,
                    what=lambda: f"staging still held: {rx.stats()}")
        assert rx.stats()["transfers_received_failed"] == 1
    finally:
        await tx.stop()
        await rx.stop()
        copies.close()


async def test_a_hung_copy_ends_at_the_deadline_and_its_staging_comes_back_later(
        fake_cuda, monkeypatch):
    """A copy that never finishes cannot hold the receive past its deadline; the failed
    transfer waits the settle time for it, then abandons it, and its extent is freed when
    the copy does end (never while it may still read it)."""
    monkeypatch.setattr(transfers, "_SETTLE_S", 0.2)
    copies = ThreadCopies()
    copies.gate.clear()
    rx, tx = await pair(copies, staging=MIB)
    try:
        # a live link first: the 1.0 s below is the transfer's budget, not a connect's (a
        # connect on a 2-core machine loaded by the real-engine tests took longer once: ci57)
        await rx.endpoint(tx.address, 20.0)
        arena, slots = FakeDeviceArena(np.zeros(MIB, np.uint8)), gapped(1, MSG)
        tid = rx.new_transfer_id()
        handle = await rx.expect(tx.address, tid, arena, slots, 1.0)
        await tx.send(rx.address, tid, [pattern(5, MSG)], slots, 5.0)
        with pytest.raises(DeadlineExceeded):
            await handle.wait()
        st = rx.stats()
        assert st["device_copies_abandoned"] == 1 and st["device_staging_in_use_bytes"] > 0
        copies.gate.set()
        await until(lambda: rx.stats()["device_staging_in_use_bytes"] == 0,
                    what=lambda: f"abandoned copy's staging not freed: {rx.stats()}")
        assert rx.stats()["device_copies_in_flight"] == 0
    finally:
        copies.gate.set()
        await tx.stop()
        await rx.stop()
        copies.close()


async def test_packed_slots_into_a_device_arena_are_still_refused(fake_cuda):
    copies = ThreadCopies()
    cfg = TransportConfig(staging_bytes=MIB, **{**BASE, "pack_below_bytes": 64 * KIB})
    async with PageTransport(cfg, "rx", copy_engine=copies) as rx, \
            PageTransport(cfg, "tx") as tx:
        arena = FakeDeviceArena(np.zeros(MIB, np.uint8))
        with pytest.raises(InvalidArgument, match="device arenas need direct messages"):
            await rx.expect(tx.address, rx.new_transfer_id(), arena, gapped(4, 4 * KIB), 1.0)
    copies.close()


# ---------------------------------------------------------------- the cupy calls, stood in

class _Device:
    def __init__(self, i: int) -> None:
        self.id = i

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _DeviceArray(FakeDeviceArena):
    """What ``CupyCopyEngine`` and ``host_copies`` use of a cupy array, on the host."""

    device = _Device(0)

    def __getitem__(self, key: slice) -> _DeviceArray:
        return _DeviceArray(self.host[key])

    def set(self, src: np.ndarray, stream: Any = None) -> None:
        assert isinstance(src, np.ndarray) and src.shape == self.host.shape and stream is not None
        stream.pending.append((self.host, src.copy()))

    def reshape(self, *shape: int) -> _DeviceArray:
        return _DeviceArray(self.host.reshape(*shape))

    def view(self, dtype: Any) -> _DeviceArray:
        return _DeviceArray(self.host.view(dtype))


def stand_in_cupy(monkeypatch) -> Any:
    """``cupy``/``cupyx`` modules with the calls the transport and ``host_copies`` make
    (names and arguments as in cupy's docs); a stream runs its copies at its event's sync."""
    import types

    class Stream:
        def __init__(self, non_blocking: bool = False) -> None:
            assert non_blocking
            self.pending: list = []

    class Event:
        def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
            assert block and disable_timing
            self.stream: Stream | None = None

        def record(self, stream: Stream) -> None:
            self.stream = stream

        def synchronize(self) -> None:
            assert self.stream is not None
            while self.stream.pending:
                dst, src = self.stream.pending.pop(0)
                dst[:] = src

    cupy = types.ModuleType("cupy")
    cupy.uint8 = np.uint8
    cupy.cuda = types.SimpleNamespace(Stream=Stream, Event=Event,
                                      runtime=types.SimpleNamespace(setDevice=lambda i: None))
    cupy.ascontiguousarray = lambda a: a

    def asnumpy(a: _DeviceArray, out: np.ndarray | None = None) -> np.ndarray:
        assert out is not None and out.shape == a.host.shape
        out[:] = a.host
        return out
    cupy.asnumpy = asnumpy
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda n, dtype: np.empty(n, dtype)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    return cupy


async def test_the_cupy_engine_copies_in_order_and_calls_back(monkeypatch):
    stand_in_cupy(monkeypatch)
    from common.transport.device_staging import CupyCopyEngine
    engine = CupyCopyEngine()
    try:
        staging = engine.pinned(3 * 4096)
        assert isinstance(staging, np.ndarray) and staging.nbytes == 3 * 4096
        arena = _DeviceArray(np.zeros(3 * 4096, np.uint8))
        loop, results = asyncio.get_running_loop(), asyncio.Queue()
        for k in range(3):
            staging[k * 4096:(k + 1) * 4096] = k + 1
            engine.copy(arena[k * 4096:(k + 1) * 4096], staging[k * 4096:(k + 1) * 4096],
                        lambda err, k=k: loop.call_soon_threadsafe(results.put_nowait, (k, err)))
        got = [await asyncio.wait_for(results.get(), 10) for _ in range(3)]
        assert got == [(0, None), (1, None), (2, None)]
        assert [int(arena.host[k * 4096]) for k in range(3)] == [1, 2, 3]
    finally:
        engine.close()


def test_host_copies_leave_host_views_alone_and_copy_device_ones(monkeypatch):
    from common.buffers import host_copies, is_device_array
    host = np.arange(8, dtype=np.uint8)
    assert host_copies([host])[0] is host           # no cupy needed without device views
    stand_in_cupy(monkeypatch)
    dev = _DeviceArray(np.arange(16, dtype=np.uint8))
    out = host_copies([host, dev])
    assert out[0] is host and isinstance(out[1], np.ndarray) and not is_device_array(out[1])
    assert np.array_equal(out[1], np.arange(16, dtype=np.uint8))


async def test_write_back_payloads_leave_the_gpu_before_the_gateway(monkeypatch):
    """A DE pool on the GPU: the gateway client takes host arrays, so the write-back's views
    are copied to host memory first, in their blocks' grouping (host payloads pass as is)."""
    from common.config import RpcConfig
    from services.node.gateway import NodeGateways
    gateways = NodeGateways(RpcConfig(), None, None, None, node_id="d0", role="de_loader",
                            local=None)
    host = [[np.zeros(4, np.uint8), np.ones(4, np.uint8)]]
    same = await gateways.host_payloads(host)
    assert same[0][0] is host[0][0] and same[0][1] is host[0][1]
    stand_in_cupy(monkeypatch)
    blocks = [[_DeviceArray(np.full(4, 10 * b + layer, np.uint8)) for layer in range(2)]
              for b in range(3)]
    out = await gateways.host_payloads(blocks)
    assert [[type(v) for v in blk] for blk in out] == [[np.ndarray] * 2] * 3
    assert [[int(v[0]) for v in blk] for blk in out] == [[0, 1], [10, 11], [20, 21]]
