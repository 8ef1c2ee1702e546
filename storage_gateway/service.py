"""The storage gateway as a network service: one per node, that node's storage link (SNIC).

``GatewayService`` = ``GatewayStore`` (blocks on the media, read queue, link shaping) +
``PageTransport`` (Full Block bytes over UCX) + ``RpcServer`` (the ``GatewayRequest`` channel
of ``common.protocol``) + a preallocated staging ``PagePool``.

Reads (``ReadBlocks``): the requester posted its receives before asking; the gateway checks the
whole request before any I/O, then for each batch in order takes staging, reads the batch's
blocks into it (verified; blocks not found are zero-filled and flagged), and sends it into the
requester's slots — reading batch k+1 while batch k is on the wire, at most
``pipeline_depth`` batches staged per request. If the request fails part-way (its send failed,
its deadline passed, the requester left), batches not sent are never sent: the requester's
client gets the error reply and cancels its receives; a failed send aborts the endpoint, so
the requester's receive of that batch fails with PeerFailed.

Same-host reads (``ReadBlocks.shm_segment`` set, see ``common.shm``): the requester's buffer is
a ``/dev/shm/dualpath-*`` segment; the gateway maps it (cached), checks every slot lies inside,
and has the store ``preadv`` the blocks straight into the requester's slots — verified there,
missing ones zero-filled — then replies: one copy, no staging, no UCX. A segment it cannot open
(another host or container) gets a ``ShmUnavailable`` answer and the requester falls back.

Writes (``WriteBlocks``, a stream): the gateway answers which keys it lacks and where to send
them (``WriteSlots``; it posted those receives into staging), waits for the bytes, stores the
blocks durably and ends with ``BlocksWritten``.

``read_q`` (paper §5.1) reported here = the store's queue (batches waiting + being read) plus
the blocks of accepted read requests whose batches were not handed to the store yet, so a
long request counts in full from the moment it is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from structlog.contextvars import bound_contextvars

from common.auth import load_secret
from common.buffers import Allocation, AsyncPagePool, PagePool
from common.errors import ConfigError, DualpathError, InvalidArgument, Unavailable
from common.faults import afailpoint, failpoint
from common.kv import KVSpec, spec_from_config, validate_keys
from common.protocol import (BlocksWritten, GatewayLimits, GatewayRequest, GatewayTelemetry,
                             GetLimits, GetStats, GetStatsReply, LookupPrefix, LookupPrefixReply, Ping, Pong,
                             ReadBlocks, ReadBlocksReply, ShmFence, ShmFenceReply,
                             ShmUnavailable, WatchTelemetry, WriteBlocks, WriteSlots)
from common.rpc import CallContext, RpcServer
from common.service import Service
from common.shm import ShmMappings, valid_name
from common.shm import ShmUnavailable as SegmentUnavailable
from common.transport import PageTransport
from storage_gateway.destinations import ArenaRuns, block_runs
from storage_gateway.config import GatewayNodeConfig
from storage_gateway.request_checks import BatchPlan, check_peer, check_read
from storage_gateway.store import GatewayStore

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

KiB, MiB = 1024, 1024 * 1024
SERVICE_NAME = "storage_gateway"


def staging_dests(alloc: Allocation, spec: KVSpec, n: int, layer_major: bool) -> list[ArenaRuns]:
    """Where each of ``n`` blocks goes in a batch's staging, in the stream order of the batch.

    Block-major: block i is stream bytes ``[i*bb, (i+1)*bb)``. Layer-major: layer l of block i
    is at ``(l*n + i) * layer_block_bytes`` (all blocks' layer 0, then layer 1, ...).
    """
    return block_runs(memoryview(alloc.pool.arena), alloc.slots(), n, spec, layer_major)


# --------------------------------------------------------------------------- the service

@dataclass
class _ReadOutcome:
    found: list[bool]
    owner: str
    order: int              # the store's order key: every batch keeps the request's place
    corrupt: int = 0
    queued_s: float = 0.0
    read_s: float = 0.0
    send_s: float = 0.0
    pending_tokens: int = 0


class GatewayService(Service):
    """One node's storage gateway; ``async with GatewayService(cfg, "n0") as gw:``."""

    name = SERVICE_NAME

    def __init__(self, cfg: GatewayNodeConfig, node_id: str = "local", *,
                 spec: KVSpec | None = None, rpc_port: int = 0) -> None:
        super().__init__(node_id)
        self.cfg = cfg
        self.svc = cfg.gateway_service
        self.spec = spec or spec_from_config(cfg.kv)
        self.block_bytes = self.spec.full_block_bytes
        self._rpc_port = rpc_port
        self._store: GatewayStore | None = None         # these four: set by on_start()
        self._transport: PageTransport | None = None
        self._rpc: RpcServer | None = None
        self._staging: AsyncPagePool | None = None
        self._owners = itertools.count(1)
        self.shm_maps = ShmMappings(cfg.gateway.shm_max_mappings)
        self._shm_running: dict[tuple[str, str], list[asyncio.Event]] = {}
        self._pending_tokens = 0
        self._n = dict.fromkeys(("reads_ok", "reads_failed", "read_batches", "blocks_zero_filled",
                                 "writes_ok", "writes_failed", "write_duplicates", "lookups",
                                 "telemetry_events", "shm_reads", "shm_batches", "shm_bytes",
                                 "shm_unavailable", "shm_fences", "shm_fence_waits"), 0)
        if self.svc.max_batch_bytes < self.block_bytes:
            raise ConfigError(f"gateway_service.max_batch_bytes ({self.svc.max_batch_bytes}) "
                              f"must hold one Full Block ({self.block_bytes} B)")

    # ------------------------------------------------------------------ lifecycle
    async def on_start(self) -> None:
        svc = self.svc
        # write-backs from same-host nodes are copied straight into staging (one copy) when
        # it lives in /dev/shm (docs/datapath.md, "Same host: one copy")
        self._staging = AsyncPagePool(PagePool(
            svc.staging_page_bytes, -(-svc.staging_bytes // svc.staging_page_bytes), name="staging",
            shm=self.cfg.transport.same_host == "shm"))
        self._store = GatewayStore(self.cfg.gateway, self.spec)
        await self._store.start()
        self._transport = PageTransport(self.cfg.transport, self.node_id,
                                        shm_arena=self._staging.pool.arena)
        await self._transport.start()
        self._rpc = RpcServer(self.cfg.rpc, service=SERVICE_NAME, node_id=self.node_id,
                              handlers=self.handlers(), request_type=GatewayRequest,
                              kv_fingerprint=self.spec.fingerprint(),
                              auth_secret=load_secret(self.cfg.rpc))
        await self._rpc.start(port=self._rpc_port)
        self.log.info("gateway_listening", rpc_port=self.rpc.port, ucx_port=self.transport.address[1],
                      kv=self.spec.describe(), staging_bytes=self.staging.pool.arena.nbytes)

    async def on_stop(self) -> None:
        # Stop accepting and drain calls, then the transport (aborts what is left), then the store.
        if self._rpc is not None:
            await self._rpc.stop(self.drain_timeout_s)
        self.shm_maps.clear()
        if self._transport is not None:
            await self._transport.stop()
        if self._staging is not None:
            self._staging.pool.close()        # unlinks its /dev/shm segment, if any
        if self._store is not None:
            await self._store.close()

    @property
    def store(self) -> GatewayStore:
        return self._started(self._store)

    @property
    def transport(self) -> PageTransport:
        return self._started(self._transport)

    @property
    def rpc(self) -> RpcServer:
        return self._started(self._rpc)

    @property
    def staging(self) -> AsyncPagePool:
        return self._started(self._staging)

    def _started(self, part: _T | None) -> _T:
        """A part ``on_start`` makes; before that, a typed error instead of ``None``."""
        if part is None:
            raise Unavailable(f"storage gateway {self.node_id} is {self.status.value}: "
                              "not started")
        return part

    def handlers(self) -> dict[type, Callable[..., Any]]:
        return {LookupPrefix: self._lookup, ReadBlocks: self._read, WriteBlocks: self._write,
                WatchTelemetry: self._watch, Ping: self._ping, GetStats: self._get_stats,
                ShmFence: self._fence, GetLimits: self._limits}

    @property
    def rpc_port(self) -> int:
        return self.rpc.port

    @property
    def ucx_address(self) -> tuple[str, int]:
        return self.transport.address

    @property
    def read_q(self) -> int:
        """Tokens queued + being read on this node (paper §5.1)."""
        return self.store.read_q + self._pending_tokens

    # ------------------------------------------------------------------ small handlers
    async def _ping(self, msg: Ping, ctx: CallContext) -> Pong:
        return Pong(msg.payload)

    async def _lookup(self, msg: LookupPrefix, ctx: CallContext) -> LookupPrefixReply:
        self._n["lookups"] += 1
        hit = await self.store.lookup_prefix(msg.keys)
        return LookupPrefixReply(hit, self.read_q)

    async def _get_stats(self, msg: GetStats, ctx: CallContext) -> GetStatsReply:
        return GetStatsReply(SERVICE_NAME, self.node_id, self.counters())

    async def _limits(self, msg: GetLimits, ctx: CallContext) -> GatewayLimits:
        return self.limits()

    def limits(self) -> GatewayLimits:
        """The bounds ``check_read`` / ``_check_write`` hold every request to, stated."""
        gw = self.cfg.gateway
        return GatewayLimits(self.block_bytes, self.svc.max_batch_bytes,
                             self.svc.max_slots_per_batch, gw.max_keys_per_request,
                             gw.max_bytes_per_request, self.cfg.rpc.max_frame_bytes)

    def stats(self) -> dict[str, float]:
        """The metrics source (``common.metrics.StatsSource``): :meth:`counters`, whose
        ``read_q_tokens`` is the read queue the operations view shows."""
        return self.counters()

    def counters(self) -> dict[str, float]:
        """Store, transport, RPC, staging and service counters in one flat dict."""
        out = {k: float(v) for k, v in self.store.stats().items()}
        out.update({f"transport_{k}": float(v) for k, v in self.transport.stats().items()})
        out.update({f"rpc_{k}": float(v) for k, v in self.rpc.stats().items()})
        out.update({k: float(v) for k, v in self.staging.pool.counters().items()})
        out.update({k: float(v) for k, v in self._n.items()})
        out.update({k: float(v) for k, v in self.shm_maps.stats.items()})
        out["shm_mapped_segments"] = float(len(self.shm_maps))
        out.update(read_q_tokens=float(self.read_q), pending_read_tokens=float(self._pending_tokens),
                   rpc_port=float(self.rpc.port), ucx_port=float(self.transport.address[1]),
                   block_bytes=float(self.block_bytes),
                   max_batch_bytes=float(self.svc.max_batch_bytes))
        return out

    def telemetry(self) -> GatewayTelemetry:
        s = self.store.stats()
        return GatewayTelemetry(self.node_id, self.read_q, int(s["bytes_read"]),
                                int(s["bytes_written"]), int(s["blocks_stored"]))

    async def _watch(self, msg: WatchTelemetry, ctx: CallContext) -> AsyncIterator[GatewayTelemetry]:
        if not math.isfinite(msg.interval_s) or msg.interval_s < 0:
            raise InvalidArgument(f"telemetry interval must be a finite number >= 0, got {msg.interval_s}")
        interval = max(msg.interval_s, self.svc.telemetry_min_interval_s)
        while True:
            self._n["telemetry_events"] += 1
            yield self.telemetry()
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ reads
    async def _read(self, msg: ReadBlocks, ctx: CallContext) -> ReadBlocksReply | ShmUnavailable:
        with bound_contextvars(request_id=msg.request_id):
            t0 = time.monotonic()
            out = _ReadOutcome([False] * len(msg.keys), owner=self._owner("read", msg.request_id),
                               order=self.store.next_order())
            try:
                plans = self._check_read(msg)
                dests = self._shm_dests(msg, plans) if msg.shm_segment else None
                out.pending_tokens = len(msg.keys) * self.spec.block_tokens
                self._pending_tokens += out.pending_tokens
                await afailpoint("gw.read")        # chaos tests (common.faults); no-op unarmed
                if dests is None:
                    await self._pipeline(msg, plans, out, self._deadline_at(ctx))
                else:
                    await self._read_shm(msg, dests, out, self._deadline_at(ctx))
            except SegmentUnavailable as e:
                self._n["shm_unavailable"] += 1
                log.info("shm_unavailable", segment=msg.shm_segment, reason=str(e))
                return ShmUnavailable(msg.request_id, str(e))
            except BaseException as e:
                self._n["reads_failed"] += 1
                self._log_read(msg, out, t0, _outcome(e))
                raise
            finally:
                self._pending_tokens -= out.pending_tokens
                await self.staging.free_owner(out.owner)   # batches read but never sent
            self._n["reads_ok"] += 1
            self._log_read(msg, out, t0, "ok")
            n_found = sum(out.found)
            return ReadBlocksReply(msg.request_id, out.found, _prefix(out.found), out.corrupt,
                                   n_found * self.block_bytes, out.queued_s, out.read_s, self.read_q)

    def _check_read(self, msg: ReadBlocks) -> list[BatchPlan]:
        gw, tc = self.cfg.gateway, self.cfg.transport
        return check_read(msg, self.spec, self.svc, gw.max_keys_per_request,
                          gw.max_bytes_per_request, tc.max_message_bytes, tc.pack_below_bytes)

    # ------------------------------------------------------------------ same-host shm reads
    def _shm_dests(self, msg: ReadBlocks, plans: list[BatchPlan]) -> list[ArenaRuns]:
        """Per key, where in the requester's segment its block goes (nothing written)."""
        if not self.cfg.gateway.shm:
            raise SegmentUnavailable("shared-memory reads are disabled on this gateway (gateway.shm)")
        arena = self.shm_maps.get(msg.shm_segment, msg.shm_bytes).data
        dests = []
        for plan in plans:
            b = plan.batch
            dests.extend(block_runs(arena, b.slots, b.n_keys, self.spec, b.layer_major))
        return dests

    async def _read_shm(self, msg: ReadBlocks, dests: list[ArenaRuns], out: _ReadOutcome,
                        deadline_at: float) -> None:
        """Read every block straight into the requester's segment; zero-fill what is missing.

        Registered as running under (segment, request_id) until the store returned — which it
        does only once its I/O threads stopped writing — so ``ShmFence`` can wait for it.
        """
        key, done = (msg.shm_segment, msg.request_id), asyncio.Event()
        self._shm_running.setdefault(key, []).append(done)
        try:
            self._pending_tokens -= out.pending_tokens      # the store's queue counts them now
            out.pending_tokens = 0
            res = await self.store.read_blocks(msg.keys, dests, request_id=msg.request_id,
                                               timeout_s=_left(deadline_at), spread=True,
                                               order=out.order)
            out.queued_s, out.read_s, out.corrupt = res.queued_s, res.read_s, len(res.corrupt)
            for i, found in enumerate(res.found):
                out.found[i] = found
                if not found:                 # never leave stale bytes in the caller's slots
                    dests[i].fill_zero()
                    self._n["blocks_zero_filled"] += 1
            self._n["shm_reads"] += 1
            self._n["shm_batches"] += len(msg.batches)
            self._n["shm_bytes"] += res.nbytes
        finally:
            done.set()
            running = self._shm_running.get(key, [])
            if done in running:
                running.remove(done)
            if not running:
                self._shm_running.pop(key, None)

    async def _fence(self, msg: ShmFence, ctx: CallContext) -> ShmFenceReply:
        if not valid_name(msg.shm_segment):
            raise InvalidArgument(f"shm_segment {msg.shm_segment[:80]!r} is not a dualpath segment name")
        self._n["shm_fences"] += 1
        running = [e for e in self._shm_running.get((msg.shm_segment, msg.request_id), [])
                   if not e.is_set()]
        self._n["shm_fence_waits"] += len(running)
        for e in running:
            await e.wait()                    # bounded by the call's deadline (RPC layer)
        return ShmFenceReply(msg.request_id, len(running))

    def _owner(self, kind: str, request_id: str) -> str:
        """A staging owner unique per call: ``free_owner`` in ``finally`` frees what is left,
        synchronously, before its first suspension (so even a cancelled cleanup frees)."""
        return f"{kind}:{request_id}:{next(self._owners)}"

    def _deadline_at(self, ctx: CallContext) -> float:
        """Monotonic deadline of a call (the transport's default when the caller set none)."""
        left = ctx.remaining()
        if not math.isfinite(left):
            left = self.cfg.transport.transfer_timeout_s
        return time.monotonic() + left

    async def _pipeline(self, msg: ReadBlocks, plans: list[BatchPlan], out: _ReadOutcome,
                        deadline_at: float) -> None:
        """Read batch k+1 while batch k is sent; at most ``pipeline_depth`` batches staged."""
        staged: asyncio.Queue = asyncio.Queue()
        room = asyncio.Semaphore(self.svc.pipeline_depth)
        peer = (msg.ucx_host, msg.ucx_port)

        async def produce() -> None:
            for plan in plans:
                await room.acquire()
                staged.put_nowait((plan, await self._stage_batch(msg.request_id, plan, out, deadline_at)))
            staged.put_nowait(None)

        async def consume() -> None:
            while (item := await staged.get()) is not None:
                plan, alloc = item
                t = time.monotonic()
                await self.transport.send(peer, plan.batch.transfer_id, alloc.views(0, plan.nbytes),
                                          plan.batch.slots, _left(deadline_at))
                out.send_s += time.monotonic() - t
                self._n["read_batches"] += 1
                await self.staging.free(alloc)
                room.release()

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(produce(), name=f"read-{msg.request_id}-stage")
                tg.create_task(consume(), name=f"read-{msg.request_id}-send")
        except BaseExceptionGroup as eg:
            raise _first_error(eg) from None

    async def _stage_batch(self, rid: str, plan: BatchPlan, out: _ReadOutcome,
                           deadline_at: float) -> Allocation:
        """Take staging for one batch and read its blocks into it (missing ones zeroed)."""
        alloc = await self.staging.alloc(plan.nbytes, out.owner, _left(deadline_at))
        dests = staging_dests(alloc, self.spec, plan.batch.n_keys, plan.batch.layer_major)
        tokens = plan.batch.n_keys * self.spec.block_tokens
        out.pending_tokens -= tokens          # from here the store's read queue counts them
        self._pending_tokens -= tokens
        res = await self.store.read_blocks(plan.keys, dests, request_id=rid,
                                           timeout_s=_left(deadline_at), order=out.order)
        out.queued_s += res.queued_s
        out.read_s += res.read_s
        out.corrupt += len(res.corrupt)
        for i, found in enumerate(res.found):
            out.found[plan.first + i] = found
            if not found:                     # never serve stale staging bytes
                dests[i].fill_zero()
                self._n["blocks_zero_filled"] += 1
        return alloc

    def _log_read(self, msg: ReadBlocks, out: _ReadOutcome, t0: float, outcome: str) -> None:
        n_found = sum(out.found)
        (log.info if outcome == "ok" else log.warning)(
            "read_served", outcome=outcome, path="shm" if msg.shm_segment else "ucx",
            blocks=len(msg.keys), found=n_found,
            prefix_blocks=_prefix(out.found), corrupt=out.corrupt, batches=len(msg.batches),
            bytes=n_found * self.block_bytes, queued_ms=round(out.queued_s * 1e3, 3),
            read_ms=round(out.read_s * 1e3, 3), send_ms=round(out.send_s * 1e3, 3),
            total_ms=round((time.monotonic() - t0) * 1e3, 3), read_q=self.read_q)

    # ------------------------------------------------------------------ writes
    async def _write(self, msg: WriteBlocks, ctx: CallContext) -> AsyncGenerator[Any, None]:
        with bound_contextvars(request_id=msg.request_id):
            t0 = time.monotonic()
            outcome, written = "cancelled", 0
            try:
                keys, send = self._check_write(msg)
                if await self.store.forget_vanished([k for k, s in zip(keys, send) if not s]):
                    keys, send = self._check_write(msg)     # rewrite what vanished from disk
                new_keys = [k for k, s in zip(keys, send) if s]
                if not new_keys:
                    yield WriteSlots(msg.request_id, send, 0, [])
                else:
                    async with contextlib.aclosing(
                            self._receive_and_store(msg, send, new_keys, ctx)) as events:
                        async for event in events:
                            if isinstance(event, WriteSlots):
                                yield event
                            else:
                                written = event
                outcome = "ok"
                self._n["writes_ok"] += 1
                self._n["write_duplicates"] += len(keys) - written
            except BaseException as e:
                outcome = _outcome(e)
                self._n["writes_failed"] += 1
                raise
            finally:
                (log.info if outcome == "ok" else log.warning)(
                    "write_served", outcome=outcome, blocks=len(msg.keys), written=written,
                    duplicates=len(msg.keys) - written, bytes=written * self.block_bytes,
                    total_ms=round((time.monotonic() - t0) * 1e3, 3))
            yield BlocksWritten(msg.request_id, written, len(msg.keys) - written,
                                written * self.block_bytes)

    def _check_write(self, msg: WriteBlocks) -> tuple[list[str], list[bool]]:
        """Validate keys and limits; ``send[i]`` for the first occurrence of each key not stored."""
        gw = self.cfg.gateway
        keys = validate_keys(msg.keys, gw.max_keys_per_request)
        check_peer(msg.ucx_host, msg.ucx_port)
        seen: set[str] = set()
        send = []
        for k in keys:
            send.append(k not in seen and not self.store.contains(k))
            seen.add(k)
        nbytes = sum(send) * self.block_bytes
        if nbytes > min(self.svc.max_batch_bytes, gw.max_bytes_per_request):
            raise InvalidArgument(f"write of {sum(send)} new blocks ({nbytes} B) is above "
                                  f"gateway_service.max_batch_bytes ({self.svc.max_batch_bytes} B) "
                                  "— split it into smaller writes")
        return keys, send

    async def _receive_and_store(self, msg: WriteBlocks, send: list[bool], new_keys: list[str],
                                 ctx: CallContext) -> AsyncGenerator[Any, None]:
        """Post receives into staging, announce them, store the blocks; yields then the count."""
        deadline_at = self._deadline_at(ctx)
        nbytes = len(new_keys) * self.block_bytes
        owner = self._owner("write", msg.request_id)
        alloc = await self.staging.alloc(nbytes, owner, _left(deadline_at))
        try:
            tid = self.transport.new_transfer_id()
            slots = alloc.slots(0, nbytes)
            handle = await self.transport.expect((msg.ucx_host, msg.ucx_port), tid,
                                                 self.staging.pool.arena, slots, _left(deadline_at))
            try:
                yield WriteSlots(msg.request_id, send, tid, slots)
                await handle.wait()
            finally:
                if not handle.done:
                    await handle.cancel()
            bb = self.block_bytes
            failpoint("gw.write")
            results = await self.store.write_blocks(
                new_keys, [alloc.views(i * bb, bb) for i in range(len(new_keys))],
                request_id=msg.request_id)
            yield sum(results)
        finally:
            await self.staging.free_owner(owner)


# --------------------------------------------------------------------------- helpers

def _left(deadline_at: float) -> float:
    return max(0.0, deadline_at - time.monotonic())


def _prefix(found: list[bool]) -> int:
    for i, f in enumerate(found):
        if not f:
            return i
    return len(found)


def _outcome(e: BaseException) -> str:
    if isinstance(e, DualpathError):
        return e.code.value
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return type(e).__name__


def _first_error(eg: BaseExceptionGroup) -> BaseException:
    """The error that broke the pipeline (not the CancelledError of its sibling)."""
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            return _first_error(e)
        if not isinstance(e, asyncio.CancelledError):
            return e
    return eg.exceptions[0]
