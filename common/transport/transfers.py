"""The transfers of one page transport: the receive side (receives posted in advance, packed
messages through staging), the send side, and what a failure part-way does.

:class:`Transfers` is given the transport's :class:`~common.transport.links.Links` and its
progress driver, and owns everything about transfers in flight: the receives posted, the
staging pool and its FIFO queue, the ids retired after a failure. A transfer asks the links
for a usable link to its peer and, when it fails part-way, has them abort that link (the
package doc explains the design).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from common.config import TransportConfig
from common.errors import (Cancelled, DeadlineExceeded, DualpathError, InvalidArgument,
                           PeerFailed, ProtocolError)
from common.transport.device_staging import DeviceStaging
from common.transport.links import Links
from common.transport.shm_path import PATH_RMA, PATH_SHM, PATH_TAG, check_within
from common.transport.shm_transfers import ShmTransfers
from common.transport.plan import (COMMIT_BYTES, COMMIT_INDEX, INDEX_BITS, MessagePlan,
                                   Slots, SourceMap, StagingPool, check_flat_bytes,
                                   check_transfer_id, is_device_array, plan_messages,
                                   slot_array, stage_to_device)
from common.transport.staging import STAGING_ALIGN, StagingQueue
from common.transport.ucx import Peer, ReceiveHandle, Transfer, ucxx
from common.transport.ucx_env import WorkerProgress

log = structlog.get_logger("common.transport")

_RETIRED_IDS = 4096          # failed transfer ids remembered (never reused)
_SETTLE_S = 5.0              # bound on waiting for cancelled requests to complete


class Transfers:
    """Transfers in flight over the given :class:`Links`, on both sides.

    Made by a starting transport; :meth:`cancel_receives` and :meth:`close` end it.
    """

    def __init__(self, cfg: TransportConfig, links: Links, progress: WorkerProgress,
                 shm: ShmTransfers, device: DeviceStaging) -> None:
        """``device``: the pinned staging of receives into device memory from host senders
        (:mod:`common.transport.device_staging`)."""
        self.counts: collections.Counter[str] = collections.Counter()
        self._cfg, self._links, self._progress, self._shm = cfg, links, progress, shm
        self._device = device
        self._staging_pool: StagingPool | None = StagingPool(
            cfg.staging_bytes, align=STAGING_ALIGN, on_free=progress.kick)
        # packed receives waiting for staging (FIFO across transfers)
        self._staging_queue: StagingQueue[Transfer, MessagePlan] = StagingQueue()
        self._receiving: dict[int, Transfer] = {}
        self._active: set[Transfer] = set()
        self._retired: collections.OrderedDict[int, None] = collections.OrderedDict()

    # ------------------------------------------------------------------ lifecycle

    @property
    def in_flight(self) -> int:
        """Transfers (either side) whose requests may still be pending."""
        return len(self._active)

    @property
    def _staging(self) -> StagingPool:
        """The staging pool of a started transport (released by :meth:`close`)."""
        if self._staging_pool is None:
            raise RuntimeError(f"page transport of {self._links.node_id} is "
                               f"{self._links.state}: no staging")
        return self._staging_pool

    def cancel_receives(self) -> None:
        """The transport stops: cancel every receive task (each cleans up as it ends)."""
        for rx in list(self._receiving.values()):
            if rx.task is not None:   # set before expect() yields: always, in practice
                rx.task.cancel()

    @property
    def staging_pool(self) -> StagingPool | None:
        """The staging pool (None once closed): kept alive by a stop that orphans requests."""
        return self._staging_pool

    def unsettled(self) -> list[Any]:
        """At stop, after the drain: what the requests of each transfer still in flight point
        into (the caller keeps it alive: UCX may still write there), and the pinned staging
        while an H2D copy may still read it."""
        out: list[Any] = [(t.keep, t.arena, t.commit) for t in self._active]
        if self._device.in_flight:
            out.append(self._device.pool.buffer)
        return out

    def close(self) -> None:
        """Let go of the staging pool (a stop that orphans requests keeps it alive) and of
        the H2D copy thread."""
        self._staging_pool = None
        self._device.close()

    # ------------------------------------------------------------------ receive

    async def expect(self, peer: Peer, transfer_id: int, arena: Any,
                     slots: Slots, deadline_s: float) -> ReceiveHandle:
        """Post every receive of ``transfer_id`` from ``peer`` into ``arena`` ``slots`` now.

        ``slots`` are ``(offset, nbytes)`` runs of the flat uint8 ``arena`` (the registered
        pool), in stream order — send the same list to the peer (``PageSlots``). Direct
        messages land in the arena; packed ones (small, non-contiguous runs) in staging, then
        are scattered — those beyond the free staging are posted as staging frees up, in
        order across transfers (:mod:`common.transport.staging`). ``deadline_s`` is the
        budget from now. Device (cupy) arenas take direct messages only. ``await
        handle.wait()`` before reading the arena; after a failure or ``await
        handle.cancel()`` no receive targets it any more. A device arena receiving from a
        peer that sends host memory takes each direct message into pinned staging, then one
        H2D copy (:mod:`common.transport.device_staging`); the handle completes after the
        copies.
        """
        self._links.check_running()
        check_transfer_id(transfer_id)
        if transfer_id in self._receiving or transfer_id in self._retired:
            raise InvalidArgument(f"transfer id {transfer_id} is in use or was aborted; "
                                  "take a new one from new_transfer_id()")
        check_flat_bytes(arena, "arena", writable=True)
        # the slots become one array once: every step after (plan, digest, bounds) takes it
        pairs = slot_array(slots)
        check_within(pairs, int(arena.nbytes))
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline_s
        link = await self._links.link_to((peer[0], peer[1]), deadline_at)
        if transfer_id in self._receiving:
            raise InvalidArgument(f"transfer id {transfer_id} is already expected")
        path = self._shm.path_for(link, arena)
        # messages only for the tag path: a copy or a put needs no message plan
        plan = self._message_plan(pairs, arena) if path == PATH_TAG else []
        rx = Transfer(transfer_id, link, plan, int(pairs[:, 1].sum()), collections.deque(),
                      collections.deque(), arena, keep=arena,
                      staged=stage_to_device(arena, link.peer_device))
        self._receiving[transfer_id] = rx
        self._active.add(rx)
        try:
            if path == PATH_TAG:
                self._post_receives(rx)
            if link.shm_in or link.rma_in:   # the sender waits for our word on how it travels
                self._shm.announce(rx, arena, pairs, path)
        except BaseException as e:
            self._receiving.pop(transfer_id, None)
            self._active.discard(rx)
            raise await self._fail(rx, e, "receive", deadline_s) from e
        receive = self._receive_shm if path != PATH_TAG else self._receive
        rx.task = loop.create_task(receive(rx, deadline_at, deadline_s))
        handle = ReceiveHandle(transfer_id, link.addr, rx.nbytes, rx.task)
        try:  # let the task reach its first await: from then on, cancelling it cleans up
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            await handle.cancel()
            raise
        return handle

    def _message_plan(self, slots: np.ndarray, arena: Any = None) -> list[MessagePlan]:
        """The tag path's messages over ``slots`` (InvalidArgument: too many, or packed ones
        for a device ``arena``)."""
        plan = plan_messages(slots, self._cfg.max_message_bytes, self._cfg.pack_below_bytes)
        if is_device_array(arena) and any(msg.packed for msg in plan):
            raise InvalidArgument("device arenas need direct messages: make the slots "
                                  "contiguous or set transport.pack_below_bytes = 0")
        return plan

    def _post_receives(self, rx: Transfer) -> None:
        u, ep, base = ucxx(), rx.link.ep._ep, rx.transfer_id << INDEX_BITS
        Array, Tag, mask, arena = u.Array, u.Tag, u.Mask, rx.arena
        if rx.link.single_copy:
            buf = np.zeros(COMMIT_BYTES, np.uint8)
            rx.commit = (ep.tag_recv(Array(buf), Tag(base | COMMIT_INDEX), mask), buf)
        if rx.staged:
            rx.keep = (arena, self._device.pool.buffer)   # (allocated on first use)
        for msg in rx.plan:
            if rx.staged:
                if self._device.queue or not self._post_staged(rx, msg):
                    self._device.queue.defer(rx, rx.deferred, msg)   # FIFO, as packed ones
            elif not msg.packed:
                off = msg.pieces[0][0]
                req = ep.tag_recv(Array(arena[off:off + msg.nbytes]), Tag(base | msg.index), mask)
                rx.posted.append((req, msg, None))
            elif self._staging_queue or not self._post_packed(rx, msg):
                # nobody jumps the queue, this transfer's own earlier messages included
                self._staging_queue.defer(rx, rx.deferred, msg)
        self._drain_staging()
        self._progress.kick()

    def _post_packed(self, rx: Transfer, msg: MessagePlan) -> bool:
        stg = self._staging.try_alloc(msg.nbytes)
        if stg is None:
            return False
        u = ucxx()
        try:
            req = rx.link.ep._ep.tag_recv(u.Array(self._staging.view(stg, msg.nbytes)),
                                          u.Tag((rx.transfer_id << INDEX_BITS) | msg.index),
                                          u.Mask)
        except BaseException:
            self._staging.free(stg)  # nothing was posted into it
            raise
        rx.posted.append((req, msg, stg))
        return True

    def _post_staged(self, rx: Transfer, msg: MessagePlan) -> bool:
        """Post direct message ``msg`` of a staged receive into pinned staging (False: no
        room now); its H2D copy starts when it completed (:meth:`_receive_loop`)."""
        pool = self._device.pool
        stg = pool.try_alloc(msg.nbytes)
        if stg is None:
            return False
        u = ucxx()
        try:
            req = rx.link.ep._ep.tag_recv(u.Array(pool.view(stg, msg.nbytes)),
                                          u.Tag((rx.transfer_id << INDEX_BITS) | msg.index),
                                          u.Mask)
        except BaseException:
            pool.free(stg)  # nothing was posted into it
            raise
        rx.posted.append((req, msg, stg))
        return True

    def _drain_staging(self) -> None:
        """Give free staging to waiting packed (and device-staged) receives, oldest first
        (strict FIFO across transfers: see :mod:`common.transport.staging` for the deadlock
        this prevents)."""
        if not self._links.running:
            return
        posted = self._staging_queue.drain(self._post_packed) if self._staging_queue else 0
        if self._device.queue:
            posted += self._device.queue.drain(self._post_staged)
        if posted:
            self._progress.kick()

    def _leave_queues(self, t: Transfer) -> None:
        self._staging_queue.remove(t)
        self._device.queue.remove(t)

    async def _receive(self, rx: Transfer, deadline_at: float, deadline_s: float) -> None:
        try:
            async with asyncio.timeout_at(deadline_at):
                await self._receive_loop(rx)
            self.counts["transfers_received_ok"] += 1
            self.counts["bytes_received"] += rx.nbytes
        except BaseException as e:
            self.counts["transfers_received_failed"] += 1
            raise await self._fail(rx, e, "receive", deadline_s) from e
        finally:
            self._receiving.pop(rx.transfer_id, None)
            self._active.discard(rx)
            self._leave_queues(rx)

    async def _receive_shm(self, rx: Transfer, deadline_at: float, deadline_s: float) -> None:
        """A transfer the sender copies into our segment or puts into our registered region:
        done at its COMMIT; a failure returns only once no copy or put into the slots can run
        (``ShmTransfers.give_up``)."""
        try:
            async with asyncio.timeout_at(deadline_at):
                await self._shm.receive(rx)
            self.counts["transfers_received_ok"] += 1
            self.counts["bytes_received"] += rx.nbytes
        except BaseException as e:
            self.counts["transfers_received_failed"] += 1
            err = self._classify(rx, e, "receive", deadline_s)
            self._retire(rx.transfer_id)
            await _to_the_end(self._shm.give_up(rx))
            log.warning("transfer_failed", side="receive", transfer_id=rx.transfer_id,
                        peer=rx.link.addr, path="rma" if rx.keep[2] == PATH_RMA else "shm",
                        error=err.code.value, detail=err.message)
            raise err from e
        finally:
            self._receiving.pop(rx.transfer_id, None)
            self._active.discard(rx)

    async def _receive_loop(self, rx: Transfer) -> None:
        posted, deferred, copies, staging = rx.posted, rx.deferred, rx.copies, self._staging
        while posted or deferred or copies:
            self._drain_staging()   # deferred messages are posted here, by any transfer's loop
            err = self._staging_queue.failure(rx) or self._device.queue.failure(rx)
            if err is not None:
                raise err
            if copies and copies[0].done:     # an H2D copy ended: its staging is free
                self._device.finish(copies.popleft())
                self._drain_staging()
                continue
            if posted and posted[0][0].completed:
                req, msg, stg = posted.popleft()
                req.check_error()
                self.counts["messages_received"] += 1
                if stg is not None and rx.staged:
                    copies.append(self._device.copy(rx.arena, msg, stg))
                elif stg is not None:
                    self._scatter(rx.arena, msg, stg)
                    staging.free(stg)
                    self._drain_staging()
                continue
            await self._progress.tick()
        if rx.commit is not None:  # the sender saw every message taken: the bytes are good
            req, buf = rx.commit
            while not req.completed:
                await self._progress.tick()
            req.check_error()
            rx.commit = None
            if int(buf.view(np.uint64)[0]) != rx.nbytes:
                raise ProtocolError(f"transfer {rx.transfer_id}: the sender committed "
                                    f"{int(buf.view(np.uint64)[0])} B, expected {rx.nbytes} B")

    def _scatter(self, arena: np.ndarray, msg: MessagePlan, stg: int) -> None:
        src, pos = self._staging.buffer, stg
        for off, n in msg.pieces:
            arena[off:off + n] = src[pos:pos + n]
            pos += n
        self.counts["packed_messages"] += 1
        self.counts["packed_bytes"] += msg.nbytes

    # ------------------------------------------------------------------ send

    async def send(self, peer: Peer, transfer_id: int, src: Sequence[Any],
                   slots: Slots, deadline_s: float,
                   inflight: int | None = None) -> None:
        """Send the concatenation of ``src`` into the receiver's ``slots`` (its PageSlots).

        At most ``inflight`` (default ``cfg.max_inflight_messages``) messages are in flight.
        Device (cupy) sources: synchronize the producing stream first. Returns when every
        message has left (UCX send completion: the buffers are reusable; for rendezvous
        messages the receiver has pulled the bytes).
        A cancelled caller gets ``CancelledError`` after the endpoint was aborted and all
        sends completed; failures raise PeerFailed / DeadlineExceeded / InvalidArgument.
        """
        self._links.check_running()
        check_transfer_id(transfer_id)
        for i, view in enumerate(src):
            check_flat_bytes(view, f"src[{i}]")
        source = SourceMap(src)
        pairs = slot_array(slots)      # once: plan, digest and bounds take the array
        total = int(pairs[:, 1].sum())
        if source.nbytes != total:
            raise InvalidArgument(f"transfer {transfer_id}: source holds {source.nbytes} B but "
                                  f"the receiver's slots hold {total} B")
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline_s
        link = await self._links.link_to((peer[0], peer[1]), deadline_at)
        told = link.shm_out is not None or link.rma_peer   # the receiver says how it travels
        # the tag path's messages, planned (and refused if too many) before anything is sent;
        # a link that may copy or put plans them only if the receiver asks for tags
        tx = Transfer(transfer_id, link, [] if told else self._message_plan(pairs), total,
                      collections.deque(), collections.deque(), keep=tuple(src))
        self._active.add(tx)
        try:
            async with asyncio.timeout_at(deadline_at):
                if told:
                    ready = await self._shm.ready(link, transfer_id)  # (shm_transfers)
                    if ready.path in (PATH_SHM, PATH_RMA):
                        await (self._shm.send if ready.path == PATH_SHM
                               else self._shm.send_rma)(tx, src, pairs, ready)
                        self.counts["transfers_sent_ok"] += 1
                        self.counts["bytes_sent"] += total
                        return
                    tx.plan = self._message_plan(pairs)
                device = any(is_device_array(v) for v in src)
                ep = link.ep if device else await self._links.data_ep(link)
                await self._send_loop(tx, ep, source, device,
                                      inflight or self._cfg.max_inflight_messages)
                if link.single_copy:
                    await self._send_commit(tx)
            self.counts["transfers_sent_ok"] += 1
            self.counts["bytes_sent"] += total
        except BaseException as e:
            self.counts["transfers_sent_failed"] += 1
            err = await self._fail(tx, e, "send", deadline_s)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise err from e
        finally:
            self._active.discard(tx)

    async def _send_loop(self, tx: Transfer, ep: Any, source: SourceMap, device: bool,
                         limit: int) -> None:
        u, staging, window, link = ucxx(), self._staging, tx.posted, tx.link
        ep, base = ep._ep, tx.transfer_id << INDEX_BITS
        Array, Tag, plan, i, count = u.Array, u.Tag, tx.plan, 0, len(tx.plan)
        while i < count or window:
            if not link.usable:  # a data endpoint never reports its peer: the link does
                raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
            posted = reaped = 0
            while i < count and len(window) < limit:
                msg, stg = plan[i], None
                buf = source.single(msg.stream_offset, msg.nbytes)
                if buf is None:
                    if device:
                        raise InvalidArgument("device sources must not split a message across "
                                              "views (no device staging): pass one view")
                    stg = staging.try_alloc(msg.nbytes)
                    if stg is None:
                        break
                    buf = staging.view(stg, msg.nbytes)
                    source.gather_into(buf, msg.stream_offset)
                    self.counts["gathered_bytes"] += msg.nbytes
                window.append((ep.tag_send(Array(buf), Tag(base | i)), msg, stg))
                i += 1
                posted += 1
            if posted:
                self._progress.kick()
            while window and window[0][0].completed:
                req, msg, stg = window.popleft()
                req.check_error()
                if stg is not None:
                    staging.free(stg)
                reaped += 1
            self.counts["messages_sent"] += reaped
            if not posted and not reaped:
                await self._progress.tick()

    async def _send_commit(self, tx: Transfer) -> None:
        """After every message completed (the receiver took every byte): the commit."""
        u, link = ucxx(), tx.link
        if not link.usable:
            raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
        buf = np.array([tx.nbytes], np.uint64).view(np.uint8)
        req = link.ep._ep.tag_send(u.Array(buf), u.Tag((tx.transfer_id << INDEX_BITS) | COMMIT_INDEX))
        tx.posted.append((req, None, None))
        tx.keep = (tx.keep, buf)
        self._progress.kick()
        while not req.completed:
            if not link.usable:
                raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
            await self._progress.tick()
        tx.posted.clear()
        req.check_error()

    # ------------------------------------------------------------------ failure

    async def _fail(self, t: Transfer, exc: BaseException, side: str,
                    deadline_s: float) -> DualpathError:
        """Abort the endpoint, wait until no request of ``t`` is pending, type the error."""
        self._leave_queues(t)  # before any await: no receive is posted for it any more
        err = self._classify(t, exc, side, deadline_s)
        if side == "receive":
            self._retire(t.transfer_id)
        if t.posted or t.deferred or t.commit is not None:
            self._links.abort(t.link, f"{side} of transfer {t.transfer_id} failed: {err.code}")
        if side == "send" and t.link.single_copy:
            self._abandon(t)   # the receiver fails without our commit: buffers are free now
        await self._settle(t)
        if side == "receive":
            self._drain_staging()      # the staging it held goes to the next in line
        log.warning("transfer_failed", side=side, transfer_id=t.transfer_id, peer=t.link.addr,
                    error=err.code.value, detail=err.message)
        return err

    def _classify(self, t: Transfer, exc: BaseException, side: str,
                  deadline_s: float) -> DualpathError:
        what = f"{side} of transfer {t.transfer_id} with {t.link.addr[0]}:{t.link.addr[1]}"
        if isinstance(exc, DualpathError):
            return exc
        if not self._links.running:
            return Cancelled(f"{what}: transport stopping")
        if isinstance(exc, TimeoutError):
            return DeadlineExceeded(f"{what}: deadline of {deadline_s:.3g}s passed with "
                                    f"{len(t.posted) + len(t.deferred)} messages outstanding")
        if isinstance(exc, asyncio.CancelledError):
            return Cancelled(f"{what}: cancelled")
        if isinstance(exc, ucxx().Error):
            cause = t.link.failure or f"{type(exc).__name__}: {exc}"
            return PeerFailed(f"{what}: peer {t.link.node_id or t.link.addr} failed ({cause})")
        return PeerFailed(f"{what}: {type(exc).__name__}: {exc}")

    def _retire(self, transfer_id: int) -> None:
        self._retired[transfer_id] = None
        while len(self._retired) > _RETIRED_IDS:
            self._retired.popitem(last=False)

    def _abandon(self, t: Transfer) -> None:
        """Drop a failed single-copy send's requests: the data endpoint cannot cancel them
        (they complete only if the receiver takes the bytes), and without the commit no
        receiver counts bytes read from these buffers, so they go back to the caller now."""
        for req, _, stg in t.posted:
            if not req.completed:  # (UCX may only read these buffers later, never write)
                self.counts["sends_abandoned"] += 1
            if stg is not None:
                self._staging.free(stg)
        t.posted = collections.deque()

    async def _settle(self, t: Transfer) -> None:
        """Cancelled/aborted requests must complete before buffers go back to the caller."""
        if t.commit is not None:  # posted on the link's endpoint: the abort cancels it
            t.posted.append((t.commit[0], None, None))
            t.keep, t.commit = (t.keep, t.commit[1]), None
        end = time.monotonic() + _SETTLE_S
        while self._links.progress_now() or t.copies:
            pending: collections.deque[tuple[Any, Any, int | None]] = collections.deque()
            for entry in t.posted:
                if not entry[0].completed:
                    pending.append(entry)
                elif entry[2] is not None:
                    (self._device.pool if t.staged else self._staging).free(entry[2])
            t.posted = pending
            # an H2D copy still writes into the caller's arena: wait for it too
            t.copies = collections.deque(c for c in t.copies if not self._device.release(c))
            if (not pending and not t.copies) or time.monotonic() > end:
                break
            await asyncio.sleep(0.001)
        for c in t.copies:        # past the settle time: freed when it ends (logged)
            self._device.abandon(c)
        t.copies.clear()
        t.deferred.clear()
        if t.posted:  # their staging stays allocated and their buffers parked: UCX may still
            log.error("transfer_requests_not_settled", transfer_id=t.transfer_id,  # write
                      pending=len(t.posted))
            packed = self._staging_pool
            for req, _, _ in t.posted:   # (a staged receive's keep holds the pinned buffer)
                self._links.park(req, (t.keep, packed.buffer if packed else None))
            t.posted = collections.deque()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, float]:
        """Counters and gauges of the transfers (part of ``PageTransport.stats``)."""
        out = {k: float(self.counts.get(k, 0)) for k in (
            "bytes_sent", "bytes_received", "messages_sent", "messages_received",
            "transfers_sent_ok", "transfers_sent_failed", "transfers_received_ok",
            "transfers_received_failed", "packed_messages", "packed_bytes", "gathered_bytes",
            "sends_abandoned")}
        staging = self._staging_pool
        out["staging_in_use_bytes"] = float(staging.in_use if staging else 0)
        out["staging_peak_bytes"] = float(staging.peak if staging else 0)
        out["staging_capacity_bytes"] = float(staging.capacity if staging else 0)
        out["transfers_active"] = float(len(self._active))
        out.update(self._shm.stats())
        out.update(self._device.stats())
        return out


async def _to_the_end(coro: Any) -> None:
    """Run ``coro`` to its end even if the caller is cancelled meanwhile (then re-raised)."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError
