"""Requester side of a storage gateway: the PE receiver's / DE loader's (and tests') handle.

Control goes over an ``RpcClient`` to the gateway; bytes over the caller's own
``PageTransport`` into (reads) or out of (writes) the caller's buffers. A read posts every
receive *before* it sends ``ReadBlocks`` (the gateway writes into them as soon as it has a
batch) and, on any failure, cancels the receives that are still posted before raising, so
the caller may reuse its pages as soon as the call returns.

Destination slots are ``(offset, nbytes)`` runs in the caller's flat arena, one list per
block holding exactly one Full Block. ``layout_slots`` gives them for a request region laid
out ``[L, tokens, B]``; with ``layer_major=True`` each batch then travels as one message per
layer (see ``common.protocol.ReadBatch``).

Limits (issue #16): the gateway refuses any request above the bounds it states in
``GatewayLimits`` (batch bytes and slots, keys and bytes per request, frame size). The client
asks for them once per RPC connection and builds nothing above them: batches shrink, and a
read or write too big for one request becomes several calls answered as one reply.

Same host: when the arena lies in a shared-memory segment (``common.shm``; the node services'
pools do when ``[gateway] shm = true``), reads name the segment and the gateway preads straight
into the slots — no receives, no UCX, one copy. If the gateway cannot open the segment
(another host or container) it answers ``ShmUnavailable``; the client logs that once, remembers
it and uses UCX from then on. A shared-memory read that fails on this side (deadline,
cancellation, lost connection) sends ``ShmFence`` before raising, so the gateway is known to
have stopped writing into the slots when the call returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import asyncio
import time
from typing import Any

import numpy as np
import structlog

from common.config import RpcConfig
from common import shm as shm_mod
from common.errors import InvalidArgument, ProtocolError
from common.kv import KVSpec, validate_keys
from common.protocol import (BlocksWritten, GatewayLimits, GatewayReply, GetLimits, GetStats,
                             LookupPrefix, LookupPrefixReply, Ping, ReadBatch, ReadBlocks,
                             ReadBlocksReply, ShmFence, ShmUnavailable, WatchTelemetry,
                             WriteBlocks, WriteSlots)
from common.rpc import RpcClient, RpcStream
from common.transport import PageTransport, Peer

log = structlog.get_logger(__name__)

Slots = list[tuple[int, int]]
MiB = 1024 * 1024


def layout_slots(spec: KVSpec, base: int, tokens: int, n_blocks: int,
                 first_block: int = 0) -> list[Slots]:
    """Per-layer slots of blocks ``first_block..`` in an ``[L, tokens, B]`` region at ``base``."""
    if (first_block + n_blocks) * spec.block_tokens > tokens:
        raise InvalidArgument(f"a region of {tokens} tokens cannot hold blocks up to "
                              f"{first_block + n_blocks}")
    lb, row = spec.layer_block_bytes, tokens * spec.kv_bytes_per_token_per_layer
    return [[(base + layer * row + i * lb, lb) for layer in range(spec.num_layers)]
            for i in range(first_block, first_block + n_blocks)]


def block_slots(base: int, block_bytes: int, n_blocks: int) -> list[Slots]:
    """Slots of ``n_blocks`` Full Blocks stored one after another from ``base``."""
    return [[(base + i * block_bytes, block_bytes)] for i in range(n_blocks)]


def _by_layer(slots: Slots, spec: KVSpec) -> list[Slots]:
    """One block's slots cut at layer boundaries: the pieces of layer 0, of layer 1, ..."""
    lb, pos = spec.layer_block_bytes, 0
    out: list[Slots] = [[] for _ in range(spec.num_layers)]
    for off, n in slots:
        while n > 0:
            layer = pos // lb
            take = min(n, (layer + 1) * lb - pos)
            out[layer].append((off, take))
            off, n, pos = off + take, n - take, pos + take
    return out


def plan_batches(spec: KVSpec, dest_slots: Sequence[Slots], batch_bytes: int,
                 layer_major: bool = False, *, max_slots: int | None = None,
                 coalesce: bool = False) -> list[tuple[int, Slots]]:
    """``(n_keys, slots)`` of each batch: at most ``batch_bytes`` worth of blocks (at least
    one) in at most ``max_slots`` slots — fewer blocks where the slots are fragmented.

    ``coalesce`` merges slots that continue each other (same bytes, same places, fewer slots:
    a ``[L, tokens, B]`` region read layer-major needs one slot per layer per batch).
    """
    per = max(1, batch_bytes // spec.full_block_bytes)
    if coalesce and dest_slots:
        planned = _plan_closed_form(spec, dest_slots, per, layer_major, max_slots)
        if planned is not None:
            return planned
    return _plan_block_by_block(spec, dest_slots, per, layer_major, max_slots, coalesce)


def _plan_block_by_block(spec: KVSpec, dest_slots: Sequence[Slots], per: int, layer_major: bool,
                         max_slots: int | None, coalesce: bool) -> list[tuple[int, Slots]]:
    """Blocks added one at a time: a batch closes early when the next block would take it
    above ``max_slots`` (fragmented slots)."""
    bb = spec.full_block_bytes
    for i, slots in enumerate(dest_slots):
        if sum(n for _, n in slots) != bb or any(o < 0 or n < 0 for o, n in slots):
            raise InvalidArgument(f"destination {i}: slots must hold exactly one Full Block "
                                  f"({bb} B)")
    out: list[tuple[int, Slots]] = []
    batch = _BatchSlots(spec.num_layers if layer_major else 1, coalesce)
    for i, slots in enumerate(dest_slots):
        block = _by_layer(slots, spec) if layer_major else [list(slots)]
        if batch.n and (batch.n == per or (max_slots is not None
                                           and batch.count_with(block) > max_slots)):
            out.append((batch.n, batch.slots()))
            batch = _BatchSlots(len(block), coalesce)
        if max_slots is not None and batch.count_with(block) > max_slots:
            raise InvalidArgument(f"destination {i}: one Full Block in {batch.count_with(block)} "
                                  f"slots, above the gateway's limit of {max_slots} per batch "
                                  "— use fewer, larger pages")
        batch.add(block)
    if batch.n:
        out.append((batch.n, batch.slots()))
    return out


def _plan_closed_form(spec: KVSpec, dest_slots: Sequence[Slots], per: int, layer_major: bool,
                      max_slots: int | None) -> list[tuple[int, Slots]] | None:
    """``plan_batches`` with ``coalesce`` for a whole read in a few numpy operations (the
    per-block loop cost the requester ~0.03 s/GB, docs/performance.md): batches of ``per``
    blocks, each batch's stream cut into pieces (at layer boundaries when layer-major), put in
    stream order and merged where they continue each other. None when a batch would need more
    than ``max_slots`` slots, or a destination is malformed: the block-by-block loop then
    shrinks the batches (or names the bad destination) exactly as before."""
    bb, lb = spec.full_block_bytes, spec.layer_block_bytes
    counts = np.fromiter((len(s) for s in dest_slots), np.int64, len(dest_slots))
    flat = np.array([p for s in dest_slots for p in s], np.int64).reshape(-1, 2)
    if len(flat) == 0 or counts.min() == 0 or flat.min() < 0 \
            or not (np.add.reduceat(flat[:, 1], np.cumsum(counts) - counts) == bb).all():
        return None
    so, sn = flat[flat[:, 1] > 0].T                      # empty slots carry nothing
    sstart = np.cumsum(sn) - sn                          # stream position of each slot
    total = len(dest_slots) * bb
    cuts = np.union1d(sstart, np.arange(0, total, lb if layer_major else bb, dtype=np.int64))
    j = np.searchsorted(sstart, cuts, "right") - 1
    off, length = so[j] + (cuts - sstart[j]), np.diff(cuts, append=total)
    chunk = cuts // bb // per
    part = cuts % bb // lb if layer_major else np.zeros_like(cuts)
    order = np.lexsort((cuts, part, chunk))              # a batch's stream: part, block, byte
    off, length, chunk, part = off[order], length[order], chunk[order], part[order]
    follows = np.zeros(len(off), bool)
    follows[1:] = (off[1:] == off[:-1] + length[:-1]) & (chunk[1:] == chunk[:-1])
    same_part = np.zeros(len(off), bool)
    same_part[1:] = part[1:] == part[:-1]
    n_chunks = int(chunk[-1]) + 1
    if max_slots is not None:    # the loop's count: runs merged within a part, not across
        if np.bincount(chunk[~(follows & same_part)], minlength=n_chunks).max() > max_slots:
            return None
    first = np.flatnonzero(~follows)
    m_off, m_len = off[first].tolist(), np.add.reduceat(length, first).tolist()
    bounds = np.searchsorted(chunk[first], np.arange(n_chunks + 1)).tolist()
    n_blocks = len(dest_slots)
    return [(min(per, n_blocks - c * per),
             list(zip(m_off[bounds[c]:bounds[c + 1]], m_len[bounds[c]:bounds[c + 1]])))
            for c in range(n_chunks)]


class _BatchSlots:
    """The slots of one batch as it grows block by block: one run list per stream part (per
    layer when layer-major), so a slot count is known before a block is added."""

    def __init__(self, parts: int, coalesce: bool) -> None:
        self.runs: list[Slots] = [[] for _ in range(parts)]
        self.coalesce = coalesce
        self.n = self.count = 0

    def _new_runs(self, runs: Slots, pieces: Slots) -> int:
        if not self.coalesce:
            return len(pieces)
        end, add = (runs[-1][0] + runs[-1][1]) if runs else -1, 0
        for off, k in pieces:
            if k:
                add += off != end
                end = off + k
        return add

    def count_with(self, block: list[Slots]) -> int:
        """Slots once ``block`` is added (an upper bound when coalescing: runs that continue
        across layers are merged only by ``slots()``)."""
        return self.count + sum(self._new_runs(r, p) for r, p in zip(self.runs, block))

    def add(self, block: list[Slots]) -> None:
        self.count = self.count_with(block)
        self.n += 1
        for runs, pieces in zip(self.runs, block):
            for off, k in pieces:
                if self.coalesce and runs and runs[-1][0] + runs[-1][1] == off:
                    runs[-1] = (runs[-1][0], runs[-1][1] + k)
                elif not (self.coalesce and k == 0):
                    runs.append((off, k))

    def slots(self) -> Slots:
        out: Slots = []
        for off, k in (p for runs in self.runs for p in runs):
            if self.coalesce and out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + k)
            else:
                out.append((off, k))
        return out


