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

Same host: when the arena lies in a shared-memory segment (``common.shm``; the node services'
pools do when ``[gateway] shm = true``), reads name the segment and the gateway preads straight
into the slots — no receives, no UCX, one copy. If the gateway cannot open the segment
(another host or container) it answers ``ShmUnavailable``; the client logs that once, remembers
it and uses UCX from then on. A shared-memory read that fails on this side (deadline,
cancellation, lost connection) sends ``ShmFence`` before raising, so the gateway is known to
have stopped writing into the slots when the call returns.
"""

from __future__ import annotations

from collections.abc import Sequence
import asyncio
from typing import Any

import numpy as np
import structlog

from common.config import RpcConfig
from common import shm as shm_mod
from common.errors import InvalidArgument, ProtocolError
from common.kv import KVSpec, validate_keys
from common.protocol import (BlocksWritten, GatewayReply, GetStats, LookupPrefix,
                             LookupPrefixReply, Ping, ReadBatch, ReadBlocks,
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
                 layer_major: bool = False) -> list[tuple[int, Slots]]:
    """``(n_keys, slots)`` of each batch: ``batch_bytes`` worth of blocks (at least one)."""
    bb = spec.full_block_bytes
    for i, slots in enumerate(dest_slots):
        if sum(n for _, n in slots) != bb or any(o < 0 or n < 0 for o, n in slots):
            raise InvalidArgument(f"destination {i}: slots must hold exactly one Full Block "
                                  f"({bb} B)")
    per = max(1, batch_bytes // bb)
    out = []
    for j in range(0, len(dest_slots), per):
        group = dest_slots[j:j + per]
        if layer_major:
            pieces = [_by_layer(s, spec) for s in group]
            slots = [p for layer in range(spec.num_layers) for blk in pieces for p in blk[layer]]
        else:
            slots = [p for s in group for p in s]
        out.append((len(group), slots))
    return out


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

        Blocks not found arrive as zeros and are flagged in ``reply.found``; the usable hit
        is ``reply.prefix_blocks``. Raises the gateway's typed error, or the transport's
        (PeerFailed, DeadlineExceeded) — never with a receive still posted.
        """
        keys = validate_keys(keys)
        if len(dest_slots) != len(keys):
            raise InvalidArgument(f"need one destination per key: {len(keys)} keys, "
                                  f"{len(dest_slots)} destinations")
        plan = plan_batches(self.spec, dest_slots, batch_bytes, layer_major)
        if self._shm is not None:
            reply = await self._read_shm(request_id, keys, dest_slots, plan, layer_major,
                                         deadline_s)
            if reply is not None:
                return reply
        self.counts["ucx_reads"] += 1
        gateway = await self.gateway_ucx()
        handles, batches = [], []
        try:
            for n, slots in plan:
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
                        plan: list[tuple[int, Slots]], layer_major: bool,
                        deadline_s: float) -> ReadBlocksReply | None:
        """The same-host read; None when the gateway cannot reach the segment (use UCX)."""
        assert self._shm is not None        # the caller checked: this client reads over shm
        seg, base = self._shm
        limit = self.arena.nbytes
        for i, slots in enumerate(dest_slots):
            if any(off + n > limit for off, n in slots):
                raise InvalidArgument(f"destination {i}: a slot ends beyond the {limit} B arena")
        batches = [ReadBatch(j + 1, n, [(base + off, k) for off, k in slots], layer_major)
                   for j, (n, slots) in enumerate(plan)]
        host, port = self.transport.address
        msg = ReadBlocks(request_id, keys, host, port, batches, seg.name, seg.nbytes)
        try:
            reply = await self.rpc.call(msg, deadline_s)
        except InvalidArgument:
            raise                             # refused before any I/O
        except BaseException:
            await self._fence(seg.name, request_id)
            raise
        if isinstance(reply, ShmUnavailable):
            log.warning("gateway_shm_unavailable_using_ucx", gateway=self.rpc.address,
                        segment=seg.name, reason=reply.reason)
            self._shm = None
            self.counts["shm_fallbacks"] += 1
            return None
        self.counts["shm_reads"] += 1
        return reply

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

        Only the blocks the gateway lacks cross the wire; the rest count as duplicates.
        """
        keys = validate_keys(keys)
        views = [_payload_views(p, self.spec.full_block_bytes, i) for i, p in enumerate(payloads)]
        if len(views) != len(keys):
            raise InvalidArgument(f"need one payload per key: {len(keys)} keys, {len(views)} payloads")
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

