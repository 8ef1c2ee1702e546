"""The one-copy same-host protocol of one page transport (docs/datapath.md, "Same host:
one copy"): the receiver says per transfer where the sender copies (READY), the sender
copies every page straight into the receiver's ``/dev/shm`` arena off the event loop and
says it is done (COMMIT); both are small tag messages on the link's endpoint.

Why a READY per transfer: the sender writes with plain stores, so it must know that the
receiver posted *this* transfer (not only that a link exists), into which arena (the segment
may hold several arenas; an arena outside it takes the tag path) and with which slots (a
sender whose slot list differs would scatter pages where the receiver does not expect them;
with tags UCX would refuse the sizes). The services already tell a sender a transfer id only
after ``expect`` returned, so the READY, sent by ``expect`` before it returns, is nearly
always there first; a send waits for it otherwise. A transfer id the sender never sends to
leaves its READY in a bounded table (``shm_ready_dropped`` when it overflows).

Failure semantics: nothing a dead or slow peer does reaches UCX beyond a link's endpoint (no
endpoint without error handling, no remote memory access), so a peer killed mid-copy cannot
abort the survivor. A receiver that gives up (deadline, cancel, link down) takes the fence
(:mod:`common.transport.shm_path`) before its slots go back; the link stays up, and a late
COMMIT for that id is dropped and counted (``shm_commits_dropped``). A sender whose receiver
gave up or died fails typed (``PeerFailed``) and wrote nothing after the fence.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from common.errors import PeerFailed, ProtocolError
from common.transport.links import Links
from common.transport.plan import Slots
from common.transport.shm_path import (COMMIT, CONTROL_BYTES, CONTROL_TAG, PATH_RMA, PATH_SHM,
                                       PATH_TAG, READY, Control, LocalSegment, check_within,
                                       copy_stream, plan_runs, slots_digest)
from common.transport.ucx import Link, Transfer, ucxx
from common.transport.ucx_env import WorkerProgress

log = structlog.get_logger("common.transport")

_RING = 8                  # control receives kept posted
_EARLY_READY = 4096        # READYs kept for sends that have not started
_FENCED = 4096             # given-up transfer ids whose fence this side keeps
_FENCE_POLL_S = 0.001
_SETTLE_S = 5.0            # bound on a give-up waiting for a copy to stop (as transfers')
# One copy by several cores: a transfer of at least _SPLIT_FROM_BYTES is copied by
# _COPY_THREADS threads at once, each a contiguous share of its bytes (one thread's memcpy
# from main memory runs 10-13 GB/s here, two 13-17: docs/datapath.md "Same host: one copy");
# several transfers at once share the same threads.
_COPY_THREADS = 2
_SPLIT_FROM_BYTES = 4 << 20
_PLAN_HERE_SLOTS = 1024    # a copy split over threads is planned on the loop up to this
_COUNTS = ("shm_transfers_sent", "shm_transfers_received", "shm_bytes_sent",
           "shm_bytes_received", "shm_pieces_copied", "shm_transfers_tag_fallback",
           "shm_commits_dropped", "shm_ready_dropped", "shm_fences", "shm_fences_not_settled",
           "shm_sends_refused")


class ShmTransfers:
    """Both sides of the one-copy protocol over the given :class:`Links` (see module doc).

    Made by a starting transport with its progress driver and, when it receives into a
    ``/dev/shm`` arena, that segment; :meth:`close` ends it after the transfers drained.
    """

    def __init__(self, links: Links, progress: WorkerProgress, segment: LocalSegment | None,
                 nonce: int) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.segment, self.nonce = segment, nonce
        self._links, self._progress = links, progress
        self._loop = asyncio.get_running_loop()
        self._ring: collections.deque[tuple[Any, np.ndarray]] = collections.deque()
        self._sends: list[tuple[Any, np.ndarray]] = []          # READYs in flight
        self._commits: dict[int, tuple[Link, asyncio.Future]] = {}
        self._ready: dict[tuple[int, int], tuple[Link, asyncio.Future]] = {}
        self._early: collections.OrderedDict[tuple[int, int], Control] = \
            collections.OrderedDict()
        self._fenced: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._copying: dict[Link, set[threading.Event]] = {}    # copies running, per link
        self._copier = concurrent.futures.ThreadPoolExecutor(_COPY_THREADS, "dualpath-shm-copy")
        self._open = True
        progress.hooks.append(self._on_round)
        links.down_hooks.append(self._link_down)
        links.up_hooks.append(self._fill_ring)

    @staticmethod
    def new_nonce() -> int:
        return secrets.randbits(63) | 1

    # ------------------------------------------------------------------ control messages

    def _fill_ring(self) -> None:
        """Keep ``_RING`` control receives posted. Tag matching is worker-wide, so any link's
        endpoint will do; posting through one (not the worker) is what lets UCX cancel them
        when that link is aborted (at stop: ucxx cannot cancel a worker's own receives)."""
        posted = False
        while self._open and len(self._ring) < _RING:
            link = self._links.usable_link()
            if link is None:
                break  # no link: no control message can come; the next link posts them
            u, buf = ucxx(), np.zeros(CONTROL_BYTES, np.uint8)
            self._ring.append((link.ep._ep.tag_recv(u.Array(buf), u.Tag(CONTROL_TAG), u.Mask),
                               buf))
            posted = True
        if posted:
            self._progress.kick()

    def _on_round(self) -> None:
        """After each progress round: dispatch the control messages that arrived (receives
        complete in the order they were posted; cancelled ones, their link aborted, go)."""
        if any(req.completed for req, _ in self._ring):
            kept: collections.deque[tuple[Any, np.ndarray]] = collections.deque()
            for req, buf in self._ring:
                if req.completed and not _ok(req):
                    continue
                kept.append((req, buf))
            self._ring = kept
            while self._ring and self._ring[0][0].completed:
                self._dispatch(Control.decode(self._ring.popleft()[1]))
            self._fill_ring()
        if self._sends:
            self._sends = [s for s in self._sends if not s[0].completed]

    def _dispatch(self, ctl: Control) -> None:
        if ctl.kind == READY:
            key = (ctl.nonce, ctl.transfer_id)
            waiter = self._ready.pop(key, None)
            if waiter is not None and not waiter[1].done():
                waiter[1].set_result(ctl)
                return
            self._early[key] = ctl
            if len(self._early) > _EARLY_READY:
                (nonce, tid), _ = self._early.popitem(last=False)
                self.counts["shm_ready_dropped"] += 1   # expected: a request that ended
                log.debug("shm_ready_dropped", transfer_id=tid,  # before its sender was told
                          reason="never sent to")
        elif ctl.kind == COMMIT:
            entry = self._commits.get(ctl.transfer_id)
            if entry is None or entry[0].peer_nonce != ctl.nonce or entry[1].done():
                self.counts["shm_commits_dropped"] += 1
                log.warning("shm_commit_dropped", transfer_id=ctl.transfer_id,
                            reason="given up" if ctl.transfer_id in self._fenced
                            else "unknown transfer or sender")
                return
            entry[1].set_result(ctl)
        else:
            log.warning("shm_control_unknown", kind=ctl.kind, transfer_id=ctl.transfer_id)

    def _send_control(self, link: Link, ctl: Control) -> Any:
        u, buf = ucxx(), ctl.encode()
        req = link.ep._ep.tag_send(u.Array(buf), u.Tag(CONTROL_TAG))
        self._sends.append((req, buf))
        self._progress.kick()
        return req

    def _link_down(self, link: Link) -> None:
        """Fail every wait on ``link`` now (a READY or COMMIT it will never bring) and stop
        the copies to its peer at their next piece (its receiver may have given them up)."""
        for stop in self._copying.get(link, ()):
            stop.set()
        for table in (self._commits, self._ready):
            for lk, fut in list(table.values()):
                if lk is link and not fut.done():
                    fut.set_exception(PeerFailed(f"endpoint to {link.addr} is down: "
                                                 f"{link.failure}"))

    # ------------------------------------------------------------------ receive

    def takes(self, arena: Any) -> bool:
        """Whether a receive into ``arena`` can come by copy (it lies in our segment)."""
        return self.segment is not None and self.segment.locate(arena) is not None

    def path_for(self, link: Link, arena: Any) -> int:
        """How a receive into ``arena`` over ``link`` travels: by copy where the peer mapped
        our segment and the arena lies in it, else by RMA where the peer may put into our
        registered region and the arena lies in it, else tag messages."""
        if link.shm_in and self.takes(arena):
            return PATH_SHM
        rma = self._links.rma
        if link.rma_in and rma is not None and rma.locate(arena) is not None:
            return PATH_RMA
        return PATH_TAG

    def announce(self, rx: Transfer, arena: Any, slots: Slots,
                 path: int) -> None:
        """READY: tell the sender how ``rx`` travels (shm or RMA: then await
        :meth:`receive`)."""
        digest = slots_digest(slots)
        offset: int | None = None
        if path == PATH_SHM and self.segment is not None:
            offset = self.segment.locate(arena)
        elif path == PATH_RMA and self._links.rma is not None:
            offset = self._links.rma.locate(arena)
        if path != PATH_TAG:
            self._commits[rx.transfer_id] = (rx.link, self._loop.create_future())
            rx.keep = (rx.keep, digest, path)
        else:
            self.counts["shm_transfers_tag_fallback"] += 1
        self._send_control(rx.link, Control(
            READY, rx.transfer_id, self.nonce, rx.nbytes, digest, path, offset or 0,
            int(arena.nbytes)))

    async def receive(self, rx: Transfer) -> None:
        """Until the sender's COMMIT for ``rx`` (checked against what was posted)."""
        entry = self._commits[rx.transfer_id]
        try:
            ctl: Control = await entry[1]
        finally:
            self._commits.pop(rx.transfer_id, None)
        if ctl.nbytes != rx.nbytes or ctl.digest != rx.keep[1] or ctl.path != rx.keep[2]:
            raise ProtocolError(f"transfer {rx.transfer_id}: the sender committed {ctl.nbytes} B "
                                f"of slots {ctl.digest:x} by path {ctl.path}, expected "
                                f"{rx.nbytes} B of {rx.keep[1]:x} by path {rx.keep[2]}")
        rma = self._links.rma
        if ctl.path == PATH_RMA and rma is not None:
            rma.counts["rma_transfers_received"] += 1
            rma.counts["rma_bytes_received"] += rx.nbytes
        else:
            self.counts["shm_transfers_received"] += 1
            self.counts["shm_bytes_received"] += rx.nbytes

    async def give_up(self, rx: Transfer) -> None:
        """``rx`` failed: once no copy into its slots runs or can start, return (module doc);
        an RMA transfer aborts its link (no put can land after: ``rma_path``)."""
        self._commits.pop(rx.transfer_id, None)
        if rx.keep[2] == PATH_RMA:
            if rx.link.usable:
                self._links.abort(rx.link, f"RMA receive of transfer {rx.transfer_id} "
                                           "given up")
            return
        if self.segment is None or rx.transfer_id in self._fenced:
            return
        fence, end = self.segment.fence, time.monotonic() + _SETTLE_S
        if not fence.try_exclusive(rx.transfer_id):
            # a copy runs: abort the link, so the sender stops at its next piece (its link
            # goes down) rather than finish a transfer nobody waits for
            self._links.abort(rx.link, f"receive of transfer {rx.transfer_id} given up "
                                       "mid-copy")
            while not fence.try_exclusive(rx.transfer_id):
                if time.monotonic() > end:  # a sender stopped mid-copy: as a tag receive
                    self.counts["shm_fences_not_settled"] += 1   # that never settles
                    log.error("shm_fence_not_settled", transfer_id=rx.transfer_id)
                    return
                await asyncio.sleep(_FENCE_POLL_S)
        self.counts["shm_fences"] += 1
        self._fenced[rx.transfer_id] = None
        while len(self._fenced) > _FENCED:
            fence.release(self._fenced.popitem(last=False)[0])

    # ------------------------------------------------------------------ send

    async def ready(self, link: Link, transfer_id: int) -> Control:
        """The receiver's READY for ``transfer_id`` (waits for it; the caller's deadline)."""
        key = (link.peer_nonce, transfer_id)
        ctl = self._early.pop(key, None)
        if ctl is not None:
            return ctl
        if not link.usable:
            raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
        fut = self._loop.create_future()
        self._ready[key] = (link, fut)
        try:
            return await fut
        finally:
            self._ready.pop(key, None)

    async def send(self, tx: Transfer, src: Sequence[Any], slots: Slots,
                   ready: Control) -> None:
        """Copy ``src`` into the receiver's slots, then COMMIT (the caller's deadline)."""
        link, tid = tx.link, tx.transfer_id
        peer = link.shm_out
        digest = slots_digest(slots)
        if ready.nbytes != tx.nbytes or ready.digest != digest:
            raise ProtocolError(f"transfer {tid}: the receiver posted {ready.nbytes} B of slots "
                                f"{ready.digest:x}, this send has {tx.nbytes} B of {digest:x}")
        check_within(slots, ready.span)
        if ready.offset + ready.span > peer.nbytes:
            raise ProtocolError(f"transfer {tid}: arena [{ready.offset}, +{ready.span}) lies "
                                f"outside the peer's segment of {peer.nbytes} B")
        pieces = await self._copy(link, peer, tid, src, slots, ready)
        await self._commit(tx, digest, PATH_SHM, pieces)
        self.counts["shm_transfers_sent"] += 1
        self.counts["shm_bytes_sent"] += tx.nbytes
        self.counts["shm_pieces_copied"] += pieces

    async def _commit(self, tx: Transfer, digest: int, path: int, pieces: int) -> None:
        """COMMIT ``tx`` (every byte is in the receiver's slots) and wait until it left."""
        link = tx.link
        if not link.usable:
            raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
        req = self._send_control(link, Control(COMMIT, tx.transfer_id, self.nonce, tx.nbytes,
                                               digest, path, pieces))
        while not req.completed:
            if not link.usable:
                raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
            await self._progress.tick()
        req.check_error()

    async def send_rma(self, tx: Transfer, src: Sequence[Any],
                       slots: Slots, ready: Control) -> None:
        """Put ``src`` into the receiver's slots (``rma_path``), then COMMIT."""
        link, tid, rma = tx.link, tx.transfer_id, self._links.rma
        digest = slots_digest(slots)
        if ready.nbytes != tx.nbytes or ready.digest != digest:
            raise ProtocolError(f"transfer {tid}: the receiver posted {ready.nbytes} B of slots "
                                f"{ready.digest:x}, this send has {tx.nbytes} B of {digest:x}")
        check_within(slots, ready.span)
        remote = link.rma_out
        if rma is None or remote is None:
            raise PeerFailed(f"transfer {tid}: the receiver asked for RMA, but this side holds "
                             f"no key for {link.addr} (link down: {link.failure})")
        if ready.offset + ready.span > remote.nbytes:
            raise ProtocolError(f"transfer {tid}: arena [{ready.offset}, +{ready.span}) lies "
                                f"outside the peer's registered region of {remote.nbytes} B")
        puts = await rma.put_stream(link, self._links.abort, tid, src, slots, ready.offset)
        await self._commit(tx, digest, PATH_RMA, puts)
        rma.counts["rma_transfers_sent"] += 1
        rma.counts["rma_bytes_sent"] += tx.nbytes

    async def _copy(self, link: Link, peer: Any, tid: int, src: Sequence[Any],
                    slots: Slots, ready: Control) -> int:
        """The copy, in a worker thread, under the fence; a cancelled caller waits for the
        thread to stop (between two pieces) before the fence is released."""
        shares = _COPY_THREADS if ready.nbytes >= _SPLIT_FROM_BYTES else 1
        runs = None                  # one thread plans its own runs
        if shares > 1:               # several walk one plan, made once: here when it is
            # small (~0.1 ms per 1,024 slots, less than a hand-off to a thread), else in a
            # copy thread (nothing writes yet: a cancel here needs no fence)
            runs = plan_runs(src, slots) if len(slots) <= _PLAN_HERE_SLOTS else \
                await self._loop.run_in_executor(self._copier, plan_runs, src, slots)
        if not peer.acquire():
            raise PeerFailed(f"transfer {tid}: the peer's segment was let go (link down)")
        try:
            if not peer.fence.try_share(tid):
                self.counts["shm_sends_refused"] += 1
                raise PeerFailed(f"transfer {tid}: the receiver gave it up before the copy")
            stop = threading.Event()
            copying = self._copying.setdefault(link, set())
            copying.add(stop)
            dst = peer.array[ready.offset:ready.offset + ready.span]
            # done only when every thread ended (return_exceptions): the fence must not be
            # released while one still writes
            job = asyncio.gather(*(self._loop.run_in_executor(
                self._copier, copy_stream, src, dst, slots, stop, share, shares, runs)
                for share in range(shares)), return_exceptions=True)
            try:
                copied = 0
                for outcome in await asyncio.shield(job):
                    if isinstance(outcome, BaseException):
                        raise outcome
                    copied += outcome
                if stop.is_set():
                    raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
                return copied
            except BaseException:
                stop.set()
                while not job.done():
                    try:
                        await asyncio.wait([job])
                    except asyncio.CancelledError:
                        continue      # cancelled again: the copy must still end first
                raise
            finally:
                peer.fence.release(tid)
                copying.discard(stop)
                if not copying:
                    self._copying.pop(link, None)
        finally:
            peer.release()

    # ------------------------------------------------------------------ lifecycle, stats

    def close(self) -> list[Any]:
        """After the links were aborted and the transfers drained: what UCX may still write
        into (the control receives were cancelled with their links)."""
        self._open = False
        if self._on_round in self._progress.hooks:
            self._progress.hooks.remove(self._on_round)
        if self._link_down in self._links.down_hooks:
            self._links.down_hooks.remove(self._link_down)
        if self._fill_ring in self._links.up_hooks:
            self._links.up_hooks.remove(self._fill_ring)
        end = time.monotonic() + 1.0
        while any(not r.completed for r, _ in self._ring) and time.monotonic() < end:
            if not self._links.progress_now():
                break
        pending = [(r, b) for r, b in [*self._ring, *self._sends] if not r.completed]
        self._ring.clear()
        self._sends = []
        self._copier.shutdown(wait=False)
        if self.segment is not None:
            self.segment.close()
        for _, fut in [*self._commits.values(), *self._ready.values()]:
            if not fut.done():
                fut.cancel()
        return pending

    def stats(self) -> dict[str, float]:
        out = {k: float(self.counts.get(k, 0)) for k in _COUNTS}
        out["shm_ready_waiting"] = float(len(self._early))
        out["shm_fences_held"] = float(len(self._fenced))
        return out



def _ok(req: Any) -> bool:
    """Whether a completed control receive holds a message (not cancelled by an abort)."""
    try:
        req.check_error()
    except ucxx().Error:
        return False
    return True
