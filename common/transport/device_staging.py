"""Pinned host staging for receives into device memory whose sender sends host memory.

Why: a tag receive posted straight into a device (cupy) arena from a host-memory sender goes
through UCX's fragmented cuda_copy pipeline ("rendezvous fragmented copy-in copy-out"):
~0.9 GB/s on an H200 whether the sender's pages are pageable or pinned, against 7.7 GB/s
(pageable) and 54.7 GB/s (pinned) for one ``cudaMemcpy`` of the same bytes, and no UCX option
changed it (docs/performance.md, "GPU memory"). So such a receive lands host → host into a
page-locked staging buffer (UCX's fast host paths), then one asynchronous H2D copy per message
on a non-default stream moves it into the device slot, on the copy engines; the transfer
completes only once every copy has. GPU → GPU (``cuda_ipc``) stays direct: the receiver
stages only when the peer's hello says it sends host memory (``TransferHello.device_sources``
false, which a gateway and every older peer say) — :func:`~common.transport.plan.stage_to_device`.
A wrong guess costs speed, never bytes: a device source received into pinned staging crosses
by UCX's D2H copy, then ours.

Bounded like the packed-message staging (:mod:`common.transport.staging`): one pinned pool of
``transport.staging_bytes``, allocated on first use (a transport that never receives into
device memory from a host peer never pins anything); receives that find no room wait in
strict FIFO order across transfers (the same deadlock argument). Every wait has a deadline:
the transfer's own, and the transport's settle time (``transfers._SETTLE_S``) for the copies a
failed transfer leaves (past it they are abandoned: their extents come back when they end).

:class:`DeviceStaging` owns the pool, the FIFO queue and the copies in flight; the copies
themselves are a :class:`CopyEngine` (injected: :class:`CupyCopyEngine` on a GPU, a fake in
the CPU tests), so every decision here runs without cupy.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import structlog

from common.errors import InternalError
from common.transport.plan import MessagePlan, StagingPool
from common.transport.staging import STAGING_ALIGN, StagingQueue

log = structlog.get_logger("common.transport")

Done = Callable[[BaseException | None], None]


class CopyEngine(Protocol):
    """Host → device copies off the event loop (``CupyCopyEngine`` on a GPU)."""

    def pinned(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer of ``nbytes`` (flat uint8)."""

    def copy(self, dst: Any, src: np.ndarray, done: Done) -> None:
        """Start copying host ``src`` into device ``dst`` (same size); call ``done`` (from
        any thread) with None or the error once the copy has finished."""

    def close(self) -> None:
        """No more copies: let go of threads (copies already started still call back)."""


class CupyCopyEngine:
    """H2D copies with cupy: one non-blocking stream per device, one event per copy, and one
    daemon thread that waits for the events in order (a blocking-sync event: the thread sleeps
    in the driver, the event loop never waits on the GPU). Imports cupy lazily."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._waits: queue.SimpleQueue[tuple[int, Any, Done] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def pinned(self, nbytes: int) -> np.ndarray:
        import cupyx
        return cupyx.empty_pinned(max(nbytes, 1), dtype=np.uint8)[:nbytes]

    def copy(self, dst: Any, src: np.ndarray, done: Done) -> None:
        import cupy
        device = dst.device
        with device:
            stream = self._streams.get(device.id)
            if stream is None:
                stream = self._streams[device.id] = cupy.cuda.Stream(non_blocking=True)
            dst.set(src, stream=stream)          # cudaMemcpyAsync on our stream
            event = cupy.cuda.Event(block=True, disable_timing=True)
            event.record(stream)
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait_all, daemon=True,
                                            name="dualpath-h2d-wait")
            self._thread.start()
        self._waits.put((int(device.id), event, done))

    def _wait_all(self) -> None:
        import cupy
        while (item := self._waits.get()) is not None:
            device, event, done = item
            err: BaseException | None = None
            try:
                cupy.cuda.runtime.setDevice(device)
                event.synchronize()
            except BaseException as e:  # reported to the transfer, never lost in this thread
                err = e
            done(err)

    def close(self) -> None:
        if self._thread is not None:
            self._waits.put(None)
            self._thread = None


@dataclass(eq=False)
class StagedCopy:
    """One message's H2D copy from pinned staging extent ``stg`` (``done`` set on the loop)."""

    stg: int
    nbytes: int
    done: bool = False
    error: BaseException | None = None
    abandoned: bool = False      # its transfer gave up waiting: free the extent when done


