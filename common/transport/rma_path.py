"""The one-sided RMA path of one page transport (``transport.kv_mode``, docs/datapath.md
"One-sided RMA"): the receiver's arena registered once, the peers' unpacked keys, and the
sender's puts of one transfer.

The protocol around it is the one-copy path's (:mod:`common.transport.shm_transfers`): the
receiver's READY says per transfer that pages come by RMA, where its arena starts in the
registered region and the digest of its slots; the sender puts every piece straight into
the receiver's slots on the link's endpoint, flushes the endpoint (every put is then complete
at the receiver) and sends one COMMIT; the receiver's transfer completes on it. No receive is
posted and no tag matched per page, and non-contiguous slots need no staging.

Failure: a put writes into the receiver's memory without the receiver's code running, so a
receiver that gives a transfer up (deadline, cancel) aborts the link before its slots go back:
on InfiniBand/RoCE that destroys the queue pair (later RDMA writes fail at the sender), over
TCP it closes the connection (queued put data is dropped). A sender that fails part-way aborts
the link too, so UCX completes every put it still holds (the sources go back to the caller),
and the receiver, without the COMMIT, fails. A dead peer fails the waits on its link (the
link's close callback, as for every path).

Where UCX has no one-sided transport for a lane (same host, error handling on: puts go over
tcp/lo as "zero-copy" put and are written by the target's progress; gets are emulated with
active messages) RMA works but is slower than the tag and shm paths: ``kv_mode = "auto"``
uses it only where both ends' KV lane can use verbs (:func:`one_sided_here`), ``"rma"``
everywhere both ends offer it (the tests, and a cluster that measured it faster).
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import structlog

from common.errors import PeerFailed
from common.transport import rma
from common.transport.plan import Slots, is_device_array
from common.transport.shm_path import stream_pieces
from common.transport.ucx import Link
from common.transport.ucx_env import WorkerProgress

log = structlog.get_logger("common.transport")

_WINDOW = 16          # puts of one transfer in flight
_SETTLE_S = 5.0       # bound on waiting for the puts of a failed transfer after the abort
_COUNTS = ("rma_transfers_sent", "rma_transfers_received", "rma_bytes_sent",
           "rma_bytes_received", "rma_puts", "rma_links_unpacked", "rma_unpack_failed")


def verbs_loaded() -> bool:
    """Whether this process's UCX loaded its InfiniBand transports (the PyPI wheel has none)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libuct_ib" in line for line in f)
    except OSError:
        return False


def tls_allows_ib(tls: str | None) -> bool:
    """Whether a ``UCX_TLS`` list (the traffic class's ``TLS``; the environment's wins) lets
    UCX use InfiniBand/RoCE: unset, ``all``, a ``^``-exclusion list without them, or an
    ``rc``/``dc``/``ud``/``ib`` transport named."""
    tls = os.environ.get("UCX_TLS", tls or "")
    names = [t.strip() for t in tls.lstrip("^").split(",") if t.strip()]
    ib = [t for t in names if t.startswith(("rc", "dc", "ud", "ib"))]
    if not names or "all" in names:
        return True
    return not ib if tls.startswith("^") else bool(ib)


def one_sided_here(tls: str | None) -> bool:
    """``kv_mode = "auto"``'s test: RMA is one-sided DMA on this side's KV lane — UCX has its
    verbs transports and the lane's transport list lets it use them."""
    return verbs_loaded() and tls_allows_ib(tls)