# Upper bounds of the msgpack encoding, for keeping a request under rpc.max_frame_bytes: a
# key is a 32-char str (2-byte header); a slot a 2-array of ints of at most 9 bytes each; a
# ReadBatch (array_like) its header, transfer id, n_keys, list header and flag; the rest of a
# request (envelope, field names, ports) fits in REQUEST_WIRE plus its strings.
KEY_WIRE, SLOT_WIRE, BATCH_WIRE, REQUEST_WIRE = 34, 19, 32, 512


def read_calls(plan: list[tuple[int, Slots]], limits: GatewayLimits,
               fixed_bytes: int) -> list[list[tuple[int, Slots]]]:
    """The batches of a read grouped into ReadBlocks calls under the gateway's per-request
    limits: keys, bytes, and the encoded size (``fixed_bytes``: the request's strings)."""
    calls: list[list[tuple[int, Slots]]] = []
    keys = size = 0
    frame = limits.max_frame_bytes - REQUEST_WIRE - fixed_bytes
    for n, slots in plan:
        wire = n * KEY_WIRE + BATCH_WIRE + len(slots) * SLOT_WIRE
        if wire > frame:
            raise InvalidArgument(f"a batch of {n} blocks in {len(slots)} slots cannot fit "
                                  f"the gateway's rpc.max_frame_bytes ({limits.max_frame_bytes})")
        if not calls or keys + n > limits.max_keys_per_request or size + wire > frame \
                or (keys + n) * limits.block_bytes > limits.max_bytes_per_request:
            calls.append([])
            keys = size = 0
        calls[-1].append((n, slots))
        keys, size = keys + n, size + wire
    return calls


