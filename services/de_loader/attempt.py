"""One request attempt on a DE loader: the asyncio shell around its transfer core.

:class:`~services.de_loader.transfer.DecodeTransfer` decides (docs/datapath.md): which receives
to post, what to send on ``PullLayers``, when to hand the prompt KV to the decode engine, what
to write back and when pages go. This shell feeds it the PE receiver's data-path calls, the
decode engine's calls (it is the engine request's backend), I/O completions and the deadline
through the node's :class:`~services.node.driver.AttemptDriver` (one action table, one task
owner, one wake-up, one deadline), and does the I/O its actions name — allocations, UCX
receives and sends, gateway reads and writes, reports — through the node's
:class:`~services.node.io.NodeIO`; it never sees the service.

Failures: every sub-task is cancelled, every posted receive cancelled and every page freed
(after the engine let go of its views) by :meth:`DecodeAttempt.release`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import structlog

from common.errors import DualpathError
from common.faults import failpoint
from common.protocol import DecodeBinding, Endpoint, LayerSlots, PrefillDone, PrepareDecode, \
    PullLayers
from services.engine_api.decode import DecodePort, DecodeRequest, GeneratedBlock
from services.engine_api.kv_region import KVRegion
from services.engine_api.prompt import PromptInfo
from services.node.config import DELoaderConfig
from services.node.driver import AttemptDriver
from services.node.io import NodeIO

from .transfer import (AwaitEngine, DecodeTransfer, FreeBlock, FreeRegion, HandToEngine,
                       PostReceive, ReadHit, Release, SendLayers, WriteGenerated, WritePrompt)

log = structlog.get_logger(__name__)

# a write-back whose gateway call failed retryably (its UCX connect back to this node timed
# out on a loaded host: ci103) is tried again while its budget lasts, up to this many times
WRITEBACK_TRIES = 3

# Benchmarks/tests: where DE-path hit KV comes from instead of the gateway.
HitSource = Callable[[KVRegion, PromptInfo], Awaitable[int]]


class DecodeAttempt:
    """The DE side of one (request, attempt); also the decode engine request's backend.

    ``io`` is the node's I/O, ``port`` the bound engine's queue; ``hit_source`` replaces the
    gateway read of the hit (benchmarks, tests). The service registers the attempt and calls
    its data-path handlers (:meth:`prepare`, :meth:`pull`, :meth:`prefill_done`).
    """

    def __init__(self, io: NodeIO, port: DecodePort, request_id: str, attempt: int,
                 engine_id: str, deadline_at: float, *,
                 hit_source: HitSource | None = None) -> None:
        self.io, self.port, self.spec = io, port, io.spec
        self.settings = cast(DELoaderConfig, io.settings)
        self.key = (request_id, attempt)
        self.request_id, self.attempt = request_id, attempt
        self.engine_id = engine_id
        self.hit_source = hit_source
        self.core = DecodeTransfer(request_id, attempt, engine_id, io.spec,
                                   writeback=self.settings.writeback, counters=io.counters)
        self.binding: DecodeBinding | None = None
        self.pe_ucx: tuple[str, int] | None = None
        self.read_gateway: Endpoint | None = None
        self.region: Any = None
        self.receives: list[Any] = []
        self.writebacks: set[asyncio.Task] = set()
        self._sends: list[Any] = []               # SendLayers of the pull being answered
        self.request: DecodeRequest | None = None
        self.release_task: asyncio.Task | None = None
        self.t_start = time.monotonic()
        self.drv = AttemptDriver(
            io, self.key, deadline_at, error=lambda: self.core.error,
            ending=lambda: self.core.ending,
            on_deadline=lambda: self.drv.feed(self.core.deadline),
            on_stale=lambda stage: self.drv.feed(self.core.stale, stage),
            handlers={Release: self._release_later, FreeRegion: self._free_region,
                      FreeBlock: self._free_block, HandToEngine: self._hand_to_engine,
                      WritePrompt: self._start_prompt_write,
                      WriteGenerated: self._start_generated_write,
                      ReadHit: self._start_read, PostReceive: self._post,
                      SendLayers: self._queue_send, AwaitEngine: self._await_engine})
        self.sub = self.drv.tasks

    # ------------------------------------------------------------------ state (the core's)
    info = property(lambda self: self.core.info)
    state = property(lambda self: self.core.state)
    error = property(lambda self: self.core.error)
    dropped_reason = property(lambda self: self.core.dropped_reason)
    hit_tokens = property(lambda self: self.core.hit_tokens)
    received = property(lambda self: self.core.received)
    tokens = property(lambda self: self.core.tokens)
    hbm_bytes = property(lambda self: self.core.hbm_bytes)
    done = property(lambda self: self.core.done)

    @property
    def remaining(self) -> float:
        return self.drv.remaining

    def dropped(self) -> bool:
        return self.core.error is not None

    def _check(self) -> None:
        self.core.check()

    # ------------------------------------------------------------------ actions
    def _release_later(self, a: Release) -> None:
        self.release_task = self.io.supervise(self.release(),
                                              f"decode-release-{self.request_id}-{self.attempt}")

    def _free_region(self, a: FreeRegion) -> None:
        self.io.regions.free(self.region)

    def _free_block(self, a: FreeBlock) -> None:
        self.io.regions.free(cast(GeneratedBlock, a.block).region)

    def _hand_to_engine(self, a: HandToEngine) -> None:
        self.request = DecodeRequest(self.info, self.engine_id, a.hit_tokens, a.first_token_id,
                                     self.region, self)
        self.port.put(self.request)

    def _start_prompt_write(self, a: WritePrompt) -> None:
        self.sub.spawn(self._write_prompt(a))

    def _start_generated_write(self, a: WriteGenerated) -> None:
        task = self.sub.spawn(self._write_generated(cast(GeneratedBlock, a.block)))
        self.writebacks.add(task)
        task.add_done_callback(self.writebacks.discard)

    def _start_read(self, a: ReadHit) -> None:
        self.sub.spawn(self._read(a.blocks))

    def _queue_send(self, a: SendLayers) -> None:
        """Sent by :meth:`pull` once its returns are posted: every transfer of the call in
        flight at once."""
        self._sends.append(a)

    async def _allocate(self, tokens: int, owner: str, **kw: Any) -> Any:
        """Pages from the DE buffer; given straight back if the attempt ended meanwhile, or if
        the handler asking for them was cancelled the moment they came (``guard``'s undo)."""
        region = await self.sub.guard(self.io.regions.allocate(
            self.spec, tokens, owner, min(self.remaining, self.settings.alloc_timeout_s),
            **kw), undo=self.io.regions.free)
        if self.core.ending:
            self.io.regions.free(region)
            self._check()
        return region

    # ------------------------------------------------------------------ binding / prepare
    def bind(self, b: DecodeBinding) -> None:
        self.binding = b
        self.core.bind(b.hbm_bytes, b.prompt_tokens + b.gen_tokens)

    async def prepare(self, msg: PrepareDecode, info: PromptInfo) -> list[LayerSlots]:
        """Allocate, then post the forward receives or start the hit read."""
        self.drv.feed(self.core.prepare, info)
        self.pe_ucx = (msg.ucx_host, msg.ucx_port)
        self.read_gateway = msg.read_gateway
        with self.sub.using():
            self.region = await self._allocate(info.prompt_tokens,
                                               f"{self.request_id}#{self.attempt}")
            done = await self.drv.feed_async(self.core.region_allocated)
            return [ls for ls in done if isinstance(ls, LayerSlots)]

    async def _post(self, a: PostReceive) -> LayerSlots:
        """Post the receive of ``[layer, first:prompt]`` from the PE; watch it.

        Runs inline (not as a sub-task) so the handle can never be lost between the
        transport and us; a release that started meanwhile cancels it right here.
        """
        self._check()
        t = self.io.transport
        tid = t.new_transfer_id()
        slot = self.region.slot(a.layer, a.first, self.info.prompt_tokens)
        h = await t.expect(self.pe_ucx, tid, self.region.arena, [slot], self.remaining)
        self.receives.append(h)
        if self.core.ending:
            await h.cancel()
            self._check()
        self.sub.spawn(self._watch(h))
        return LayerSlots(a.layer, tid, [slot])

    async def _watch(self, h) -> None:
        try:
            await h.wait()
        except DualpathError as e:
            self.drv.feed(self.core.peer_failed, e)
            return
        self.drv.feed(self.core.layer_received)

    async def _read(self, blocks: int) -> None:
        """DE path: the hit Full Blocks from storage, scattered per layer into ``[l, 0:hit]``."""
        source = self.hit_source
        try:
            if source is not None:
                hit = await source(self.region, self.info)
            else:
                found, nbytes = await self._read_gateway(blocks)
        except DualpathError as e:
            self.drv.feed(self.core.read_failed, e)
            return
        if source is not None:
            self.drv.feed(self.core.hit_read, hit)
        else:
            self.drv.feed(self.core.hit_blocks_read, found, nbytes)

    async def _read_gateway(self, n: int) -> tuple[int, int]:
        """Blocks of the hit's leading ``n`` the gateway holds and the bytes it read
        ((0, 0) without a gateway)."""
        got = await self.io.gateways.read_hit(
            self.read_gateway, self.request_id, self.info.keys[:n], self.region,
            self.remaining, self.settings.read_batch_bytes, fault="de.read.batch")
        return (0, 0) if got is None else got

    # ------------------------------------------------------------------ DE path: pulls
    async def pull(self, msg: PullLayers) -> tuple[int, list[LayerSlots]]:
        """Send the pulled layers' ``[l, 0:hit]``; returns (usable hit, return slots)."""
        plan = self.core.pull(msg.layers)
        await self.drv.until(lambda: self.core.read_done)
        self._check()
        with self.sub.using():
            self._sends = []
            done = await self.drv.feed_async(self.core.pull_ready, plan)
            returns = [ls for ls in done if isinstance(ls, LayerSlots)]
            sends, self._sends = self._sends, []
            self._check()
            await self.sub.send_all([     # every transfer of the call in flight at once
                self._send_layers(a, [self.region.flat(layer, 0, a.tokens) for layer in a.layers])
                for a in sends])
        return self.core.layers_sent(plan), returns

    async def _send_layers(self, a: SendLayers, views: list) -> None:
        await self.io.arbiter.kv(sum(v.nbytes for v in views))
        self._check()
        failpoint("de.pull.send")
        await self.io.transport.send(self.pe_ucx, a.transfer_id, views, list(a.slots),
                                     self.remaining)

    # ------------------------------------------------------------------ assembly
    async def prefill_done(self, msg: PrefillDone) -> None:
        """Wait until every receive completed, then hand the prompt KV to the engine."""
        self.core.prefill_done(msg.hit_tokens, msg.first_token_id)
        failpoint("de.assemble")
        await self.drv.until(lambda: self.core.all_received)
        self._check()
        self.drv.feed(self.core.assembled)

    async def _write_prompt(self, a: WritePrompt) -> None:
        """Persist the prompt's new complete blocks (gathered from the request layout)."""
        try:
            s = self.settings
            per = await self.io.gateways.write_batch(s.writeback_batch_blocks,
                                                     s.control_timeout_s)
            for first, keys in a.batches(per):
                await self._write(list(keys), [self.region.block_views(first + j)
                                               for j in range(len(keys))])
        finally:
            self.drv.feed(self.core.prompt_write_done)

    async def _write(self, keys: list[str], payloads: list) -> None:
        s, counters = self.settings, self.io.counters
        client = self.io.gateways.local()
        if client is None:
            counters["writeback_skipped_no_gateway"] += len(keys)
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + min(self.remaining or s.writeback_timeout_s, s.writeback_timeout_s)
        hosted = None                 # the payloads in host memory (a pool on the GPU)
        for tries in range(1, WRITEBACK_TRIES + 1):
            try:
                failpoint("de.writeback")
                if hosted is None:    # once, however the first try failed
                    hosted = await self.io.gateways.host_payloads(payloads)
                done = await client.write_blocks(f"{self.request_id}#{self.attempt}", keys,
                                                 hosted, end - loop.time())
                counters["blocks_written"] += done.written
                counters["blocks_duplicate"] += done.duplicates   # an earlier try's, too
                return
            except DualpathError as e:  # best effort: the next turn recomputes these blocks
                if e.retryable and tries < WRITEBACK_TRIES and end - loop.time() > 1.0:
                    counters["writeback_retries"] += 1
                    log.info("writeback_retry", request_id=self.request_id, blocks=len(keys),
                             error=repr(e), left_s=round(end - loop.time(), 1))
                    continue
                counters["writeback_failed"] += len(keys)
                log.warning("writeback_failed", request_id=self.request_id, blocks=len(keys),
                            tries=tries, error=repr(e))
                return

    # ------------------------------------------------------------------ engine side
    async def took_kv(self, req: DecodeRequest) -> None:
        self.drv.feed(self.core.took_kv)

    async def second_token(self, req: DecodeRequest) -> None:
        self._check()
        failpoint("de.decode")
        self.drv.feed(self.core.second_token)

    async def new_block(self, req: DecodeRequest, token_ids) -> GeneratedBlock:
        key = self.core.block_key(token_ids)
        with self.sub.using():
            region = await self._allocate(self.spec.block_tokens,
                                          f"{self.request_id}#{self.attempt}/gen",
                                          one_extent=True)
        blk = GeneratedBlock(self.core.next_block_index, key,
                             tuple(int(t) for t in token_ids), region.whole(), region)
        self.core.block_opened(blk, key)
        return blk

    async def put_block(self, req: DecodeRequest, blk: GeneratedBlock) -> None:
        self.drv.feed(self.core.put_block, blk, blk.index)
        self._check()

    async def _write_generated(self, blk: GeneratedBlock) -> None:
        try:
            await self._write([blk.key], [blk.region.block_views(0)])
        finally:
            self.drv.feed(self.core.block_written, blk)

    async def finish(self, req: DecodeRequest, output_token_ids: list[int]) -> None:
        self.drv.feed(self.core.finish)
        s = self.settings
        if s.finish_after_writeback:
            pending = [t for t in self.writebacks if not t.done()]
            pending += [asyncio.ensure_future(self.drv.until(lambda: self.core.prompt_written,
                                                             or_failure=False))]
            await asyncio.wait(pending, timeout=min(self.remaining or 1.0,
                                                    s.writeback_timeout_s))
            pending[-1].cancel()
        self.drv.feed(self.core.finished, output_token_ids)
        # the engine's call may be cancelled as soon as it has its answer (its task stopped):
        # the release runs as the node's own task, so it always completes (pages, attempts)
        if self.release_task is None:
            self.release_task = self.io.supervise(
                self.release(), f"decode-release-{self.request_id}-{self.attempt}")
        await asyncio.shield(self.release_task)

    async def fail(self, req: DecodeRequest | None, error: BaseException | None) -> None:
        self.drv.feed(self.core.engine_failed, error)

    # ------------------------------------------------------------------ failure / release
    def abort(self, err: DualpathError, report: bool) -> None:
        """End the attempt with ``err`` (reported when the PE cannot know it)."""
        self.drv.feed(self.core.abort, err, report)

    def engine_gave_up(self, err: DualpathError) -> None:
        """The engine abandoned the request before claiming it: fail the attempt (reported)."""
        self.drv.feed(self.core.engine_failed, err)

    def drop(self, reason: str) -> None:
        self.drv.feed(self.core.drop, reason)

    async def release(self) -> None:
        """Cancel sub-tasks and receives, wait for the engine, free every page (idempotent)."""
        if not self.drv.feed(self.core.begin_release):
            return
        self.drv.cancel_deadline()
        await self.sub.stop()
        for h in self.receives:
            await h.cancel()
        taken_back = self.request is not None and self.port.discard(self.request)
        await self.drv.feed_async(self.core.unwound, taken_back)
        self.drv.feed(self.core.free_all)
        self.io.ended(self.key, self)
        await self.drv.flush_reports(self.settings.control_timeout_s)
        outcome = self.core.end()
        log.info("decode_attempt_done", request_id=self.request_id, attempt=self.attempt,
                 state=self.state, outcome=outcome,
                 ms=round((time.monotonic() - self.t_start) * 1e3, 3))

    async def _await_engine(self, a: AwaitEngine) -> None:
        """The engine may still read the pages: wait (bounded) until it lets go."""
        try:
            await asyncio.wait_for(self.drv.until(lambda: self.core.engine_let_go,
                                                  or_failure=False),
                                   self.settings.engine_release_timeout_s)
        except TimeoutError:
            log.warning("engine_did_not_release", request_id=self.request_id,
                        waited_s=self.settings.engine_release_timeout_s)
