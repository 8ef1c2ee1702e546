"""The transfers of the page transport: the receive side (receives posted in advance,
packed messages through staging), the send side, and what a failure part-way does.

A layer of :class:`common.transport.PageTransport` (its module doc explains the design) on top
of :class:`common.transport_links.LinkTable`. Only ``common/transport*.py`` and
``common/ucxx_handshake.py`` touch ``ucxx`` (docs/contributing.md, 'Layers').
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from common.errors import (Cancelled, DeadlineExceeded, DualpathError, InvalidArgument,
                           PeerFailed, ProtocolError)
from common.transport_links import LinkTable
from common.transport_plan import (COMMIT_BYTES, COMMIT_INDEX, INDEX_BITS, MessagePlan,
                                   SourceMap, check_flat_bytes, check_transfer_id,
                                   is_device_array, plan_messages)
from common.transport_staging import StagingQueue
from common.transport_ucx import Peer, ReceiveHandle
from common.transport_ucx import Transfer as _Transfer
from common.transport_ucx import ucxx as _ucxx

log = structlog.get_logger("common.transport")

_RETIRED_IDS = 4096          # failed transfer ids remembered (never reused)
_SETTLE_S = 5.0              # bound on waiting for cancelled requests to complete


class TransferEngine(LinkTable):
    """Transfers over the links of :class:`LinkTable` (a PageTransport layer)."""

    _staging_queue: StagingQueue[_Transfer, MessagePlan]   # packed receives waiting (FIFO)

    # ------------------------------------------------------------------ receive

    async def expect(self, peer: Peer, transfer_id: int, arena: Any,
                     slots: Sequence[tuple[int, int]], deadline_s: float) -> ReceiveHandle:
        """Post every receive of ``transfer_id`` from ``peer`` into ``arena`` ``slots`` now.

        ``slots`` are ``(offset, nbytes)`` runs of the flat uint8 ``arena`` (the registered
        pool), in stream order — send the same list to the peer (``PageSlots``). Direct
        messages land in the arena; packed ones (small, non-contiguous runs) in staging, then
        are scattered — those beyond the free staging are posted as staging frees up, in
        order across transfers (:mod:`common.transport_staging`). ``deadline_s`` is the
        budget from now. Device (cupy) arenas take direct messages only. ``await
        handle.wait()`` before reading the arena; after a failure or ``await
        handle.cancel()`` no receive targets it any more.
        """
        self._check_running()
        check_transfer_id(transfer_id)
        if transfer_id in self._receiving or transfer_id in self._retired:
            raise InvalidArgument(f"transfer id {transfer_id} is in use or was aborted; "
                                  "take a new one from new_transfer_id()")
        check_flat_bytes(arena, "arena", writable=True)
        plan = plan_messages(slots, self._cfg.max_message_bytes, self._cfg.pack_below_bytes)
        self._check_slots(plan, arena)
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline_s
        link = await self._link_to((peer[0], peer[1]), deadline_at)
        if transfer_id in self._receiving:
            raise InvalidArgument(f"transfer id {transfer_id} is already expected")
        rx = _Transfer(transfer_id, link, plan, plan[-1].stream_end if plan else 0,
                       collections.deque(), collections.deque(), arena, keep=arena)
        self._receiving[transfer_id] = rx
        self._active.add(rx)
        try:
            self._post_receives(rx)
        except BaseException as e:
            self._receiving.pop(transfer_id, None)
            self._active.discard(rx)
            raise await self._fail(rx, e, "receive", deadline_s) from e
        rx.task = loop.create_task(self._receive(rx, deadline_at, deadline_s))
        handle = ReceiveHandle(transfer_id, link.addr, rx.nbytes, rx.task)
        try:  # let the task reach its first await: from then on, cancelling it cleans up
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            await handle.cancel()
            raise
        return handle

    def _check_slots(self, plan: list[MessagePlan], arena: Any) -> None:
        size = int(arena.nbytes)
        for msg in plan:
            if msg.packed and is_device_array(arena):
                raise InvalidArgument("device arenas need direct messages: make the slots "
                                      "contiguous or set transport.pack_below_bytes = 0")
            for off, n in msg.pieces:
                if off + n > size:
                    raise InvalidArgument(f"slot ({off}, {n}) ends beyond the arena ({size} B)")

    def _post_receives(self, rx: _Transfer) -> None:
        u, ep, base = _ucxx(), rx.link.ep._ep, rx.transfer_id << INDEX_BITS
        Array, Tag, mask, arena = u.Array, u.Tag, u.Mask, rx.arena
        if rx.link.single_copy:
            buf = np.zeros(COMMIT_BYTES, np.uint8)
            rx.commit = (ep.tag_recv(Array(buf), Tag(base | COMMIT_INDEX), mask), buf)
        for msg in rx.plan:
            if not msg.packed:
                off = msg.pieces[0][0]
                req = ep.tag_recv(Array(arena[off:off + msg.nbytes]), Tag(base | msg.index), mask)
                rx.posted.append((req, msg, None))
            elif self._staging_queue or not self._post_packed(rx, msg):
                # nobody jumps the queue, this transfer's own earlier messages included
                self._staging_queue.defer(rx, rx.deferred, msg)
        self._drain_staging()
        self._progress.kick()

    def _post_packed(self, rx: _Transfer, msg: MessagePlan) -> bool:
        stg = self._staging.try_alloc(msg.nbytes)
        if stg is None:
            return False
        u = _ucxx()
        try:
            req = rx.link.ep._ep.tag_recv(u.Array(self._staging.view(stg, msg.nbytes)),
                                          u.Tag((rx.transfer_id << INDEX_BITS) | msg.index),
                                          u.Mask)
        except BaseException:
            self._staging.free(stg)  # nothing was posted into it
            raise
        rx.posted.append((req, msg, stg))
        return True

    def _drain_staging(self) -> None:
        """Give free staging to waiting packed receives, oldest first (strict FIFO across
        transfers: see :mod:`common.transport_staging` for the deadlock this prevents)."""
        if self._staging_queue and self._state == "running" and \
                self._staging_queue.drain(self._post_packed):
            self._progress.kick()

    async def _receive(self, rx: _Transfer, deadline_at: float, deadline_s: float) -> None:
        try:
            async with asyncio.timeout_at(deadline_at):
                await self._receive_loop(rx)
            self._n["transfers_received_ok"] += 1
            self._n["bytes_received"] += rx.nbytes
        except BaseException as e:
            self._n["transfers_received_failed"] += 1
            raise await self._fail(rx, e, "receive", deadline_s) from e
        finally:
            self._receiving.pop(rx.transfer_id, None)
            self._active.discard(rx)
            self._staging_queue.remove(rx)

    async def _receive_loop(self, rx: _Transfer) -> None:
        posted, deferred, staging = rx.posted, rx.deferred, self._staging
        while posted or deferred:
            self._drain_staging()   # deferred messages are posted here, by any transfer's loop
            err = self._staging_queue.failure(rx)
            if err is not None:
                raise err
            if posted and posted[0][0].completed:
                req, msg, stg = posted.popleft()
                req.check_error()
                self._n["messages_received"] += 1
                if stg is not None:
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
        self._n["packed_messages"] += 1
        self._n["packed_bytes"] += msg.nbytes

    # ------------------------------------------------------------------ send

    async def send(self, peer: Peer, transfer_id: int, src: Sequence[Any],
                   slots: Sequence[tuple[int, int]], deadline_s: float,
                   inflight: int | None = None) -> None:
        """Send the concatenation of ``src`` into the receiver's ``slots`` (its PageSlots).

        At most ``inflight`` (default ``cfg.max_inflight_messages``) messages are in flight.
        Device (cupy) sources: synchronize the producing stream first. Returns when every
        message has left (UCX send completion: the buffers are reusable; for rendezvous
        messages the receiver has pulled the bytes).
        A cancelled caller gets ``CancelledError`` after the endpoint was aborted and all
        sends completed; failures raise PeerFailed / DeadlineExceeded / InvalidArgument.
        """
        self._check_running()
        check_transfer_id(transfer_id)
        for i, view in enumerate(src):
            check_flat_bytes(view, f"src[{i}]")
        source = SourceMap(src)
        plan = plan_messages(slots, self._cfg.max_message_bytes, self._cfg.pack_below_bytes)
        total = plan[-1].stream_end if plan else 0
        if source.nbytes != total:
            raise InvalidArgument(f"transfer {transfer_id}: source holds {source.nbytes} B but "
                                  f"the receiver's slots hold {total} B")
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline_s
        link = await self._link_to((peer[0], peer[1]), deadline_at)
        tx = _Transfer(transfer_id, link, plan, total, collections.deque(), collections.deque(),
                       keep=tuple(src))
        self._active.add(tx)
        try:
            async with asyncio.timeout_at(deadline_at):
                device = any(is_device_array(v) for v in src)
                ep = link.ep if device else await self._data_ep(link)
                await self._send_loop(tx, ep, source, device,
                                      inflight or self._cfg.max_inflight_messages)
                if link.single_copy:
                    await self._send_commit(tx)
            self._n["transfers_sent_ok"] += 1
            self._n["bytes_sent"] += total
        except BaseException as e:
            self._n["transfers_sent_failed"] += 1
            err = await self._fail(tx, e, "send", deadline_s)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise err from e
        finally:
            self._active.discard(tx)

    async def _send_loop(self, tx: _Transfer, ep: Any, source: SourceMap, device: bool,
                         limit: int) -> None:
        u, staging, window, link = _ucxx(), self._staging, tx.posted, tx.link
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
                    self._n["gathered_bytes"] += msg.nbytes
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
            self._n["messages_sent"] += reaped
            if not posted and not reaped:
                await self._progress.tick()

    async def _send_commit(self, tx: _Transfer) -> None:
        """After every message completed (the receiver took every byte): the commit."""
        u, link = _ucxx(), tx.link
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

    async def _fail(self, t: _Transfer, exc: BaseException, side: str,
                    deadline_s: float) -> DualpathError:
        """Abort the endpoint, wait until no request of ``t`` is pending, type the error."""
        self._staging_queue.remove(t)  # before any await: no receive is posted for it any more
        err = self._classify(t, exc, side, deadline_s)
        if side == "receive":
            self._retire(t.transfer_id)
        if t.posted or t.deferred or t.commit is not None:
            self._abort_link(t.link, f"{side} of transfer {t.transfer_id} failed: {err.code}")
        if side == "send" and t.link.single_copy:
            self._abandon(t)   # the receiver fails without our commit: buffers are free now
        await self._settle(t)
        if side == "receive":
            self._drain_staging()      # the staging it held goes to the next in line
        log.warning("transfer_failed", side=side, transfer_id=t.transfer_id, peer=t.link.addr,
                    error=err.code.value, detail=err.message)
        return err

    def _classify(self, t: _Transfer, exc: BaseException, side: str,
                  deadline_s: float) -> DualpathError:
        what = f"{side} of transfer {t.transfer_id} with {t.link.addr[0]}:{t.link.addr[1]}"
        if isinstance(exc, DualpathError):
            return exc
        if self._state != "running":
            return Cancelled(f"{what}: transport stopping")
        if isinstance(exc, TimeoutError):
            return DeadlineExceeded(f"{what}: deadline of {deadline_s:.3g}s passed with "
                                    f"{len(t.posted) + len(t.deferred)} messages outstanding")
        if isinstance(exc, asyncio.CancelledError):
            return Cancelled(f"{what}: cancelled")
        if isinstance(exc, _ucxx().Error):
            cause = t.link.failure or f"{type(exc).__name__}: {exc}"
            return PeerFailed(f"{what}: peer {t.link.node_id or t.link.addr} failed ({cause})")
        return PeerFailed(f"{what}: {type(exc).__name__}: {exc}")

    def _retire(self, transfer_id: int) -> None:
        self._retired[transfer_id] = None
        while len(self._retired) > _RETIRED_IDS:
            self._retired.popitem(last=False)

    def _abandon(self, t: _Transfer) -> None:
        """Drop a failed single-copy send's requests: the data endpoint cannot cancel them
        (they complete only if the receiver takes the bytes), and without the commit no
        receiver counts bytes read from these buffers, so they go back to the caller now."""
        for req, _, stg in t.posted:
            if not req.completed:  # (UCX may only read these buffers later, never write)
                self._n["sends_abandoned"] += 1
            if stg is not None:
                self._staging.free(stg)
        t.posted = collections.deque()

    async def _settle(self, t: _Transfer) -> None:
        """Cancelled/aborted requests must complete before buffers go back to the caller."""
        if t.commit is not None:  # posted on the link's endpoint: the abort cancels it
            t.posted.append((t.commit[0], None, None))
            t.keep, t.commit = (t.keep, t.commit[1]), None
        end = time.monotonic() + _SETTLE_S
        while self._ctx is not None:
            self._ctx.worker.progress()
            pending: collections.deque[tuple[Any, Any, int | None]] = collections.deque()
            for entry in t.posted:
                if not entry[0].completed:
                    pending.append(entry)
                elif entry[2] is not None:
                    self._staging.free(entry[2])
            t.posted = pending
            if not pending or time.monotonic() > end:
                break
            await asyncio.sleep(0.001)
        t.deferred.clear()
        if t.posted:  # their staging stays allocated and their buffers parked: UCX may still
            log.error("transfer_requests_not_settled", transfer_id=t.transfer_id,  # write
                      pending=len(t.posted))
            for req, _, _ in t.posted:
                self._park(req, (t.keep, self._staging_pool.buffer if self._staging_pool else None))
            t.posted = collections.deque()