def write_call_blocks(limits: GatewayLimits, fixed_bytes: int) -> int:
    """Keys per WriteBlocks so that even if every block is new the gateway accepts it."""
    by_bytes = min(limits.max_batch_bytes, limits.max_bytes_per_request) // limits.block_bytes
    by_frame = (limits.max_frame_bytes - REQUEST_WIRE - fixed_bytes) // KEY_WIRE
    return max(1, min(by_bytes, limits.max_keys_per_request, by_frame))


def combine_reads(request_id: str, replies: list[ReadBlocksReply]) -> ReadBlocksReply:
    """One reply for a read that took several ReadBlocks calls (key order kept)."""
    if len(replies) == 1:
        return replies[0]
    found = [f for r in replies for f in r.found]
    prefix = next((i for i, f in enumerate(found) if not f), len(found))
    return ReadBlocksReply(request_id, found, prefix, sum(r.corrupt for r in replies),
                           sum(r.nbytes for r in replies), sum(r.queued_s for r in replies),
                           sum(r.read_s for r in replies), replies[-1].read_q_tokens)


class GatewayClient:
    """One gateway, seen from a requester with its own transport and arena."""

    def __init__(self, rpc: RpcClient, transport: PageTransport, arena: Any, spec: KVSpec,
                 gateway_ucx: Peer | None = None, *, shm: bool | None = None,
                 fence_timeout_s: float = 5.0) -> None:
        """``shm``: None (default) = read through shared memory iff ``arena`` lies in a live
        ``common.shm`` segment; False = always UCX; True = require a segment arena."""
        self.rpc = rpc
        self.transport = transport
        self.arena = arena
        self.spec = spec
        self._gateway_ucx = gateway_ucx
        self._ucx_asked_on: Any = None      # the RPC connection the cached UCX address came from
        self._limits: GatewayLimits | None = None
        self._limits_asked_on: Any = None   # the RPC connection the cached limits came from
        self._shm = shm_mod.segment_of(arena) if shm is not False else None
        if shm is True and self._shm is None:
            raise InvalidArgument("shm=True needs an arena inside a common.shm segment")
        self.fence_timeout_s = fence_timeout_s
        self.counts = dict.fromkeys(("shm_reads", "ucx_reads", "shm_fallbacks", "shm_fences"), 0)

    @classmethod
    def connect(cls, cfg: RpcConfig, host: str, port: int, transport: PageTransport, arena: Any,
                spec: KVSpec, *, node_id: str, role: str = "requester",
                auth_secret: bytes | None = None, shm: bool | None = None) -> GatewayClient:
        """A client for the gateway whose RPC server is ``host:port`` (connects lazily)."""
        rpc = RpcClient(cfg, host, port, role=role, node_id=node_id, reply_type=GatewayReply,
                        kv_fingerprint=spec.fingerprint(), auth_secret=auth_secret)
        return cls(rpc, transport, arena, spec, shm=shm)

    async def close(self) -> None:
        await self.rpc.close()

    @property
    def shm_active(self) -> bool:
        """Whether reads go through shared memory (False after a ShmUnavailable answer)."""
        return self._shm is not None

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def gateway_ucx(self) -> Peer:
        """The gateway's UCX address (its ``ucx_port`` stat on the RPC host), asked again after
        a reconnect: a restarted gateway listens on a new UCX port (chaos tests)."""
        asked = self._ucx_asked_on
        if self._gateway_ucx is None or (asked is not None and (
                not self.rpc.connected or self.rpc.peer is not asked)):
            counters = await self.stats()
            self._gateway_ucx = (self.rpc.address.rsplit(":", 1)[0], int(counters["ucx_port"]))
            self._ucx_asked_on = self.rpc.peer
        return self._gateway_ucx

    async def limits(self, timeout: float | None = None) -> GatewayLimits:
        """The bounds the gateway holds each request to, asked once per RPC connection (again
        after a reconnect: a restarted gateway may run with another config)."""
        asked = self._limits_asked_on
        if self._limits is None or not self.rpc.connected or self.rpc.peer is not asked:
            limits = await self.rpc.call(GetLimits(), timeout)
            if not isinstance(limits, GatewayLimits) or limits.block_bytes != self.spec.full_block_bytes:
                raise ProtocolError(f"gateway {self.rpc.address} stated limits {limits!r} for "
                                    f"another block size than {self.spec.full_block_bytes} B")
            self._limits, self._limits_asked_on = limits, self.rpc.peer
        return self._limits

    # ------------------------------------------------------------------ control
    async def ping(self, timeout: float | None = None) -> None:
        await self.rpc.call(Ping(), timeout)

    async def stats(self, timeout: float | None = None) -> dict[str, float]:
        return (await self.rpc.call(GetStats(), timeout)).counters

    async def lookup_prefix(self, keys: Sequence[str], timeout: float | None = None) -> LookupPrefixReply:
        return await self.rpc.call(LookupPrefix(list(keys)), timeout)

    def watch_telemetry(self, interval_s: float = 0.5, timeout: float = 86_400.0) -> RpcStream:
        """``async for t in client.watch_telemetry(0.1):`` — GatewayTelemetry events."""
        return self.rpc.stream(WatchTelemetry(interval_s), timeout)

    # ------------------------------------------------------------------ reads
    async def read_blocks(self, request_id: str, keys: Sequence[str], dest_slots: Sequence[Slots],
                          deadline_s: float, batch_bytes: int = 8 * MiB,
                          layer_major: bool = False) -> ReadBlocksReply:
        """Read ``keys`` into the arena at ``dest_slots`` (one slot list per key).

        Batches hold at most ``batch_bytes`` and never more than the gateway's stated limits
        allow (``limits()``); a read above its per-request limits takes several ReadBlocks
        calls, one after another, answered as one reply. Blocks not found arrive as zeros and
        are flagged in ``reply.found``; the usable hit is ``reply.prefix_blocks``. Raises the
        gateway's typed error, or the transport's (PeerFailed, DeadlineExceeded) — never with
        a receive still posted.
        """
        keys = validate_keys(keys)
        if len(dest_slots) != len(keys):
            raise InvalidArgument(f"need one destination per key: {len(keys)} keys, "
                                  f"{len(dest_slots)} destinations")
        left = _budget(deadline_s)
        calls = self._plan_read(request_id, dest_slots, batch_bytes, layer_major,
                                await self.limits(left()))
        if self._shm is not None:
            reply = await self._read_shm(request_id, keys, dest_slots, calls, layer_major, left)
            if reply is not None:
                return reply
        self.counts["ucx_reads"] += 1
        gateway = await self.gateway_ucx()
        replies, first = [], 0
        for call in calls:
            n = sum(k for k, _ in call)
            replies.append(await self._read_ucx(gateway, request_id, keys[first:first + n], call,
                                                layer_major, left()))
            first += n
        return combine_reads(request_id, replies)

    def _plan_read(self, request_id: str, dest_slots: Sequence[Slots], batch_bytes: int,
                   layer_major: bool, limits: GatewayLimits) -> list[list[tuple[int, Slots]]]:
        """Batches under max_batch_bytes / max_slots_per_batch, grouped into calls under the
        per-request limits (a batch also shrinks so that one fits a frame on its own)."""
        bb = self.spec.full_block_bytes
        fixed = len(request_id.encode()) + len(self.transport.address[0]) + \
            (len(self._shm[0].name) if self._shm is not None else 0)
        per_call = min(limits.max_keys_per_request, limits.max_bytes_per_request // bb)
        batch = min(batch_bytes, limits.max_batch_bytes, max(per_call, 1) * bb)
        frame_slots = (limits.max_frame_bytes - REQUEST_WIRE - fixed - BATCH_WIRE
                       - KEY_WIRE * max(1, batch // bb)) // SLOT_WIRE
        plan = plan_batches(self.spec, dest_slots, batch, layer_major, coalesce=True,
                            max_slots=max(1, min(limits.max_slots_per_batch, frame_slots)))
        return read_calls(plan, limits, fixed)

    async def _read_ucx(self, gateway: Peer, request_id: str, keys: list[str],
                        call: list[tuple[int, Slots]], layer_major: bool,
                        deadline_s: float) -> ReadBlocksReply:
        """One ReadBlocks call over UCX: post every receive, ask, wait for the bytes."""
        handles, batches = [], []
        try:
            for n, slots in call:
                tid = self.transport.new_transfer_id()
                handles.append(await self.transport.expect(gateway, tid, self.arena, slots, deadline_s))
                batches.append(ReadBatch(tid, n, slots, layer_major))
            host, port = self.transport.address
            reply = await self.rpc.call(ReadBlocks(request_id, keys, host, port, batches), deadline_s)
            for h in handles:
                await h.wait()
        except BaseException:
            for h in handles:
                await h.cancel()
            raise
        return reply

    async def _read_shm(self, request_id: str, keys: list[str], dest_slots: Sequence[Slots],
                        calls: list[list[tuple[int, Slots]]], layer_major: bool,
                        left: Callable[[], float]) -> ReadBlocksReply | None:
        """The same-host read; None when the gateway cannot reach the segment (use UCX)."""
        assert self._shm is not None        # the caller checked: this client reads over shm
        seg, base = self._shm
        limit = self.arena.nbytes
        for i, slots in enumerate(dest_slots):
            if any(off + n > limit for off, n in slots):
                raise InvalidArgument(f"destination {i}: a slot ends beyond the {limit} B arena")
        host, port = self.transport.address
        replies, first = [], 0
        for call in calls:
            batches = [ReadBatch(j + 1, n, [(base + off, k) for off, k in slots], layer_major)
                       for j, (n, slots) in enumerate(call)]
            n_keys = sum(b.n_keys for b in batches)
            msg = ReadBlocks(request_id, keys[first:first + n_keys], host, port, batches,
                             seg.name, seg.nbytes)
            reply = await self._shm_call(msg, left())
            if isinstance(reply, ShmUnavailable):
                log.warning("gateway_shm_unavailable_using_ucx", gateway=self.rpc.address,
                            segment=seg.name, reason=reply.reason)
                self._shm = None
                self.counts["shm_fallbacks"] += 1
                return None                   # the whole read again over UCX
            replies.append(reply)
            first += n_keys
        self.counts["shm_reads"] += 1
        return combine_reads(request_id, replies)

    async def _shm_call(self, msg: ReadBlocks, deadline_s: float) -> Any:
        """One shared-memory ReadBlocks; fenced when it fails on this side."""
        try:
            return await self.rpc.call(msg, deadline_s)
        except InvalidArgument:
            raise                             # refused before any I/O
        except BaseException:
            await self._fence(msg.shm_segment, msg.request_id)
            raise

    async def _fence(self, segment: str, request_id: str) -> None:
        """Wait until the gateway stopped writing into our slots for ``request_id``."""
        self.counts["shm_fences"] += 1
        try:
            await asyncio.shield(self.rpc.call(ShmFence(segment, request_id), self.fence_timeout_s))
        except BaseException as e:            # gateway gone: nothing writes any more either
            log.warning("gateway_shm_fence_failed", gateway=self.rpc.address,
                        request_id=request_id, error=repr(e))

    # ------------------------------------------------------------------ writes
    async def write_blocks(self, request_id: str, keys: Sequence[str], payloads: Sequence[Any],
                           deadline_s: float) -> BlocksWritten:
        """Store Full Blocks durably; ``payloads[i]``: a flat uint8 array or a list of them.

        Only the blocks the gateway lacks cross the wire; the rest count as duplicates. A write
        above what one WriteBlocks may carry (``max_write_blocks``) takes several calls, one
        after another, answered as one ``BlocksWritten``.
        """
        keys = validate_keys(keys)
        views = [_payload_views(p, self.spec.full_block_bytes, i) for i, p in enumerate(payloads)]
        if len(views) != len(keys):
            raise InvalidArgument(f"need one payload per key: {len(keys)} keys, {len(views)} payloads")
        left = _budget(deadline_s)
        per = await self.max_write_blocks(left(), request_id)
        done = [await self._write_once(request_id, keys[j:j + per], views[j:j + per], left())
                for j in range(0, max(len(keys), 1), per)]
        return BlocksWritten(request_id, sum(d.written for d in done),
                             sum(d.duplicates for d in done), sum(d.nbytes for d in done))

    async def max_write_blocks(self, timeout: float | None = None, request_id: str = "") -> int:
        """Keys one WriteBlocks may carry here, counting every block as new (the gateway tells
        which are new only after the call): under its max_batch_bytes, max_bytes_per_request,
        max_keys_per_request and frame size."""
        fixed = len(request_id.encode()) + len(self.transport.address[0])
        return write_call_blocks(await self.limits(timeout), fixed)

    async def _write_once(self, request_id: str, keys: list[str], views: list[list[np.ndarray]],
                          deadline_s: float) -> BlocksWritten:
        host, port = self.transport.address
        async with self.rpc.stream(WriteBlocks(request_id, keys, host, port), deadline_s) as events:
            slots = await _next_event(events, WriteSlots)
            if len(slots.send) != len(keys):
                raise ProtocolError(f"gateway answered {len(slots.send)} send flags for {len(keys)} keys")
            if slots.slots:
                src = [part for block, s in zip(views, slots.send) if s for part in block]
                await self.transport.send(await self.gateway_ucx(), slots.transfer_id, src,
                                          slots.slots, deadline_s)
            done = await _next_event(events, BlocksWritten)
            async for extra in events:        # the stream's end: nothing may follow
                raise ProtocolError(f"gateway sent {type(extra).__name__} after BlocksWritten")
        return done


def _budget(deadline_s: float) -> Callable[[], float]:
    """Seconds left of ``deadline_s`` (a budget from now), for calls made one after another."""
    end = time.monotonic() + deadline_s
    return lambda: max(0.0, end - time.monotonic())


async def _next_event(events: RpcStream, expected: type) -> Any:
    try:
        event = await anext(events)
    except StopAsyncIteration:
        raise ProtocolError(f"gateway ended WriteBlocks before {expected.__name__}") from None
    if not isinstance(event, expected):
        raise ProtocolError(f"gateway sent {type(event).__name__}, expected {expected.__name__}")
    return event


def _payload_views(payload: Any, block_bytes: int, i: int) -> list[np.ndarray]:
    views = list(payload) if isinstance(payload, (list, tuple)) else [payload]
    for v in views:
        if not isinstance(v, np.ndarray) or v.dtype != np.uint8 or v.ndim != 1 \
                or not v.flags.c_contiguous:
            raise InvalidArgument(f"payload {i}: pass flat contiguous uint8 arrays")
    if sum(v.nbytes for v in views) != block_bytes:
        raise InvalidArgument(f"payload {i}: {sum(v.nbytes for v in views)} B, a Full Block is "
                              f"{block_bytes} B")
    return views

