"""One request attempt on a PE receiver: PE buffer, hit load, layer feed, forwarding, cleanup.

Sequence (docs/datapath.md):

1. allocate the request region ``[L, prompt, B]`` in the PE buffer → report ``allocated``;
2. ``PrepareDecode`` to the plan's DE loader (it allocates its region; on the PE/none path it
   posts one receive per layer ``[l, 0:prompt]`` and says where);
3. hit KV: PE path — read the hit Full Blocks from the gateway, scattered per layer into
   ``[l, 64j:64(j+1)]``; DE path — pull layers from the DE loader, ``lookahead_layers`` ahead
   of the engine (receives posted first, then ``PullLayers``); the first reply gives the usable
   hit → report ``read_done`` and hand the request to its engine;
4. the engine awaits layer ``l`` (a view), writes the new tokens' KV into ``output(l)`` and puts
   the layer; a sender task forwards it: ``[l, 0:prompt]`` (PE/none path) or
   ``[l, hit:prompt]`` (DE path) — one message per layer;
5. when the engine finishes: all layers sent → ``PrefillDone`` → report ``prefill_done``.

Any failure (peer death, deadline, bad reply, engine) fails the attempt with a typed error
naming the hop; revocations drop it silently. Either way every task touching the region is
cancelled, every posted receive cancelled, and the pages are freed — after the engine let go
of the request (``finish``/``fail``), so it never writes into pages another request owns.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from common.errors import (Cancelled, DeadlineExceeded, DualpathError, InternalError,
                           InvalidArgument, PeerFailed, ProtocolError, Unavailable)
from common.faults import failpoint
from common.protocol import (AbortDecode, LayerSlots, PrefillDone, PrepareDecode,
                             PrepareDecodeReply, PullLayers, PullLayersReply, RequestPlan)
from services.engine_api.prefill import PrefillHandle
from services.engine_api.prompt import PromptInfo

from services.node.errors import both as _both, copy_error as _copy, peer_error as _peer_error, with_hop
from services.node.reports import OrderedReports, cancel_and_wait

if TYPE_CHECKING:
    from .service import PEReceiverService

log = structlog.get_logger(__name__)


class PrefillAttempt:
    """The PE side of one (request, attempt); also the engine handle's backend."""

    def __init__(self, svc: PEReceiverService, plan: RequestPlan, info: PromptInfo,
                 deadline_at: float) -> None:
        self.svc, self.plan, self.info = svc, plan, info
        self.engine_id = plan.pe_engine
        self.key = (info.request_id, info.attempt)
        self.deadline_at = deadline_at
        self.spec = svc.spec
        layers = self.spec.num_layers
        self.hit_tokens = info.hit_tokens       # usable hit; final once the read is done
        self.region = None
        self.phase = "pe_receiver"
        self.error: DualpathError | None = None
        self.dropped_reason: str | None = None
        self.ready = [asyncio.Event() for _ in range(layers)]
        self.fwd: list[LayerSlots | None] = [None] * layers
        self.fwd_known = [asyncio.Event() for _ in range(layers)]
        self.put_done = [asyncio.Event() for _ in range(layers)]
        self.put = self.sent = self.consumed = 0
        self._pulls = 0                          # PullLayers calls in flight
        self.first_token_id: int | None = None
        self.tasks: set[asyncio.Task] = set()
        self.receives: list[Any] = []
        self._sender: asyncio.Task | None = None
        self.handle: PrefillHandle | None = None
        self.engine_holds = False
        self._failed = asyncio.Event()
        self._pulse = asyncio.Event()           # engine consumed / a layer was sent
        self._hit_known = asyncio.Event()
        self._engine_released = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._engine_done = loop.create_future()
        self._complete = loop.create_future()
        self._run_task: asyncio.Task | None = None
        self._releasing = False
        self._reports = OrderedReports(svc, info.request_id, info.attempt, self._stale)
        self.t_start = time.monotonic()
        self.t_pull_start: float | None = None
        self.layer_arrival: list[float | None] = [None] * layers
        self.layer_requested: list[float | None] = [None] * layers

    # ------------------------------------------------------------------ properties
    @property
    def de_ucx(self) -> tuple[str, int]:
        ep = self.plan.de_loader
        return (ep.ucx_host, ep.ucx_port)

    @property
    def remaining(self) -> float:
        return max(0.0, self.deadline_at - asyncio.get_running_loop().time())

    @property
    def finished_prefill(self) -> bool:
        return self._complete.done()

    def dropped(self) -> bool:
        return self.error is not None

    # ------------------------------------------------------------------ main task
    async def run(self) -> None:
        self._run_task = asyncio.current_task()
        try:
            async with asyncio.timeout_at(self.deadline_at):
                self._raise_if_failed()           # dropped before the task started
                await self._setup()
                self.phase = "engine"
                await self._engine_done
                await self._complete_forward()
            self._complete.set_result(None)
            self.svc.counters["attempts_ok"] += 1
        except BaseException as e:  # noqa: BLE001 — every outcome ends in _release
            err = self.error or self._classify(e)
            self._set_error(err)
            self._complete.set_exception(err)
            self._complete.exception()          # retrieved (the engine may not wait)
            if self.dropped_reason is None:
                self.svc.counters["attempts_failed"] += 1
                log.warning("prefill_attempt_failed", request_id=self.info.request_id,
                            attempt=self.info.attempt, hop=err.hop, code=err.code.value,
                            error=err.message)
                self._report("failed", code=err.code.value, message=err.message[:500],
                             retryable=err.retryable, hop=err.hop)
            else:
                self.svc.counters["attempts_dropped"] += 1
        finally:
            await self._release()

    def _classify(self, e: BaseException) -> DualpathError:
        if isinstance(e, DualpathError):
            return with_hop(e, self.phase)
        if isinstance(e, TimeoutError):
            return with_hop(DeadlineExceeded(
                f"request {self.info.request_id} attempt {self.info.attempt}: deadline passed "
                f"during {self.phase}"), self.phase)
        if isinstance(e, asyncio.CancelledError):
            self.dropped_reason = self.dropped_reason or "cancelled"
            return with_hop(Cancelled("attempt cancelled (service stopping)"), "pe_receiver")
        log.error("prefill_attempt_bug", request_id=self.info.request_id, exc_info=e)
        return with_hop(InternalError(f"PE receiver failed: {type(e).__name__}: {e}"),
                        "pe_receiver")

    def _set_error(self, err: DualpathError) -> None:
        if self.error is None:
            self.error = err
        self._failed.set()
        self._pulse.set()

    def abort(self, err: DualpathError) -> None:
        """A helper task failed: fail the attempt (its main task handles the rest)."""
        if self.error is not None:
            return
        self._set_error(err)
        if (self._run_task is not None and not self._releasing
                and self._run_task is not asyncio.current_task()):
            self._run_task.cancel()

    def drop(self, reason: str) -> None:
        """Revoked (or the service stops): end without reporting."""
        if self.error is not None:
            return
        self.dropped_reason = reason
        self.abort(with_hop(Cancelled(f"attempt dropped: {reason}"), "scheduler"))

    # ------------------------------------------------------------------ setup
    async def _setup(self) -> None:
        svc, info, spec = self.svc, self.info, self.spec
        self.phase = "pe_buffer"
        self.region = await svc.regions.allocate(
            spec, info.prompt_tokens, f"{info.request_id}#{info.attempt}",
            min(self.remaining, svc.settings.alloc_timeout_s))
        self._report("allocated")
        self.phase = "de_loader"
        dp = svc.data_path(self.plan)
        prepare = self._prepare_msg()
        if info.read_side == "pe":
            self.phase = "gateway"
            prep, hit = await _both(self._call(dp, prepare), self._read_pe())
            self.hit_tokens = hit
        else:
            prep = await self._call(dp, prepare)
        self._check_prepare(prep)
        if info.read_side == "de":
            self.phase = "de_loader"
            self._spawn(self._pull(dp))
            await self._wait(self._hit_known)
        else:
            if info.read_side == "none":
                self.hit_tokens = 0
            for i, ls in enumerate(prep.forward):
                self.fwd[i] = ls
                self.fwd_known[i].set()
            self._spawn(self._load())
        self._report("read_done")
        self.handle = PrefillHandle(self)
        self.engine_holds = True
        self.svc.ports[self.engine_id].put(self.handle)
        self._sender = self._spawn(self._send_layers())

    def _prepare_msg(self) -> PrepareDecode:
        p, info = self.plan, self.info
        host, port = self.svc.ucx_address
        return PrepareDecode(
            info.request_id, info.attempt, info.session_id, p.de_engine, p.pe_node,
            info.read_side, info.prompt_tokens, info.hit_tokens, info.gen_tokens,
            list(info.keys[:info.hit_blocks]), list(info.keys[info.hit_blocks:]), host, port,
            list(info.tail_token_ids) if info.tail_token_ids is not None else None,
            p.read_gateway if info.read_side == "de" else None, self.remaining)

    def _check_prepare(self, prep: PrepareDecodeReply) -> None:
        want = [] if self.info.read_side == "de" else list(range(self.spec.num_layers))
        row = self.info.prompt_tokens * self.spec.kv_bytes_per_token_per_layer
        if [ls.layer for ls in prep.forward] != want or any(
                sum(n for _, n in ls.slots) != row for ls in prep.forward):
            raise with_hop(ProtocolError(
                f"DE loader answered PrepareDecode with forward slots for layers "
                f"{[ls.layer for ls in prep.forward][:8]}..., expected {len(want)} layers of "
                f"{row} B"), "de_loader")

    async def _call(self, dp, msg) -> Any:
        """One data-path call; PullLayers/PrefillDone wait for data, so they get the deadline."""
        budget = self.remaining
        if not isinstance(msg, (PullLayers, PrefillDone)):
            budget = min(budget, self.svc.settings.control_timeout_s)
        try:
            return await dp.call(msg, timeout=budget)
        except DualpathError as e:
            raise with_hop(e, "de_loader") from None

    # ------------------------------------------------------------------ PE path: read
    async def _read_pe(self) -> int:
        info = self.info
        if info.hit_tokens == 0:
            return 0
        client = self.svc.gateway(self.plan.read_gateway)
        if client is None:
            log.warning("no_gateway_for_read", request_id=info.request_id,
                        read_node=self.plan.read_node)
            return 0
        n = info.hit_blocks
        dests = [self.region.block_dest(j) for j in range(n)]
        try:
            failpoint("pe.read.batch")
            reply = await client.read_blocks(info.request_id, info.keys[:n], dests,
                                              self.remaining, self.svc.settings.read_batch_bytes,
                                              layer_major=True)
        except DualpathError as e:
            raise with_hop(e, "gateway") from None
        if reply.prefix_blocks < n:
            self.svc.counters["hit_shortened"] += 1
            log.info("hit_shortened", request_id=info.request_id, planned_blocks=n,
                     found_blocks=reply.prefix_blocks, side="pe")
        return min(info.hit_tokens, reply.prefix_blocks * info.block_tokens)

    async def _load(self) -> None:
        """Mark layers loaded; with an emulated CNIC each H2D layer load is paced (§5.2)."""
        arb, nbytes = self.svc.arbiter, self.hit_tokens * self.spec.kv_bytes_per_token_per_layer
        if not (nbytes and arb.active and self.svc.cfg.arbiter.charge_h2d):
            for ev in self.ready:
                ev.set()
            return
        k = self.svc.settings.lookahead_layers
        for layer in range(self.spec.num_layers):
            while layer >= self.consumed + k:
                await self._wait_pulse()
            await arb.kv(nbytes)
            self.ready[layer].set()

    # ------------------------------------------------------------------ DE path: pull
    async def _pull(self, dp) -> None:
        """Keep ``lookahead_layers`` pulled ahead of the engine, ``layers_per_pull`` per call."""
        s, L = self.svc.settings, self.spec.num_layers
        k, per, nxt = s.lookahead_layers, s.layers_per_pull, 0
        self.t_pull_start = time.monotonic()
        try:
            while nxt < L:
                # Bounded in flight too: concurrent transfers interleave on the wire, so
                # fewer of them at once make layers arrive in the order the engine needs.
                while nxt >= self.consumed + k or self._pulls >= s.pulls_in_flight:
                    await self._wait_pulse()
                # Calls ramp up 1, 1, 2, 4, ... layers: the first reply (the usable hit) hands
                # the request to the engine, and the next layers should follow it closely.
                end = min(L, nxt + min(per, max(1, nxt)), self.consumed + k)
                slots, handle = await self._post_pull(range(nxt, end))
                first, nxt = nxt == 0, end
                self._spawn(self._pull_call(dp, slots, handle))
                if first:       # layer 0 alone on the wire: the engine starts on it sooner
                    await self._wait(self._hit_known)
        except DualpathError as e:
            self.abort(with_hop(e, "de_loader"))

    async def _post_pull(self, layers) -> tuple[list[LayerSlots], Any]:
        """One receive for the layers of one call (one transfer: fewer tasks per layer)."""
        t, region, hit = self.svc.transport, self.region, self.info.hit_tokens
        tid = t.new_transfer_id()
        slots = [LayerSlots(layer, tid, [region.slot(layer, 0, hit)]) for layer in layers]
        h = await t.expect(self.de_ucx, tid, region.arena, [ls.slots[0] for ls in slots],
                           self.remaining)
        self.receives.append(h)
        now = time.monotonic()
        for layer in layers:
            self.layer_requested[layer] = now
        return slots, h

    async def _pull_call(self, dp, slots: list[LayerSlots], handle: Any) -> None:
        self._pulls += 1
        # Watched from the start: a receive that fails while the call is out (the link to the
        # DE aborted) fails the attempt now, not when the DE's reply comes back — its send
        # into a receive that is gone would only end at the deadline (chaos tests).
        arrived = asyncio.ensure_future(handle.wait())
        arrived.add_done_callback(self._receive_failed)
        try:
            reply: PullLayersReply = await self._call(
                dp, PullLayers(self.info.request_id, self.info.attempt, slots))
            self._apply_pull_reply(reply, [ls.layer for ls in slots])
            failpoint("pe.pull.recv")
            await arrived
            now = time.monotonic()
            for ls in slots:
                self.layer_arrival[ls.layer] = now
                self.ready[ls.layer].set()
        except DualpathError as e:
            self.abort(with_hop(_peer_error(e), "de_loader"))
        finally:
            self._pulls -= 1
            self._pulse.set()

    def _receive_failed(self, t: asyncio.Future) -> None:
        if not t.cancelled() and isinstance(t.exception(), DualpathError):
            self.abort(with_hop(_peer_error(t.exception()), "de_loader"))

    def _apply_pull_reply(self, reply: PullLayersReply, layers: list[int]) -> None:
        bt, hit, b = self.info.block_tokens, reply.hit_tokens, self.spec.kv_bytes_per_token_per_layer
        if not 0 <= hit <= self.info.hit_tokens or hit % bt:
            raise ProtocolError(f"DE loader reported hit {hit} for a planned hit of "
                                f"{self.info.hit_tokens}")
        if self._hit_known.is_set() and hit != self.hit_tokens:
            raise ProtocolError(f"DE loader changed the hit from {self.hit_tokens} to {hit}")
        row = (self.info.prompt_tokens - hit) * b
        if [r.layer for r in reply.returns] != layers or any(
                sum(n for _, n in r.slots) != row for r in reply.returns):
            raise ProtocolError(f"DE loader's return slots do not match layers {layers}")
        if not self._hit_known.is_set():
            if hit < self.info.hit_tokens:
                self.svc.counters["hit_shortened"] += 1
                log.info("hit_shortened", request_id=self.info.request_id,
                         planned=self.info.hit_tokens, hit=hit, side="de")
            self.hit_tokens = hit
            self._hit_known.set()
        for r in reply.returns:
            self.fwd[r.layer] = r
            self.fwd_known[r.layer].set()

    # ------------------------------------------------------------------ forwarding
    async def _send_layers(self) -> None:
        t, arb = self.svc.transport, self.svc.arbiter
        first = self.hit_tokens if self.info.read_side == "de" else 0
        try:
            for layer in range(self.spec.num_layers):
                await self._wait(self.put_done[layer])
                await self._wait(self.fwd_known[layer])
                ls = self.fwd[layer]
                view = self.region.flat(layer, first, self.info.prompt_tokens)
                await arb.kv(view.nbytes)
                self._raise_if_failed()
                failpoint("pe.handoff.send")
                await t.send(self.de_ucx, ls.transfer_id, [view], ls.slots, self.remaining)
                self.sent = layer + 1
                self._pulse.set()
        except DualpathError as e:
            self.abort(with_hop(e, "de_loader"))

    async def _complete_forward(self) -> None:
        self.phase = "de_loader"
        while self.sent < self.spec.num_layers:
            await self._wait_pulse()
        dp = self.svc.data_path(self.plan)
        await self._call(dp, PrefillDone(self.info.request_id, self.info.attempt,
                                         self.hit_tokens, self.first_token_id))
        self._report("prefill_done")

    # ------------------------------------------------------------------ engine side
    async def wait_layer(self, layer: int) -> np.ndarray:
        self._check_layer(layer)
        if layer + 1 > self.consumed:
            self.consumed = layer + 1
            self._pulse.set()
        await self._wait(self.ready[layer])
        return self.region.layer(layer, 0, self.hit_tokens)

    def output_view(self, layer: int) -> np.ndarray:
        self._check_layer(layer)
        self._raise_if_failed()
        if not self.ready[layer].is_set():    # its load may still overwrite part of it
            raise InvalidArgument(f"output({layer}) before its hit KV was loaded: await "
                                  f"layer({layer}) first")
        return self.region.layer(layer, self.hit_tokens, self.info.prompt_tokens)

    def region_layer(self, layer: int) -> np.ndarray:
        self._check_layer(layer)
        self._raise_if_failed()
        return self.region.layer(layer)

    async def put_layer(self, layer: int) -> None:
        self._raise_if_failed()
        if layer != self.put:
            raise InvalidArgument(f"put_layer({layer}): layers are put in order, next is "
                                  f"{self.put}")
        self.put += 1
        self.put_done[layer].set()
        while self.put - self.sent > self.svc.settings.max_unsent_layers:
            await self._wait_pulse()

    async def finish(self, first_token_id: int | None) -> None:
        self.engine_holds = False
        self._engine_released.set()
        if self.put != self.spec.num_layers and self.error is None:
            self.abort(with_hop(InvalidArgument(
                f"engine finished after putting {self.put} of {self.spec.num_layers} layers"),
                "engine"))
        self.first_token_id = first_token_id
        if not self._engine_done.done():
            self._engine_done.set_result(None)
        await asyncio.shield(self._complete)

    async def fail(self, error: BaseException | None) -> None:
        self.engine_holds = False
        self._engine_released.set()
        if self.error is None:
            err = error if isinstance(error, DualpathError) else InternalError(
                f"prefill engine {self.engine_id} gave up: {error!r}")
            self.abort(with_hop(err, "engine"))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise InvalidArgument(f"layer {layer} out of range [0, {self.spec.num_layers})")

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise _copy(self.error)

    # ------------------------------------------------------------------ waiting helpers
    async def _wait(self, event: asyncio.Event) -> None:
        """Wait for ``event``; raise the attempt's error if it fails first."""
        if not event.is_set():
            if self.error is None:
                waits = {asyncio.ensure_future(event.wait()),
                         asyncio.ensure_future(self._failed.wait())}
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        if not event.is_set():
            self._raise_if_failed()

    async def _wait_pulse(self) -> None:
        self._raise_if_failed()
        pulse = self._pulse
        pulse.clear()
        await pulse.wait()
        self._raise_if_failed()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # ------------------------------------------------------------------ reports
    def _report(self, stage: str, **kw: Any) -> None:
        self._reports.send(stage, **kw)

    def _stale(self, stage: str) -> None:
        self.drop(f"scheduler: attempt no longer current (after {stage})")

    # ------------------------------------------------------------------ cleanup
    async def _release(self) -> None:
        svc = self.svc
        self._releasing = True
        if self._sender is not None and not self._sender.done():
            # Let a layer on the wire finish: cancelling a send aborts the endpoint, which
            # would fail every other transfer in flight to the same DE loader.
            await asyncio.wait([self._sender], timeout=min(self.remaining + 0.1, 2.0))
        await cancel_and_wait(list(self.tasks))
        for h in self.receives:
            await h.cancel()
        if self.handle is not None and svc.ports[self.engine_id].discard(self.handle):
            self.engine_holds = False
        if self.engine_holds:
            try:
                await asyncio.wait_for(self._engine_released.wait(),
                                       svc.settings.engine_release_timeout_s)
            except TimeoutError:
                log.error("engine_did_not_release", request_id=self.info.request_id,
                          engine=self.engine_id)
        if self.error is not None and self.dropped_reason is None and self.region is not None:
            await self._abort_de()
        if self.region is not None:
            svc.regions.free(self.region)
        if svc.attempts.get(self.key) is self:
            del svc.attempts[self.key]
        await self._reports.flush(svc.settings.control_timeout_s)
        log.info("prefill_attempt_done", request_id=self.info.request_id,
                 attempt=self.info.attempt, read_side=self.info.read_side,
                 hit=self.hit_tokens, prompt=self.info.prompt_tokens,
                 outcome="ok" if self.error is None else self.error.code.value,
                 ms=round((time.monotonic() - self.t_start) * 1e3, 3))

    async def _abort_de(self) -> None:
        """Tell the DE loader to drop its side now (it would at its deadline / revocation)."""
        err = self.error
        if getattr(err, "hop", "") == "de_loader" and isinstance(err, (PeerFailed, Unavailable)):
            return
        try:
            dp = self.svc.data_path(self.plan)
            await dp.call(AbortDecode(self.info.request_id, self.info.attempt, err.message[:300]),
                          timeout=1.0)
        except DualpathError:
            pass