class RmaPath:
    """RMA state of one transport: the registered receive arena (None: this side receives
    nothing by RMA) and the remote keys of the links that send by it.

    Made by a starting transport after its UCX context; :meth:`close` (after the links were
    closed, before the context goes) unregisters.
    """

    def __init__(self, mode: str, context_handle: int, arena: np.ndarray | None,
                 progress: WorkerProgress, tls: str | None = None) -> None:
        self.mode = mode
        self.dma = one_sided_here(tls)
        self.counts: collections.Counter[str] = collections.Counter()
        self._progress = progress
        self.region: rma.LocalRegion | None = None
        why = rma.available()
        wanted = mode == "rma" or (mode == "auto" and self.dma)
        if wanted and why is None and arena is not None and not is_device_array(arena):
            self.region = rma.LocalRegion.register(context_handle, arena)
        elif wanted and why is not None:
            log.warning("rma_unavailable", reason=why)
        self.reason = why or ""
        self._remotes: dict[Link, rma.RemoteRegion] = {}

    # ------------------------------------------------------------------ hello, links

    def hello_fields(self) -> dict[str, Any]:
        """What this side's hello says about RMA (plan.TransferHello ``rma_*``)."""
        r = self.region
        return {"rma_mode": self.mode if not self.reason else "tag", "rma_dma": self.dma,
                "rma_rkey": r.rkey if r else b"", "rma_base": r.base if r else 0,
                "rma_bytes": r.nbytes if r else 0}

    def unpack(self, link: Link, rkey: bytes, base: int, nbytes: int) -> rma.RemoteRegion | None:
        """The peer's arena as seen through ``link``'s endpoint; None (logged) if UCX refuses
        the key: that direction then sends tag messages."""
        try:
            remote = rma.RemoteRegion.unpack(link.ep._ep.handle, rkey, base, nbytes)
        except (rma.RmaError, ValueError) as e:
            self.counts["rma_unpack_failed"] += 1
            log.warning("rma_key_refused", peer=link.addr, error=str(e))
            return None
        self._remotes[link] = remote
        self.counts["rma_links_unpacked"] += 1
        return remote

    def forget(self, link: Link) -> None:
        """``link`` went down: its unpacked key goes (before the worker does)."""
        remote = self._remotes.pop(link, None)
        if remote is not None:
            remote.close()
        link.rma_out = None

    def locate(self, arena: Any) -> int | None:
        """Offset of ``arena`` in the registered region, None if it lies elsewhere."""
        r = self.region
        if r is None or is_device_array(arena) or not isinstance(arena, np.ndarray):
            return None
        start = int(arena.__array_interface__["data"][0])
        if r.base <= start and start + arena.nbytes <= r.base + r.nbytes:
            return start - r.base
        return None

    # ------------------------------------------------------------------ send

    async def put_stream(self, link: Link, abort: Any, tid: int, src: Sequence[Any],
                         slots: Slots, offset: int) -> int:
        """Put the concatenation of ``src`` into the receiver's ``slots`` (its arena starts
        ``offset`` bytes into its registered region), then flush; returns the puts issued.
        A failure part-way calls ``abort(link, reason)`` and waits until UCX completed every
        put it holds (their sources may then be reused) before raising."""
        remote = link.rma_out
        if remote is None or not link.usable:
            raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
        window: collections.deque[rma.Request] = collections.deque()
        puts = 0
        try:
            for view, dst in _pieces(src, slots):
                while len(window) >= _WINDOW:
                    await self._reap(link, window)
                req = remote.put(view, offset + dst)
                puts += 1
                if req is not None:
                    window.append(req)
            while window:
                await self._reap(link, window)
            req = rma.flush(link.ep._ep.handle)
            if req is not None:
                window.append(req)
                while window:
                    await self._reap(link, window)
        except BaseException as e:
            await self._settle(link, abort, window, tid, e)
            if isinstance(e, rma.RmaError):
                raise PeerFailed(f"RMA to {link.addr} failed ({e}); link: "
                                 f"{link.failure or 'up'}") from e
            raise
        self.counts["rma_puts"] += puts
        return puts

    async def _reap(self, link: Link, window: collections.deque[rma.Request]) -> None:
        """Wait one progress round; drop the requests done (in order); raise if the link
        went down or a request failed."""
        self._progress.kick()
        await self._progress.tick()
        while window and window[0].done():
            window.popleft()
        if not link.usable:
            raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")

    async def _settle(self, link: Link, abort: Any, window: collections.deque[rma.Request],
                      tid: int, exc: BaseException) -> None:
        if not window:
            return
        abort(link, f"RMA send of transfer {tid} failed: {type(exc).__name__}")
        end = time.monotonic() + _SETTLE_S
        while window and time.monotonic() < end:
            try:
                if window[0].done():
                    window.popleft()
                    continue
            except rma.RmaError:
                window.popleft()
                continue
            self._progress.kick()
            await asyncio.sleep(0.001)
        for req in window:   # still held by UCX past the bound: let UCX finish them
            req.free()
        if window:
            log.error("rma_puts_not_settled", transfer_id=tid, pending=len(window))

    # ------------------------------------------------------------------ lifecycle, stats

    def close(self) -> None:
        for link in list(self._remotes):
            self.forget(link)
        if self.region is not None:
            self.region.close()
            self.region = None

    def stats(self) -> dict[str, float]:
        out = {k: float(self.counts.get(k, 0)) for k in _COUNTS}
        out["rma_region_bytes"] = float(self.region.nbytes if self.region else 0)
        return out


def _pieces(src: Sequence[Any], slots: Slots
            ) -> Iterator[tuple[np.ndarray, int]]:
    """(host view, receiver offset) per piece (``shm_path.stream_pieces``); device views are
    staged through host memory."""
    for part, at in stream_pieces(src, slots):
        yield (part.get() if is_device_array(part) else np.ascontiguousarray(part)), at
