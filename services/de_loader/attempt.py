"""One request attempt on a DE loader: the asyncio shell around its transfer core.

:class:`~services.de_loader.transfer.DecodeTransfer` decides (docs/datapath.md): which receives
to post, what to send on ``PullLayers``, when to hand the prompt KV to the decode engine, what
to write back and when pages go. This shell feeds it the PE receiver's data-path calls, the
decode engine's calls (it is the engine request's backend), I/O completions and the deadline,
and runs the actions it returns: allocations, UCX receives and sends, gateway reads and
writes, reports.

Failures: every sub-task is cancelled, every posted receive cancelled and every page freed
(after the engine let go of its views) by :meth:`DecodeAttempt.release`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import structlog

from common.errors import DualpathError
from common.faults import failpoint
from common.protocol import DecodeBinding, LayerSlots, PrefillDone, PrepareDecode, PullLayers
from services.engine_api.decode import DecodeRequest, GeneratedBlock
from services.engine_api.prompt import PromptInfo
from services.node.reports import OrderedReports
from services.node.subtasks import SubTasks

from .transfer import (Action, AwaitEngine, DecodeTransfer, FreeBlock, FreeRegion,
                       HandToEngine, Log, PostReceive, ReadHit, Release, Report, SendLayers,
                       WriteGenerated, WritePrompt)

if TYPE_CHECKING:
    from .service import DELoaderService

log = structlog.get_logger(__name__)


class DecodeAttempt:
    """The DE side of one (request, attempt); also the decode engine request's backend."""

    def __init__(self, svc: DELoaderService, request_id: str, attempt: int,
                 engine_id: str, deadline_at: float) -> None:
        self.svc, self.spec = svc, svc.spec
        self.key = (request_id, attempt)
        self.request_id, self.attempt = request_id, attempt
        self.engine_id = engine_id
        self.deadline_at = deadline_at
        self.core = DecodeTransfer(request_id, attempt, engine_id, svc.spec,
                                   writeback=svc.settings.writeback, counters=svc.counters)
        self.binding: DecodeBinding | None = None
        self.pe_ucx: tuple[str, int] | None = None
        self.region: Any = None
        self.receives: list[Any] = []
        self.sub = SubTasks(lambda: self.core.error)
        self.writebacks: set[asyncio.Task] = set()
        self.request: DecodeRequest | None = None
        self._failed, self._read_done = asyncio.Event(), asyncio.Event()
        self._all_received, self._engine_released = asyncio.Event(), asyncio.Event()
        self._prompt_written = asyncio.Event()
        self._release_task: asyncio.Task | None = None
        self._reports = OrderedReports(svc, request_id, attempt, self._stale)
        self.t_start = time.monotonic()
        self._timer = asyncio.get_running_loop().call_at(deadline_at, self._on_deadline)

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
        return max(0.0, self.deadline_at - asyncio.get_running_loop().time())

    def dropped(self) -> bool:
        return self.core.error is not None

    def _check(self) -> None:
        self.core.check()

    # ------------------------------------------------------------------ running the core
    def _feed(self, event: Callable[..., Any], *args: Any) -> Any:
        """Feed one event to the core, wake the waiters, run the synchronous actions."""
        try:
            out = event(*args)
        finally:
            self._wake()
        for action in out if isinstance(out, list) else ():
            self._RUN[type(action)](self, action)
        return out

    def _wake(self) -> None:
        c = self.core
        for event, flag in ((self._failed, c.ending), (self._read_done, c.read_done),
                            (self._all_received, c.all_received),
                            (self._engine_released, c.engine_let_go),
                            (self._prompt_written, c.prompt_written)):
            if flag and not event.is_set():
                event.set()

    def _report(self, a: Report) -> None:
        self._reports.send(a.stage, **a.fields)

    def _log(self, a: Log) -> None:
        getattr(log, a.level)(a.event, **a.fields)

    def _release_later(self, a: Release) -> None:
        self._release_task = asyncio.get_running_loop().create_task(self.release())

    def _free_region(self, a: FreeRegion) -> None:
        self.svc.regions.free(self.region)

    def _free_block(self, a: FreeBlock) -> None:
        self.svc.regions.free(cast(GeneratedBlock, a.block).region)

    def _hand_to_engine(self, a: HandToEngine) -> None:
        self.request = DecodeRequest(self.info, self.engine_id, a.hit_tokens, a.first_token_id,
                                     self.region, self)
        self.svc.ports[self.engine_id].put(self.request)

    def _start_prompt_write(self, a: WritePrompt) -> None:
        self.sub.spawn(self._write_prompt(a))

    def _start_generated_write(self, a: WriteGenerated) -> None:
        task = self.sub.spawn(self._write_generated(cast(GeneratedBlock, a.block)))
        self.writebacks.add(task)
        task.add_done_callback(self.writebacks.discard)

    def _by_caller(self, a: Action) -> None:
        """Receives, sends, the hit read, the engine wait: run inline by the handler."""

    _RUN: dict[type, Callable[[DecodeAttempt, Any], None]] = {
        Report: _report, Log: _log, Release: _release_later, FreeRegion: _free_region,
        FreeBlock: _free_block, HandToEngine: _hand_to_engine,
        WritePrompt: _start_prompt_write, WriteGenerated: _start_generated_write,
        ReadHit: _by_caller, PostReceive: _by_caller, SendLayers: _by_caller,
        AwaitEngine: _by_caller}

    # ------------------------------------------------------------------ asyncio helpers
    async def _wait(self, event: asyncio.Event) -> None:
        if not event.is_set() and self.core.error is None:
            waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._failed.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        self._check()

    async def _allocate(self, tokens: int, owner: str, **kw: Any) -> Any:
        """Pages from the DE buffer; given straight back if the attempt ended meanwhile."""
        region = await self.sub.guard(self.svc.regions.allocate(
            self.spec, tokens, owner, min(self.remaining, self.svc.settings.alloc_timeout_s),
            **kw))
        if self.core.ending:
            self.svc.regions.free(region)
            self._check()
        return region

    # ------------------------------------------------------------------ binding / prepare
    def bind(self, b: DecodeBinding) -> None:
        self.binding = b
        self.core.bind(b.hbm_bytes, b.prompt_tokens + b.gen_tokens)

    async def prepare(self, msg: PrepareDecode, info: PromptInfo) -> list[LayerSlots]:
        """Allocate, then post the forward receives or start the hit read."""
        self._feed(self.core.prepare, info)
        self.pe_ucx = (msg.ucx_host, msg.ucx_port)
        with self.sub.using():
            self.region = await self._allocate(info.prompt_tokens,
                                               f"{self.request_id}#{self.attempt}")
            actions = self._feed(self.core.region_allocated)
            for a in actions:
                if isinstance(a, ReadHit):
                    self.sub.spawn(self._read(msg, a.blocks))
            return [await self._post(a) for a in actions if isinstance(a, PostReceive)]

    async def _post(self, a: PostReceive) -> LayerSlots:
        """Post the receive of ``[layer, first:prompt]`` from the PE; watch it.

        Runs inline (not as a sub-task) so the handle can never be lost between the
        transport and us; a release that started meanwhile cancels it right here.
        """
        self._check()
        t = self.svc.transport
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
            self._feed(self.core.peer_failed, e)
            return
        self._feed(self.core.layer_received)

    async def _read(self, msg: PrepareDecode, blocks: int) -> None:
        """DE path: the hit Full Blocks from storage, scattered per layer into ``[l, 0:hit]``."""
        source = self.svc.hit_source
        try:
            if source is not None:
                hit = await source(self.region, self.info)
            else:
                found, nbytes = await self._read_gateway(msg, blocks)
        except DualpathError as e:
            self._feed(self.core.read_failed, e)
            return
        if source is not None:
            self._feed(self.core.hit_read, hit)
        else:
            self._feed(self.core.hit_blocks_read, found, nbytes)

    async def _read_gateway(self, msg: PrepareDecode, n: int) -> tuple[int, int]:
        """Blocks of the hit's leading ``n`` the gateway holds and the bytes it read
        ((0, 0) without a gateway)."""
        client = self.svc.gateway(msg.read_gateway)
        if client is None:
            log.warning("no_gateway_for_read", request_id=self.request_id)
            return 0, 0
        failpoint("de.read.batch")
        reply = await client.read_blocks(self.request_id, self.info.keys[:n],
                                         [self.region.block_dest(j) for j in range(n)],
                                         self.remaining, self.svc.settings.read_batch_bytes,
                                         layer_major=True)
        return reply.prefix_blocks, reply.nbytes

    # ------------------------------------------------------------------ DE path: pulls
    async def pull(self, msg: PullLayers) -> tuple[int, list[LayerSlots]]:
        """Send the pulled layers' ``[l, 0:hit]``; returns (usable hit, return slots)."""
        plan = self.core.pull(msg.layers)
        await self._wait(self._read_done)
        with self.sub.using():
            actions = self._feed(self.core.pull_ready, plan)
            returns = [await self._post(a) for a in actions if isinstance(a, PostReceive)]
            self._check()
            await self.sub.send_all([     # every transfer of the call in flight at once
                self._send_layers(a, [self.region.flat(layer, 0, a.tokens) for layer in a.layers])
                for a in actions if isinstance(a, SendLayers)])
        return self.core.layers_sent(plan), returns

    async def _send_layers(self, a: SendLayers, views: list) -> None:
        await self.svc.arbiter.kv(sum(v.nbytes for v in views))
        self._check()
        failpoint("de.pull.send")
        await self.svc.transport.send(self.pe_ucx, a.transfer_id, views, list(a.slots),
                                      self.remaining)

    # ------------------------------------------------------------------ assembly
    async def prefill_done(self, msg: PrefillDone) -> None:
        """Wait until every receive completed, then hand the prompt KV to the engine."""
        self.core.prefill_done(msg.hit_tokens, msg.first_token_id)
        failpoint("de.assemble")
        await self._wait(self._all_received)
        self._feed(self.core.assembled)

    async def _write_prompt(self, a: WritePrompt) -> None:
        """Persist the prompt's new complete blocks (gathered from the request layout)."""
        try:
            per = await self.svc.writeback_batch()
            for first, keys in a.batches(per):
                await self._write(list(keys), [self.region.block_views(first + j)
                                               for j in range(len(keys))])
        finally:
            self._feed(self.core.prompt_write_done)

    async def _write(self, keys: list[str], payloads: list) -> None:
        svc = self.svc
        client = svc.gateway(None)
        if client is None:
            svc.counters["writeback_skipped_no_gateway"] += len(keys)
            return
        try:
            failpoint("de.writeback")
            done = await client.write_blocks(f"{self.request_id}#{self.attempt}", keys, payloads,
                                             min(self.remaining or svc.settings.writeback_timeout_s,
                                                 svc.settings.writeback_timeout_s))
            svc.counters["blocks_written"] += done.written
            svc.counters["blocks_duplicate"] += done.duplicates
        except DualpathError as e:      # best effort: the next turn recomputes these blocks
            svc.counters["writeback_failed"] += len(keys)
            log.warning("writeback_failed", request_id=self.request_id, blocks=len(keys),
                        error=repr(e))

    # ------------------------------------------------------------------ engine side
    async def took_kv(self, req: DecodeRequest) -> None:
        self._feed(self.core.took_kv)

    async def second_token(self, req: DecodeRequest) -> None:
        self._check()
        failpoint("de.decode")
        self._feed(self.core.second_token)

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
        self._feed(self.core.put_block, blk, blk.index)
        self._check()

    async def _write_generated(self, blk: GeneratedBlock) -> None:
        try:
            await self._write([blk.key], [blk.region.block_views(0)])
        finally:
            self._feed(self.core.block_written, blk)

    async def finish(self, req: DecodeRequest, output_token_ids: list[int]) -> None:
        self._feed(self.core.finish)
        settings = self.svc.settings
        if settings.finish_after_writeback:
            pending = [t for t in self.writebacks if not t.done()]
            pending += [asyncio.ensure_future(self._prompt_written.wait())]
            await asyncio.wait(pending, timeout=min(self.remaining or 1.0,
                                                    settings.writeback_timeout_s))
            pending[-1].cancel()
        self._feed(self.core.finished, output_token_ids)
        await self.release()

    async def fail(self, req: DecodeRequest | None, error: BaseException | None) -> None:
        self._feed(self.core.engine_failed, error)

    # ------------------------------------------------------------------ failure / release
    def abort(self, err: DualpathError, report: bool) -> None:
        """End the attempt with ``err`` (reported when the PE cannot know it)."""
        self._feed(self.core.abort, err, report)

    def drop(self, reason: str) -> None:
        self._feed(self.core.drop, reason)

    def _stale(self, stage: str) -> None:
        self._feed(self.core.stale, stage)

    def _on_deadline(self) -> None:
        self._feed(self.core.deadline)

    async def release(self) -> None:
        """Cancel sub-tasks and receives, wait for the engine, free every page (idempotent)."""
        if not self._feed(self.core.begin_release):
            return
        svc = self.svc
        self._timer.cancel()
        await self.sub.stop()
        for h in self.receives:
            await h.cancel()
        taken_back = self.request is not None and svc.ports[self.engine_id].discard(self.request)
        if AwaitEngine() in self._feed(self.core.unwound, taken_back):
            try:
                await asyncio.wait_for(self._engine_released.wait(),
                                       svc.settings.engine_release_timeout_s)
            except TimeoutError:
                log.error("engine_did_not_release", request_id=self.request_id)
        self._feed(self.core.free_all)
        if svc.attempts.get(self.key) is self:
            del svc.attempts[self.key]
        await self._reports.flush(svc.settings.control_timeout_s)
        outcome = self.core.end()
        log.info("decode_attempt_done", request_id=self.request_id, attempt=self.attempt,
                 state=self.state, outcome=outcome,
                 ms=round((time.monotonic() - self.t_start) * 1e3, 3))
