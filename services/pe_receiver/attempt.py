"""One request attempt on a PE receiver: the asyncio shell around its transfer core.

Sequence (docs/datapath.md):

1. allocate the request region ``[L, prompt, B]`` in the PE buffer → report ``allocated``;
2. ``PrepareDecode`` to the plan's DE loader (it allocates its region; on the PE/none path it
   posts one receive per layer ``[l, 0:prompt]``, ``[l, hit:prompt]`` in the oracle, and says
   where);
3. hit KV: PE path — read the hit Full Blocks from the gateway, scattered per layer into
   ``[l, 64j:64(j+1)]``; DE path — pull layers from the DE loader, ``lookahead_layers`` ahead
   of the engine (receives posted first, then ``PullLayers``); split read — the gateway read
   of the hit blocks after ``split_tokens`` runs beside ``PrepareDecode``, then the DE's part
   is pulled as on the DE path; the first reply gives the usable hit → report ``read_done``
   and hand the request to its engine;
4. the engine awaits layer ``l`` (a view), writes the new tokens' KV into ``output(l)`` and puts
   the layer; it is forwarded: ``[l, 0:prompt]`` (PE/none path), ``[l, hit:prompt]`` (DE
   path; oracle, where the hit is resident on both engines) or ``[l, u:prompt]`` from the
   DE's usable part ``u`` (split read) — one message per layer;
5. when the engine finishes: all layers sent → ``PrefillDone`` → report ``prefill_done``.

What may happen when — look-ahead, back-pressure, hit shortening, what to free — is decided by
:class:`~services.pe_receiver.transfer.PrefillTransfer`; this shell feeds it events through the
node's :class:`~services.node.driver.AttemptDriver` (one action table, one task owner, one
wake-up, one deadline) and does the I/O its actions name through the node's
:class:`~services.node.io.NodeIO` and the plan's DE-loader client — it never sees the service.

Any failure (peer death, deadline, bad reply, engine) fails the attempt with a typed error
naming the hop; revocations drop it silently. Either way every task touching the region is
cancelled, every posted receive cancelled, and the pages are freed — after the engine let go
of the request (``finish``/``fail``), so it never writes into pages another request owns.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import numpy as np
import structlog

from common.errors import DualpathError, InternalError
from common.faults import failpoint
from common.protocol import (AbortDecode, LayerSlots, PrefillDone, PullLayers,
                             PullLayersReply, RequestPlan)
from common.rpc import RpcClient
from services.engine_api.prefill import PrefillPort, PrefillRequest
from services.engine_api.prompt import PromptInfo
from services.node.driver import AttemptDriver
from services.node.errors import peer_error as _peer_error, with_hop
from services.node.io import NodeIO
from services.node.reports import both as _both

from services.node.config import PEReceiverConfig
from .transfer import (Abort, AbortDE, Action, AwaitEngineRelease, FreePages, HandOff, LoadLayer,
                       Lookahead, MarkReady, PostPull, PrefillTransfer, SendLayer)

log = structlog.get_logger(__name__)


class PrefillAttempt:
    """The PE side of one (request, attempt); also the engine handle's backend.

    ``io`` is the node's I/O, ``port`` the plan's engine's queue, ``data_path`` the RPC client
    of the plan's DE loader; the service registers the attempt and runs :meth:`run`.
    """

    def __init__(self, io: NodeIO, port: PrefillPort, data_path: RpcClient, plan: RequestPlan,
                 info: PromptInfo, deadline_at: float) -> None:
        self.io, self.port, self.dp, self.plan, self.info = io, port, data_path, plan, info
        self.settings = cast(PEReceiverConfig, io.settings)
        self.engine_id = plan.pe_engine
        self.key = (info.request_id, info.attempt)
        assert plan.de_loader is not None             # checked with the plan
        self.de_ucx = (plan.de_loader.ucx_host, plan.de_loader.ucx_port)
        self.spec = spec = io.spec
        s = self.settings
        self.core = PrefillTransfer(
            info, spec.num_layers, spec.kv_bytes_per_token_per_layer,
            Lookahead(s.lookahead_layers, s.layers_per_pull, s.pulls_in_flight,
                      s.max_unsent_layers), engine_id=plan.pe_engine)
        self.region: Any = None
        self.receives: list[Any] = []
        self.handle: PrefillRequest | None = None
        self._post_lock = asyncio.Lock()        # pulls post their receives in order
        self._ended = False                     # the run's outcome is known (engine: finish)
        self.run_task: asyncio.Task | None = None
        self._releasing = False
        self.t_start = time.monotonic()
        self.drv = AttemptDriver(
            io, self.key, deadline_at, error=lambda: self.core.error,
            on_deadline=lambda: self.drv.feed(self.core.deadline),
            on_stale=self._stale,
            handlers={MarkReady: self._mark_ready, HandOff: self._hand_off,
                      LoadLayer: lambda act: self.drv.tasks.spawn(self._load(act)),
                      PostPull: lambda act: self.drv.tasks.spawn(self._pull(act)),
                      SendLayer: lambda act: self.drv.tasks.spawn(self._send(act), sending=True),
                      Abort: self._on_abort,
                      AwaitEngineRelease: self._await_engine_release,
                      AbortDE: self._abort_de, FreePages: self._free_pages})

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
        return self.drv.remaining

    @property
    def finished_prefill(self) -> bool:
        return self._ended

    def dropped(self) -> bool:
        return self.core.error is not None

    # ------------------------------------------------------------------ main task
    async def run(self) -> None:
        self.run_task = asyncio.current_task()
        try:
            self.core.start()                     # raises if dropped before the task started
            await self._setup()
            await self.drv.until(lambda: self.core.engine_done)
            await self._complete_forward()
            self.drv.cancel_deadline()
            self._ended = True
            self.drv.feed(self.core.finished_ok)
        except BaseException as e:  # noqa: BLE001 — every outcome ends in _release
            self.drv.cancel_deadline()
            self.drv.feed(self._classify, e)
            self._ended = True
            self.drv.feed(self.core.finished_failed)
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
        self.drv.feed(self.core.failed, err)

    def engine_gave_up(self, err: DualpathError) -> None:
        """The engine abandoned the request before claiming it: fail the attempt (reported)."""
        self.drv.feed(self.core.engine_failed, err)

    def drop(self, reason: str) -> None:
        """Revoked (or the service stops): end without reporting."""
        self.drv.feed(self.core.dropped, reason)

    # ------------------------------------------------------------------ actions
    def _mark_ready(self, act: MarkReady) -> None:
        """Nothing to do: the wake after every event lets :meth:`wait_layer` see the core's
        ``ready``."""

    def _hand_off(self, act: HandOff) -> None:
        self.handle = PrefillRequest(self)
        self.port.put(self.handle)

    def _on_abort(self, act: Abort) -> None:
        task = self.run_task
        if task is not None and not self._releasing and task is not asyncio.current_task():
            task.cancel()

    # ------------------------------------------------------------------ setup
    async def _setup(self) -> None:
        io, info, core, p = self.io, self.info, self.core, self.plan
        self.region = await io.regions.allocate(
            self.spec, info.prompt_tokens, f"{info.request_id}#{info.attempt}",
            min(self.remaining, self.settings.alloc_timeout_s))
        self.drv.feed(core.allocated)
        prepare = core.prepare_sent(
            p.de_engine, p.pe_node, io.ucx_address,
            p.split_gateway if info.read_side == "split" else p.read_gateway, self.remaining)
        if info.read_side in ("pe", "split"):
            prep, _ = await _both(self._call(prepare), self._read_pe())
        else:
            prep = await self._call(prepare)
        pace = io.arbiter.active and io.arbiter.cfg.charge_h2d
        self.drv.feed(lambda: core.prepare_replied(prep.forward, pace_loads=pace,
                                                   now=time.monotonic()))

    async def _call(self, msg) -> Any:
        """One data-path call; PullLayers/PrefillDone wait for data, so they get the deadline."""
        budget = self.remaining
        if not isinstance(msg, (PullLayers, PrefillDone)):
            budget = min(budget, self.settings.control_timeout_s)
        try:
            return await self.dp.call(msg, timeout=budget)
        except DualpathError as e:
            raise with_hop(e, "de_loader") from None

    # ------------------------------------------------------------------ PE path: read, load
    async def _read_pe(self) -> None:
        self.drv.feed(self.core.pe_read_done, *await self._read_blocks())

    async def _read_blocks(self) -> tuple[int | None, int | None]:
        """The gateway's prefix of the hit blocks this node reads (all of them; on a split
        read those after the split), read into the region, and the bytes it read
        ((None, None): no read)."""
        info = self.info
        first = info.split_blocks
        if info.hit_tokens == 0:
            return None, None
        got = await self.io.gateways.read_hit(
            self.plan.read_gateway, info.request_id, info.keys[first:info.hit_blocks],
            self.region, self.remaining, self.settings.read_batch_bytes, fault="pe.read.batch",
            first_block=first, read_node=self.plan.read_node)
        return (None, None) if got is None else got

    async def _load(self, act: LoadLayer) -> None:
        """With an emulated CNIC each H2D layer load is paced (§5.2)."""
        await self.io.arbiter.kv(act.nbytes)
        self.drv.feed(self.core.layer_loaded, act.layer)

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
        t, region = self.io.transport, self.region
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
        arrived = self.drv.tasks.spawn(handle.wait())
        arrived.add_done_callback(self._receive_failed)
        layers = [ls.layer for ls in slots]
        try:
            reply: PullLayersReply = await self._call(
                PullLayers(self.info.request_id, self.info.attempt, slots))
            failpoint("pe.pull.recv")
            self.drv.feed(self.core.pull_replied, layers, reply.hit_tokens, reply.returns)
            await arrived
            self.drv.feed(self.core.layers_received, layers, time.monotonic())
        except DualpathError as e:
            self.abort(with_hop(_peer_error(e), "de_loader"))

    def _receive_failed(self, t: asyncio.Future) -> None:
        if not t.cancelled() and isinstance(t.exception(), DualpathError):
            self.abort(with_hop(_peer_error(t.exception()), "de_loader"))

    # ------------------------------------------------------------------ forwarding
    async def _send(self, act: SendLayer) -> None:
        ls = act.slots
        try:
            view = self.region.flat(act.layer, act.first_token, act.last_token)
            await self.io.arbiter.kv(view.nbytes)
            self.core.raise_if_failed()
            failpoint("pe.handoff.send")
            await self.io.transport.send(self.de_ucx, ls.transfer_id, [view], ls.slots,
                                         self.remaining)
            self.drv.feed(self.core.layer_sent, act.layer)
        except DualpathError as e:
            self.abort(with_hop(e, "de_loader"))

    async def _complete_forward(self) -> None:
        await self.drv.until(lambda: self.core.all_sent)
        self.core.raise_if_failed()
        await self._call(PrefillDone(self.info.request_id, self.info.attempt,
                                     self.core.hit_tokens, self.core.first_token_id))
        self.drv.feed(self.core.prefill_done_acked)

    # ------------------------------------------------------------------ engine side
    async def wait_layer(self, layer: int) -> np.ndarray:
        self.drv.feed(self.core.engine_wants, layer)
        await self.drv.until(lambda: self.core.ready[layer])
        return self.region.layer(layer, 0, self.core.hit_tokens)

    def output_view(self, layer: int) -> np.ndarray:
        first, last = self.core.output_range(layer)
        return self.region.layer(layer, first, last)

    def region_layer(self, layer: int) -> np.ndarray:
        self.core.check_layer(layer)
        self.core.raise_if_failed()
        return self.region.layer(layer)

    async def put_layer(self, layer: int) -> None:
        self.drv.feed(self.core.engine_put, layer)
        await self.drv.until(lambda: not self.core.put_blocked)
        self.core.raise_if_failed()

    async def finish(self, first_token_id: int | None) -> None:
        self.drv.feed(self.core.engine_finished, first_token_id)
        await self.drv.until(lambda: self._ended, or_failure=False)
        if self.core.error is not None:
            raise self.core.error

    async def fail(self, error: BaseException | None) -> None:
        self.drv.feed(self.core.engine_failed, error)

    def _stale(self, stage: str) -> None:
        self.drop(f"scheduler: attempt no longer current (after {stage})")

    # ------------------------------------------------------------------ cleanup
    async def _release(self) -> None:
        self._releasing = True
        # Let a layer on the wire finish: cancelling a send aborts the endpoint, which would
        # fail every other transfer in flight to the same DE loader.
        await self.drv.tasks.stop(drain_s=min(self.remaining + 0.1, 2.0))
        for h in self.receives:
            await h.cancel()
        if self.handle is not None and self.port.discard(self.handle):
            self.core.engine_discarded()
        await self.drv.feed_async(self.core.release)
        self.io.ended(self.key, self)
        await self.drv.flush_reports(self.settings.control_timeout_s)
        log.info("prefill_attempt_done", request_id=self.info.request_id,
                 attempt=self.info.attempt, read_side=self.info.read_side,
                 hit=self.core.hit_tokens, prompt=self.info.prompt_tokens,
                 outcome="ok" if self.core.error is None else self.core.error.code.value,
                 ms=round((time.monotonic() - self.t_start) * 1e3, 3))

    async def _await_engine_release(self, act: AwaitEngineRelease) -> None:
        try:
            await asyncio.wait_for(self.drv.until(lambda: not self.core.engine_holds,
                                                  or_failure=False),
                                   self.settings.engine_release_timeout_s)
        except TimeoutError:
            # an engine that never let go (its process silent, stuck or replaced: it may
            # still write) had engine_release_timeout_s; the pages are freed now
            log.warning("engine_did_not_release", request_id=self.info.request_id,
                        engine=self.engine_id,
                        waited_s=self.settings.engine_release_timeout_s)

    async def _abort_de(self, act: AbortDE) -> None:
        """Tell the DE loader to drop its side now (it would at its deadline / revocation)."""
        try:
            await self.dp.call(AbortDecode(self.info.request_id, self.info.attempt, act.reason),
                               timeout=1.0)
        except DualpathError:
            pass

    async def _free_pages(self, act: FreePages) -> None:
        self.io.regions.free(self.region)