class DeviceStaging:
    """The pinned staging pool of one transport, its FIFO queue and the copies in flight.

    ``wake`` (the progress driver's kick) wakes the receive loops when staging frees up or a
    copy finishes; ``engine`` makes the copies (default: :class:`CupyCopyEngine`, created on
    first use).
    """

    def __init__(self, nbytes: int, wake: Callable[[], None],
                 engine: CopyEngine | None = None) -> None:
        self._nbytes, self._wake, self._engine = nbytes, wake, engine
        self._pool: StagingPool | None = None
        self._loop = asyncio.get_running_loop()
        self.queue: StagingQueue[Any, MessagePlan] = StagingQueue()
        self.in_flight = 0
        self.messages = self.nbytes_staged = self.abandoned = 0

    @property
    def allocated(self) -> bool:
        return self._pool is not None

    @property
    def pool(self) -> StagingPool:
        """The pinned pool, allocated on first use (pageable if pinning fails: slower, and
        still correct)."""
        if self._pool is None:
            engine = self._engine_now()
            try:
                buf = engine.pinned(self._nbytes)
            except Exception as e:     # no pinned memory to be had: the copy stays correct
                log.warning("device_staging_not_pinned", bytes=self._nbytes, error=repr(e))
                buf = np.empty(self._nbytes, np.uint8)
            self._pool = StagingPool(self._nbytes, align=STAGING_ALIGN, on_free=self._wake,
                                     buffer=buf)
            log.info("device_staging_allocated", bytes=self._nbytes)
        return self._pool

    def _engine_now(self) -> CopyEngine:
        if self._engine is None:
            self._engine = CupyCopyEngine()
        return self._engine

    def copy(self, arena: Any, msg: MessagePlan, stg: int) -> StagedCopy:
        """Start the H2D copy of direct message ``msg`` (received into extent ``stg``) into
        its slot of device ``arena``; the returned record is ``done`` once it finished."""
        off = msg.pieces[0][0]
        rec = StagedCopy(stg, msg.nbytes)
        self.in_flight += 1
        try:
            self._engine_now().copy(arena[off:off + msg.nbytes],
                                    self.pool.view(stg, msg.nbytes), self._done_cb(rec))
        except BaseException as e:   # nothing was started: the extent is free again
            self.in_flight -= 1
            rec.done, rec.error = True, e
        self.messages += 1
        self.nbytes_staged += msg.nbytes
        return rec

    def _done_cb(self, rec: StagedCopy) -> Done:
        loop = self._loop

        def done(err: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(self._copied, rec, err)
            except RuntimeError:     # the loop is closed: the process is ending
                pass
        return done

    def _copied(self, rec: StagedCopy, err: BaseException | None) -> None:
        self.in_flight -= 1
        rec.done, rec.error = True, err
        if rec.abandoned and self._pool is not None:
            self._pool.free(rec.stg)
        self._wake()

    def finish(self, rec: StagedCopy) -> None:
        """A done copy: give its extent back; raise ``InternalError`` if the copy failed."""
        self.pool.free(rec.stg)
        if rec.error is not None:
            raise InternalError(f"H2D copy of a staged message ({rec.nbytes} B) into device "
                                f"memory failed: {type(rec.error).__name__}: {rec.error}")

    def release(self, rec: StagedCopy) -> bool:
        """At a failure: give back a done copy's extent (True), or False if still copying."""
        if not rec.done:
            return False
        self.pool.free(rec.stg)
        return True

    def abandon(self, rec: StagedCopy) -> None:
        """A failed transfer stops waiting for ``rec``: its extent is freed when it ends."""
        if rec.done:
            self.pool.free(rec.stg)
            return
        rec.abandoned = True
        self.abandoned += 1
        log.error("device_copy_not_settled", bytes=rec.nbytes,
                  reason="an H2D copy outlived its transfer's settle time")

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def stats(self) -> dict[str, float]:
        pool = self._pool
        return {"device_staged_messages": float(self.messages),
                "device_staged_bytes": float(self.nbytes_staged),
                "device_copies_in_flight": float(self.in_flight),
                "device_copies_abandoned": float(self.abandoned),
                "device_staging_in_use_bytes": float(pool.in_use if pool else 0),
                "device_staging_peak_bytes": float(pool.peak if pool else 0),
                "device_staging_capacity_bytes": float(pool.capacity if pool else 0)}
