"""One request attempt on a DE loader: DE buffer region, assembly, hand-off, write-back.

Driven by the PE receiver's data-path calls and by the decode engine (docs/datapath.md):

* ``PrepareDecode``: allocate ``[L, prompt, B]``; PE/none path — post one receive per layer
  ``[l, 0:prompt]`` from the PE; DE path — read the hit Full Blocks from the gateway into
  ``[l, 0:hit]`` (missing blocks shorten the hit);
* ``PullLayers`` (DE path): once the read is done, post receives for the return of
  ``[l, hit:prompt]`` and send ``[l, 0:hit]`` into the PE's slots, layer by layer;
* ``PrefillDone``: every receive completed → the full prompt KV is here → hand it to the
  decode engine and persist the prompt's new complete blocks;
* engine: ``took_kv`` (host pages freed once the write-back read them), generated blocks
  (``new_block``/``put_block``: persisted), ``finish`` (reported once write-backs are durable).

Failures: the PE's transfers failing (peer death) fail the attempt with a retryable error
naming ``pe_receiver`` (reported); a revocation, an ``AbortDecode`` or the deadline drop it.
Either way every sub-task is cancelled, every posted receive cancelled and every page freed
(after the engine let go of its views).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import structlog

from common.errors import (AlreadyExists, Cancelled, DeadlineExceeded, DualpathError,
                           InternalError, InvalidArgument)
from common.faults import failpoint
from common.protocol import (DecodeBinding, LayerSlots, PrefillDone, PrepareDecode,
                             PullLayers)
from services.engine_api.decode import DecodeRequest, GeneratedBlock
from services.engine_api.prompt import PromptInfo, next_block_key
from services.node.errors import copy_error as _copy, peer_error as _peer_error, with_hop
from services.node.reports import OrderedReports, cancel_and_wait

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
        self.binding: DecodeBinding | None = None
        self.info: PromptInfo | None = None
        self.pe_ucx: tuple[str, int] | None = None
        self.region = None
        self.hbm_bytes = 0
        self.tokens = 0
        self.state = "reserved"
        self.error: DualpathError | None = None
        self.dropped_reason: str | None = None
        self.hit_tokens = 0
        self.first_token_id: int | None = None
        self.pulled: set[int] = set()
        self.receives: list[Any] = []
        self.expected_receives = 0
        self.received = 0
        self.tasks: set[asyncio.Task] = set()
        self.writebacks: set[asyncio.Task] = set()
        self.sending: set[asyncio.Task] = set()   # layer sends to the PE in flight
        self.request: DecodeRequest | None = None
        self.engine_holds_kv = False
        self.blocks: set[GeneratedBlock] = set()
        self.last_key: str | None = None
        self.persist = False
        self._failed = asyncio.Event()
        self._read_done = asyncio.Event()
        self._all_received = asyncio.Event()
        self._engine_released = asyncio.Event()
        self._prompt_written = asyncio.Event()
        self._releasing = False
        self._released = False
        self._release_task: asyncio.Task | None = None
        self._busy = 0                    # handler calls that may still create resources
        self._idle = asyncio.Event()
        self._idle.set()
        self.blocks_put = 0
        self._reports = OrderedReports(svc, request_id, attempt, self._stale)
        self.t_start = time.monotonic()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(deadline_at, self._on_deadline)

    # ------------------------------------------------------------------ state helpers
    @property
    def remaining(self) -> float:
        return max(0.0, self.deadline_at - asyncio.get_running_loop().time())

    @property
    def done(self) -> bool:
        return self._released or self._releasing

    def dropped(self) -> bool:
        return self.error is not None

    def _check(self) -> None:
        if self.error is not None:
            raise _copy(self.error)

    async def _wait(self, event: asyncio.Event) -> None:
        if not event.is_set() and self.error is None:
            waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._failed.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        self._check()

    async def _guard(self, coro) -> Any:
        """Run ``coro`` as a sub-task release() can cancel; its cancellation by a failure
        reaches the caller as the attempt's typed error (an RPC handler then replies it)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            return await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling() or self.error is None:
                raise
            raise _copy(self.error) from None

    @contextlib.contextmanager
    def _using(self):
        """A handler creating resources (pages, receives): release() waits for it to end."""
        self._busy += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._busy -= 1
            if not self._busy:
                self._idle.set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # ------------------------------------------------------------------ binding / prepare
    def bind(self, b: DecodeBinding) -> None:
        self.binding = b
        self.hbm_bytes = b.hbm_bytes
        self.tokens = b.prompt_tokens + b.gen_tokens

    async def prepare(self, msg: PrepareDecode, info: PromptInfo) -> list[LayerSlots]:
        """Allocate, then post the forward receives or start the hit read (see module doc)."""
        if self.info is not None:
            raise AlreadyExists(f"attempt {self.request_id}#{self.attempt} was prepared already")
        self._check()
        svc, spec = self.svc, self.spec
        self.info, self.pe_ucx, self.state = info, (msg.ucx_host, msg.ucx_port), "preparing"
        if self.binding is None:
            self.hbm_bytes = spec.bytes_per_token * (info.prompt_tokens + info.gen_tokens)
            self.tokens = info.prompt_tokens + info.gen_tokens
        self.hit_tokens = info.hit_tokens
        self.persist = (svc.settings.writeback and info.fully_keyed
                        and (info.tail_token_ids is not None or info.tail_tokens == 0))
        self.last_key = info.last_key()
        with self._using():
            region = await self._guard(svc.regions.allocate(
                spec, info.prompt_tokens, f"{self.request_id}#{self.attempt}",
                min(self.remaining, svc.settings.alloc_timeout_s)))
            if self._releasing or self.error is not None:
                svc.regions.free(region)
                self._check()
            self.region = region
            return await self._prepare_side(msg, info)

    async def _prepare_side(self, msg: PrepareDecode, info: PromptInfo) -> list[LayerSlots]:
        spec = self.spec
        if info.read_side == "de":
            self._spawn(self._read(msg))
            self.expected_receives = spec.num_layers
            return []
        self._read_done.set()
        self.expected_receives = spec.num_layers
        return [await self._post(layer, 0) for layer in range(spec.num_layers)]

    async def _post(self, layer: int, first: int) -> LayerSlots:
        """Post the receive of ``[layer, first:prompt]`` from the PE; watch it.

        Runs inline (not as a sub-task) so the handle can never be lost between the
        transport and us; a release that started meanwhile cancels it right here.
        """
        self._check()
        t = self.svc.transport
        tid = t.new_transfer_id()
        slot = self.region.slot(layer, first, self.info.prompt_tokens)
        h = await t.expect(self.pe_ucx, tid, self.region.arena, [slot], self.remaining)
        self.receives.append(h)
        if self._releasing or self.error is not None:
            await h.cancel()
            self._check()
        self._spawn(self._watch(h))
        return LayerSlots(layer, tid, [slot])

    async def _watch(self, h) -> None:
        try:
            await h.wait()
        except DualpathError as e:
            self.abort(with_hop(_peer_error(e), "pe_receiver"),
                       report=not isinstance(e, DeadlineExceeded))
            return
        self.received += 1
        if self.received == self.expected_receives:
            self._all_received.set()

    async def _read(self, msg: PrepareDecode) -> None:
        """DE path: the hit Full Blocks from storage, scattered per layer into ``[l, 0:hit]``."""
        info, svc = self.info, self.svc
        try:
            if svc.hit_source is not None:
                hit = await svc.hit_source(self.region, info)
            else:
                hit = await self._read_gateway(msg)
        except DualpathError as e:
            self.abort(with_hop(e, "gateway"), report=True)
            return
        if hit < info.hit_tokens:
            svc.counters["hit_shortened"] += 1
            log.info("hit_shortened", request_id=self.request_id, planned=info.hit_tokens,
                     hit=hit, side="de")
        self.hit_tokens = hit
        self._read_done.set()

    async def _read_gateway(self, msg: PrepareDecode) -> int:
        info = self.info
        client = self.svc.gateway(msg.read_gateway)
        if client is None:
            log.warning("no_gateway_for_read", request_id=self.request_id)
            return 0
        n = info.hit_blocks
        failpoint("de.read.batch")
        reply = await client.read_blocks(self.request_id, info.keys[:n],
                                         [self.region.block_dest(j) for j in range(n)],
                                         self.remaining, self.svc.settings.read_batch_bytes,
                                         layer_major=True)
        return min(info.hit_tokens, reply.prefix_blocks * info.block_tokens)

    # ------------------------------------------------------------------ DE path: pulls
    async def pull(self, msg: PullLayers) -> tuple[int, list[LayerSlots]]:
        """Send the pulled layers' ``[l, 0:hit]``; returns (usable hit, return slots)."""
        info = self._prepared()
        if info.read_side != "de":
            raise InvalidArgument(f"PullLayers for {self.request_id}: its read side is "
                                  f"{info.read_side!r}, not 'de'")
        L, row = self.spec.num_layers, info.hit_tokens * self.spec.kv_bytes_per_token_per_layer
        layers = [ls.layer for ls in msg.layers]
        for ls in msg.layers:
            if not 0 <= ls.layer < L:
                raise InvalidArgument(f"PullLayers: layer {ls.layer} out of range [0, {L})")
            if sum(n for _, n in ls.slots) != row or any(o < 0 or n < 0 for o, n in ls.slots):
                raise InvalidArgument(f"PullLayers: layer {ls.layer} slots hold "
                                      f"{sum(n for _, n in ls.slots)} B, the hit is {row} B")
        if len(set(layers)) != len(layers) or self.pulled & set(layers):
            raise InvalidArgument(f"PullLayers: layers {layers} pulled twice")
        groups = _transfers(msg.layers)
        self.pulled.update(layers)
        await self._wait(self._read_done)
        t, arb = self.svc.transport, self.svc.arbiter
        with self._using():
            returns = [await self._post(layer, self.hit_tokens) for layer in layers]
            self._check()
            sends = []
            for tid, group in groups:     # every transfer of the call in flight at once
                views = [self.region.flat(ls.layer, 0, info.hit_tokens) for ls in group]
                slots = [s for ls in group for s in ls.slots]
                sends.append(self._send_layers(t, arb, tid, views, slots))
            task = asyncio.get_running_loop().create_task(_all(sends))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)
            await self._guard(_await(task))
        self.svc.counters["layers_pulled"] += len(layers)
        return self.hit_tokens, returns

    async def _send_layers(self, t, arb, tid: int, views: list, slots: list) -> None:
        await arb.kv(sum(v.nbytes for v in views))
        self._check()
        failpoint("de.pull.send")
        await t.send(self.pe_ucx, tid, views, slots, self.remaining)

    def _prepared(self) -> PromptInfo:
        self._check()
        if self.info is None or self.region is None:
            raise InvalidArgument(f"attempt {self.request_id}#{self.attempt} is not prepared "
                                  "(PrepareDecode first)")
        return self.info

    # ------------------------------------------------------------------ assembly
    async def prefill_done(self, msg: PrefillDone) -> None:
        """Wait until every receive completed, then hand the prompt KV to the engine."""
        info = self._prepared()
        if self.state != "preparing":
            raise AlreadyExists(f"PrefillDone for {self.request_id}#{self.attempt} twice")
        bt = info.block_tokens
        if info.read_side == "de":
            if len(self.pulled) != self.spec.num_layers:
                raise InvalidArgument(f"PrefillDone after pulling {len(self.pulled)} of "
                                      f"{self.spec.num_layers} layers")
            if msg.hit_tokens != self.hit_tokens:
                raise InvalidArgument(f"PrefillDone: hit {msg.hit_tokens}, the DE read "
                                      f"{self.hit_tokens}")
        elif not 0 <= msg.hit_tokens <= info.hit_tokens or msg.hit_tokens % bt:
            raise InvalidArgument(f"PrefillDone: hit {msg.hit_tokens} outside the plan's "
                                  f"{info.hit_tokens}")
        self.state = "assembling"
        failpoint("de.assemble")
        await self._wait(self._all_received)
        self._check()
        self.hit_tokens = msg.hit_tokens
        self.first_token_id = msg.first_token_id
        self._hand_off()

    def _hand_off(self) -> None:
        svc, info = self.svc, self.info
        self.state = "ready"
        self.request = DecodeRequest(info, self.engine_id, self.hit_tokens, self.first_token_id,
                                     self.region, self)
        self.engine_holds_kv = True
        svc.ports[self.engine_id].put(self.request)
        svc.counters["handed_off"] += 1
        first = self.hit_tokens // info.block_tokens
        keys = info.keys[first:] if svc.settings.writeback else ()
        if keys:
            self._spawn(self._write_prompt(first, list(keys)))
        else:
            self._prompt_written.set()

    async def _write_prompt(self, first: int, keys: list[str]) -> None:
        """Persist the prompt's new complete blocks (gathered from the request layout)."""
        try:
            per = await self.svc.writeback_batch(self.spec.full_block_bytes)
            for i in range(0, len(keys), per):
                batch = keys[i:i + per]
                await self._write(batch, [self.region.block_views(first + i + j)
                                          for j in range(len(batch))])
        finally:
            self._prompt_written.set()
            self._maybe_free_region()

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

    def _maybe_free_region(self) -> None:
        if (self.region is not None and not self.engine_holds_kv
                and self._prompt_written.is_set() and self.state in ("decoding", "finishing")):
            self.svc.regions.free(self.region)

    # ------------------------------------------------------------------ engine side
    async def took_kv(self, req: DecodeRequest) -> None:
        self.engine_holds_kv = False
        self._engine_released.set()
        self._check()
        self.state = "decoding"
        self._maybe_free_region()

    async def second_token(self, req: DecodeRequest) -> None:
        self._check()
        failpoint("de.decode")
        self._reports.send("second_token")

    async def new_block(self, req: DecodeRequest, token_ids) -> GeneratedBlock:
        self._check()
        info, svc = self.info, self.svc
        key = next_block_key(self.last_key or info.last_key(), token_ids, info.block_tokens)
        with self._using():
            region = await self._guard(svc.regions.allocate(
                self.spec, info.block_tokens, f"{self.request_id}#{self.attempt}/gen",
                min(self.remaining, svc.settings.alloc_timeout_s), one_extent=True))
            if self._releasing or self.error is not None:
                svc.regions.free(region)
                self._check()
        self.last_key = key
        index = info.n_full + len(self.blocks) + self.blocks_put
        blk = GeneratedBlock(index, key, tuple(int(t) for t in token_ids), region.whole(), region)
        self.blocks.add(blk)
        return blk

    async def put_block(self, req: DecodeRequest, blk: GeneratedBlock) -> None:
        if blk not in self.blocks:
            raise InvalidArgument(f"block {blk.index} does not belong to {self.request_id}")
        self.blocks.discard(blk)
        self.blocks_put += 1
        if self.error is not None or not self.persist:
            self.svc.regions.free(blk.region)
            self._check()
            return
        task = self._spawn(self._write_generated(blk))
        self.writebacks.add(task)
        task.add_done_callback(self.writebacks.discard)

    async def _write_generated(self, blk: GeneratedBlock) -> None:
        try:
            await self._write([blk.key], [blk.region.block_views(0)])
        finally:
            self.svc.regions.free(blk.region)

    async def finish(self, req: DecodeRequest, output_token_ids: list[int]) -> None:
        self._check()
        self.state = "finishing"
        self.engine_holds_kv = False
        self._engine_released.set()
        svc = self.svc
        if svc.settings.finish_after_writeback:
            pending = [t for t in self.writebacks if not t.done()]
            pending += [asyncio.ensure_future(self._prompt_written.wait())]
            await asyncio.wait(pending, timeout=min(self.remaining or 1.0,
                                                    svc.settings.writeback_timeout_s))
            pending[-1].cancel()
        self._check()
        self._reports.send("finished", tokens=len(output_token_ids),
                           output_token_ids=list(output_token_ids))
        svc.counters["finished"] += 1
        self.state = "done"
        await self.release()

    async def fail(self, req: DecodeRequest | None, error: BaseException | None) -> None:
        self.engine_holds_kv = False
        self._engine_released.set()
        for blk in list(self.blocks):
            self.blocks.discard(blk)
            self.svc.regions.free(blk.region)
        if self.error is None:
            err = error if isinstance(error, DualpathError) else InternalError(
                f"decode engine {self.engine_id} gave up: {error!r}")
            self.abort(with_hop(err, "engine"), report=True)

    # ------------------------------------------------------------------ failure / release
    def abort(self, err: DualpathError, report: bool) -> None:
        """End the attempt with ``err`` (reported when the PE cannot know it)."""
        if self.error is not None or self.done:
            return
        self.error = err
        self._failed.set()
        if report:
            self.svc.counters["attempts_failed"] += 1
            log.warning("decode_attempt_failed", request_id=self.request_id,
                        attempt=self.attempt, hop=getattr(err, "hop", None),
                        code=err.code.value, error=err.message)
            self._reports.send("failed", code=err.code.value, message=err.message[:500],
                               retryable=err.retryable, hop=getattr(err, "hop", "") or "de_loader")
        self._release_task = asyncio.get_running_loop().create_task(self.release())

    def drop(self, reason: str) -> None:
        if self.error is None and not self.done:
            self.dropped_reason = reason
            self.svc.counters["attempts_dropped"] += 1
            self.abort(with_hop(Cancelled(f"attempt dropped: {reason}"), "scheduler"), report=False)

    def _stale(self, stage: str) -> None:
        self.drop(f"scheduler: attempt no longer current (after {stage})")

    def _on_deadline(self) -> None:
        if self.state not in ("done",) and not self.done:
            self.abort(with_hop(DeadlineExceeded(
                f"{self.request_id}#{self.attempt} passed its deadline on the DE loader "
                f"({self.state})"), "de_loader"), report=False)

    async def release(self) -> None:
        """Cancel sub-tasks and receives, wait for the engine, free every page (idempotent)."""
        if self._releasing:
            return
        self._releasing = True
        svc = self.svc
        self._timer.cancel()
        self._failed.set()
        if self.sending:      # a send cancelled mid-way aborts the endpoint to the PE, failing
            await asyncio.wait(list(self.sending), timeout=2.0)    # its other transfers too
        await cancel_and_wait(list(self.tasks) + list(self.sending))
        while self._busy:                     # handlers notice the failure and unwind
            await self._idle.wait()
        await cancel_and_wait(list(self.tasks))
        for h in self.receives:
            await h.cancel()
        if self.request is not None and svc.ports[self.engine_id].discard(self.request):
            self.engine_holds_kv = False
        if self.engine_holds_kv or self.blocks:
            try:
                await asyncio.wait_for(self._engine_released.wait(),
                                       svc.settings.engine_release_timeout_s)
            except TimeoutError:
                log.error("engine_did_not_release", request_id=self.request_id)
        for blk in list(self.blocks):
            svc.regions.free(blk.region)
        self.blocks.clear()
        if self.region is not None:
            svc.regions.free(self.region)
        if svc.attempts.get(self.key) is self:
            del svc.attempts[self.key]
        await self._reports.flush(svc.settings.control_timeout_s)
        self._released = True
        log.info("decode_attempt_done", request_id=self.request_id, attempt=self.attempt,
                 state=self.state, outcome="ok" if self.error is None else self.error.code.value,
                 ms=round((time.monotonic() - self.t_start) * 1e3, 3))


def _transfers(layers: list[LayerSlots]) -> list[tuple[int, list[LayerSlots]]]:
    """Consecutive entries sharing a transfer id form one transfer (protocol.PullLayers)."""
    out: list[tuple[int, list[LayerSlots]]] = []
    for ls in layers:
        if out and out[-1][0] == ls.transfer_id:
            out[-1][1].append(ls)
        elif any(tid == ls.transfer_id for tid, _ in out):
            raise InvalidArgument(f"PullLayers: transfer {ls.transfer_id} is not consecutive")
        else:
            out.append((ls.transfer_id, [ls]))
    return out


async def _await(task: asyncio.Task) -> None:
    """Wait for ``task`` without cancelling it when the waiter is cancelled."""
    await asyncio.shield(task)


async def _all(coros) -> None:
    """Await every coroutine concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        await cancel_and_wait([t for t in tasks if not t.done()])
