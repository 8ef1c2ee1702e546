"""One request attempt on a PE receiver: the asyncio shell around its transfer core.

Sequence (docs/datapath.md):

1. allocate the request region ``[L, prompt, B]`` in the PE buffer → report ``allocated``;
2. ``PrepareDecode`` to the plan's DE loader (it allocates its region; on the PE/none path it
   posts one receive per layer ``[l, 0:prompt]``, ``[l, hit:prompt]`` in the oracle, and says
   where);
3. hit KV: PE path — read the hit Full Blocks from the gateway, scattered per layer into
   ``[l, 64j:64(j+1)]``; DE path — pull layers from the DE loader, ``lookahead_layers`` ahead
   of the engine (receives posted first, then ``PullLayers``); the first reply gives the usable
   hit → report ``read_done`` and hand the request to its engine;
4. the engine awaits layer ``l`` (a view), writes the new tokens' KV into ``output(l)`` and puts
   the layer; it is forwarded: ``[l, 0:prompt]`` (PE/none path) or ``[l, hit:prompt]`` (DE
   path; oracle, where the hit is resident on both engines) — one message per layer;
5. when the engine finishes: all layers sent → ``PrefillDone`` → report ``prefill_done``.

What may happen when — look-ahead, back-pressure, hit shortening, what to free — is decided by
:class:`~services.pe_receiver.transfer.PrefillTransfer`; this shell feeds it events and runs
the actions it returns (tasks, UCX receives and sends, gateway reads, reports).

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

from common.errors import DualpathError, InternalError
from common.faults import failpoint
from common.protocol import (AbortDecode, LayerSlots, PrefillDone, PullLayers,
                             PullLayersReply, RequestPlan)
from services.engine_api.prefill import PrefillRequest
from services.engine_api.prompt import PromptInfo
from services.node.errors import peer_error as _peer_error, with_hop
from services.node.reports import OrderedReports, both as _both, cancel_and_wait

from .transfer import (Abort, AbortDE, Action, AwaitEngineRelease, Count, FreePages, HandOff,
                       LoadLayer, Log, Lookahead, MarkReady, PostPull, PrefillTransfer, Report,
                       SendLayer)

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
        self.de_ucx = (plan.de_loader.ucx_host, plan.de_loader.ucx_port)
        self.spec = spec = svc.spec
        s = svc.settings
        self.core = PrefillTransfer(
            info, spec.num_layers, spec.kv_bytes_per_token_per_layer,
            Lookahead(s.lookahead_layers, s.layers_per_pull, s.pulls_in_flight,
                      s.max_unsent_layers), engine_id=plan.pe_engine)
        self.region = None
        self.ready = [asyncio.Event() for _ in range(spec.num_layers)]
        self.tasks: set[asyncio.Task] = set()
        self.receives: list[Any] = []
        self._sender: asyncio.Task | None = None
        self.handle: PrefillRequest | None = None
        self._failed = asyncio.Event()
        self._pulse = asyncio.Event()           # the core's state moved (sent, failed …)
        self._post_lock = asyncio.Lock()        # pulls post their receives in order
        self._engine_released = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._engine_done = loop.create_future()
        self._complete = loop.create_future()
        self._run_task: asyncio.Task | None = None
        self._releasing = False
        self._reports = OrderedReports(svc, info.request_id, info.attempt, self._stale)
        self.t_start = time.monotonic()
        self._actions = {Report: lambda act: self._reports.send(act.stage, **act.fields),
                         Log: lambda act: getattr(log, act.level)(act.event, **act.fields),
                         Count: self._count,
                         MarkReady: self._mark_ready, HandOff: self._hand_off,
                         LoadLayer: lambda act: self._spawn(self._load(act)),
                         PostPull: lambda act: self._spawn(self._pull(act)),
                         SendLayer: self._start_send, Abort: self._on_abort}
        self._release_steps = {AwaitEngineRelease: self._await_engine_release,
                               AbortDE: self._abort_de, FreePages: self._free_pages}

    # ------------------------------------------------------------------ properties
    @property
    def hit_tokens(self) -> int:
        return self.core.hit_tokens

    @property
    def t_pull_start(self) -> float | None:
        return self.core.t_pull_start

    @property
    def layer_requested(self) -> list[float | None]:
        return self.core.layer_requested

    @property
    def layer_arrival(self) -> list[float | None]:
        return self.core.layer_arrival

    @property
    def remaining(self) -> float:
        return max(0.0, self.deadline_at - asyncio.get_running_loop().time())

    @property
    def finished_prefill(self) -> bool:
        return self._complete.done()

    def dropped(self) -> bool:
        return self.core.error is not None

    # ------------------------------------------------------------------ main task
    async def run(self) -> None:
        self._run_task = asyncio.current_task()
        try:
            async with asyncio.timeout_at(self.deadline_at):
                self.core.start()                 # raises if dropped before the task started
                await self._setup()
                await self._engine_done
                await self._complete_forward()
            self._complete.set_result(None)
            self._do(self.core.finished_ok())
        except BaseException as e:  # noqa: BLE001 — every outcome ends in _release
            self._do(self._classify(e))
            self._complete.set_exception(self.core.error)
            self._complete.exception()          # retrieved (the engine may not wait)
            self._do(self.core.finished_failed())
        finally:
            await self._release()

    def _classify(self, e: BaseException) -> list[Action]:
        core = self.core
        if core.error is not None:
            return []
        if isinstance(e, DualpathError):
            return core.failed(e, core.phase)
        if isinstance(e, TimeoutError):
            return core.deadline()
        if isinstance(e, asyncio.CancelledError):
            return core.cancelled()
        log.error("prefill_attempt_bug", request_id=self.info.request_id, exc_info=e)
        return core.failed(InternalError(f"PE receiver failed: {type(e).__name__}: {e}"),
                           "pe_receiver")

    def abort(self, err: DualpathError) -> None:
        """A helper task failed: fail the attempt (its main task handles the rest)."""
        self._do(self.core.failed(err))

    def drop(self, reason: str) -> None:
        """Revoked (or the service stops): end without reporting."""
        self._do(self.core.dropped(reason))

    # ------------------------------------------------------------------ actions
    def _do(self, actions: list[Action]) -> None:
        """Run the core's actions in order; waiters re-check the core afterwards."""
        for act in actions:
            self._actions[type(act)](act)
        self._pulse.set()

    def _count(self, act: Count) -> None:
        self.svc.counters[act.counter] += 1

    def _mark_ready(self, act: MarkReady) -> None:
        for layer in act.layers:
            self.ready[layer].set()

    def _hand_off(self, act: HandOff) -> None:
        self.handle = PrefillRequest(self)
        self.svc.ports[self.engine_id].put(self.handle)

    def _on_abort(self, act: Abort) -> None:
        self._failed.set()
        task = self._run_task
        if task is not None and not self._releasing and task is not asyncio.current_task():
            task.cancel()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # ------------------------------------------------------------------ setup
    async def _setup(self) -> None:
        svc, info, core, p = self.svc, self.info, self.core, self.plan
        self.region = await svc.regions.allocate(
            self.spec, info.prompt_tokens, f"{info.request_id}#{info.attempt}",
            min(self.remaining, svc.settings.alloc_timeout_s))
        self._do(core.allocated())
        dp = svc.data_path(p)
        prepare = core.prepare_sent(p.de_engine, p.pe_node, svc.ucx_address, p.read_gateway,
                                    self.remaining)
        if info.read_side == "pe":
            prep, _ = await _both(self._call(dp, prepare), self._read_pe())
        else:
            prep = await self._call(dp, prepare)
        pace = svc.arbiter.active and svc.cfg.arbiter.charge_h2d
        self._do(core.prepare_replied(prep.forward, pace_loads=pace, now=time.monotonic()))

    async def _call(self, dp, msg) -> Any:
        """One data-path call; PullLayers/PrefillDone wait for data, so they get the deadline."""
        budget = self.remaining
        if not isinstance(msg, (PullLayers, PrefillDone)):
            budget = min(budget, self.svc.settings.control_timeout_s)
        try:
            return await dp.call(msg, timeout=budget)
        except DualpathError as e:
            raise with_hop(e, "de_loader") from None

    # ------------------------------------------------------------------ PE path: read, load
    async def _read_pe(self) -> None:
        self._do(self.core.pe_read_done(*await self._read_blocks()))

    async def _read_blocks(self) -> tuple[int | None, int | None]:
        """The gateway's prefix of the hit blocks, read into the region, and the bytes it
        read ((None, None): no read)."""
        info = self.info
        if info.hit_tokens == 0:
            return None, None
        client = self.svc.gateway(self.plan.read_gateway)
        if client is None:
            log.warning("no_gateway_for_read", request_id=info.request_id,
                        read_node=self.plan.read_node)
            return None, None
        n = info.hit_blocks
        dests = [self.region.block_dest(j) for j in range(n)]
        try:
            failpoint("pe.read.batch")
            reply = await client.read_blocks(info.request_id, info.keys[:n], dests,
                                              self.remaining, self.svc.settings.read_batch_bytes,
                                              layer_major=True)
        except DualpathError as e:
            raise with_hop(e, "gateway") from None
        return reply.prefix_blocks, reply.nbytes

    async def _load(self, act: LoadLayer) -> None:
        """With an emulated CNIC each H2D layer load is paced (§5.2)."""
        await self.svc.arbiter.kv(act.nbytes)
        self._do(self.core.layer_loaded(act.layer))

    # ------------------------------------------------------------------ DE path: pull
    async def _pull(self, act: PostPull) -> None:
        try:
            async with self._post_lock:
                slots, handle = await self._post_pull(act)
        except DualpathError as e:
            self.abort(with_hop(e, "de_loader"))
            return
        await self._pull_call(slots, handle)

    async def _post_pull(self, act: PostPull) -> tuple[list[LayerSlots], Any]:
        """One receive for the layers of one call (one transfer: fewer tasks per layer)."""
        t, region = self.svc.transport, self.region
        tid = t.new_transfer_id()
        slots = [LayerSlots(layer, tid, [region.slot(layer, 0, act.hit_tokens)])
                 for layer in act.layers]
        h = await t.expect(self.de_ucx, tid, region.arena, [ls.slots[0] for ls in slots],
                           self.remaining)
        self.receives.append(h)
        self.core.pull_posted(act.layers, time.monotonic())
        return slots, h

    async def _pull_call(self, slots: list[LayerSlots], handle: Any) -> None:
        # Watched from the start: a receive that fails while the call is out (the link to the
        # DE aborted) fails the attempt now, not when the DE's reply comes back — its send
        # into a receive that is gone would only end at the deadline (chaos tests).
        arrived = asyncio.ensure_future(handle.wait())
        arrived.add_done_callback(self._receive_failed)
        layers = [ls.layer for ls in slots]
        try:
            reply: PullLayersReply = await self._call(
                self.svc.data_path(self.plan),
                PullLayers(self.info.request_id, self.info.attempt, slots))
            failpoint("pe.pull.recv")
            self._do(self.core.pull_replied(layers, reply.hit_tokens, reply.returns))
            await arrived
            self._do(self.core.layers_received(layers, time.monotonic()))
        except DualpathError as e:
            self.abort(with_hop(_peer_error(e), "de_loader"))

    def _receive_failed(self, t: asyncio.Future) -> None:
        if not t.cancelled() and isinstance(t.exception(), DualpathError):
            self.abort(with_hop(_peer_error(t.exception()), "de_loader"))

    # ------------------------------------------------------------------ forwarding
    def _start_send(self, act: SendLayer) -> None:
        self._sender = self._spawn(self._send(act))

    async def _send(self, act: SendLayer) -> None:
        t, ls = self.svc.transport, act.slots
        try:
            view = self.region.flat(act.layer, act.first_token, act.last_token)
            await self.svc.arbiter.kv(view.nbytes)
            self.core.raise_if_failed()
            failpoint("pe.handoff.send")
            await t.send(self.de_ucx, ls.transfer_id, [view], ls.slots, self.remaining)
            self._do(self.core.layer_sent(act.layer))
        except DualpathError as e:
            self.abort(with_hop(e, "de_loader"))

    async def _complete_forward(self) -> None:
        while not self.core.all_sent:
            await self._wait_pulse()
        dp = self.svc.data_path(self.plan)
        await self._call(dp, PrefillDone(self.info.request_id, self.info.attempt,
                                         self.core.hit_tokens, self.core.first_token_id))
        self._do(self.core.prefill_done_acked())

    # ------------------------------------------------------------------ engine side
    async def wait_layer(self, layer: int) -> np.ndarray:
        self._do(self.core.engine_wants(layer))
        await self._wait(self.ready[layer])
        return self.region.layer(layer, 0, self.core.hit_tokens)

    def output_view(self, layer: int) -> np.ndarray:
        first, last = self.core.output_range(layer)
        return self.region.layer(layer, first, last)

    def region_layer(self, layer: int) -> np.ndarray:
        self.core.check_layer(layer)
        self.core.raise_if_failed()
        return self.region.layer(layer)

    async def put_layer(self, layer: int) -> None:
        self._do(self.core.engine_put(layer))
        while self.core.put_blocked:
            await self._wait_pulse()

    async def finish(self, first_token_id: int | None) -> None:
        self._engine_released.set()
        self._do(self.core.engine_finished(first_token_id))
        if not self._engine_done.done():
            self._engine_done.set_result(None)
        await asyncio.shield(self._complete)

    async def fail(self, error: BaseException | None) -> None:
        self._engine_released.set()
        self._do(self.core.engine_failed(error))

    # ------------------------------------------------------------------ waiting helpers
    async def _wait(self, event: asyncio.Event) -> None:
        """Wait for ``event``; raise the attempt's error if it fails first."""
        if not event.is_set():
            if self.core.error is None:
                waits = {asyncio.ensure_future(event.wait()),
                         asyncio.ensure_future(self._failed.wait())}
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        if not event.is_set():
            self.core.raise_if_failed()

    async def _wait_pulse(self) -> None:
        self.core.raise_if_failed()
        pulse = self._pulse
        pulse.clear()
        await pulse.wait()
        self.core.raise_if_failed()

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
            self.core.engine_discarded()
        for act in self.core.release():
            await self._release_steps[type(act)](act)
        if svc.attempts.get(self.key) is self:
            del svc.attempts[self.key]
        await self._reports.flush(svc.settings.control_timeout_s)
        log.info("prefill_attempt_done", request_id=self.info.request_id,
                 attempt=self.info.attempt, read_side=self.info.read_side,
                 hit=self.core.hit_tokens, prompt=self.info.prompt_tokens,
                 outcome="ok" if self.core.error is None else self.core.error.code.value,
                 ms=round((time.monotonic() - self.t_start) * 1e3, 3))

    async def _await_engine_release(self, act: AwaitEngineRelease) -> None:
        try:
            await asyncio.wait_for(self._engine_released.wait(),
                                   self.svc.settings.engine_release_timeout_s)
        except TimeoutError:
            log.error("engine_did_not_release", request_id=self.info.request_id,
                      engine=self.engine_id)

    async def _abort_de(self, act: AbortDE) -> None:
        """Tell the DE loader to drop its side now (it would at its deadline / revocation)."""
        try:
            dp = self.svc.data_path(self.plan)
            await dp.call(AbortDecode(self.info.request_id, self.info.attempt, act.reason),
                          timeout=1.0)
        except DualpathError:
            pass

    async def _free_pages(self, act: FreePages) -> None:
        self.svc.regions.free(self.region)
