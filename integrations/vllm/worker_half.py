"""The connector's worker half (vLLM's worker process): KV in and out of the paged cache.

* Claims and decode loads run off the step (:mod:`integrations.vllm.off_step`); a request
  reaches a forward only once its claim is known.
* Prefill: ``wait_for_layer_load(l)`` scatters layer ``l`` of the hit into the paged cache —
  the session blocks until that layer arrived, so layer ``l+1`` loads while ``l`` computes
  (paper §4.2). ``save_kv_layer`` gathers the new tokens' KV of each finished layer into the
  session's output slots and puts the layer once the prompt is complete.
* A finished request's session is finished on a thread (decode: write-back of its full
  blocks, read from the paged cache) and reported in ``get_finished``; vLLM keeps its blocks
  until then.
* A load that fails, times out or comes up short fails the session (dualpath re-plans it):
  in a forward its loaded blocks go to ``get_block_ids_with_load_errors`` — also when the
  session was dropped earlier in the forward (a save failed) and later layers' rows will never
  arrive — and vLLM evicts them and ends the request (prefill policy ``"fail"``); off the step
  the request is reported in ``failed_recving`` and vLLM recomputes it — never wrong KV, never
  a hang.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog
import torch

from integrations.vllm.counters import ConnectorCounters
from integrations.vllm.geometry import (
    VERIFIED_ISAS,
    CacheGeometry,
    gather_layer_into,
    scatter_range,
    token_slots,
)
from integrations.vllm.metadata import DualPathMetadata, DualPathWorkerMeta, Finish, ReqStep
from integrations.vllm.off_step import LayoutRefused, OffStep, Sessions, refuse_unverified
from integrations.vllm.sessions import KVSource
from services.engine_api.blocking import SyncPrefillHandle
from services.engine_api.liveness import StepClock

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = structlog.get_logger(__name__)

_LAYER_RE = re.compile(r"layers\.(\d+)\.")
IDLE_WAIT_S = 0.01      # an empty step waits this long at most for a claim or load to end


class WorkerHalf:
    """The worker process's side of one connector (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, source: KVSource,
                 bound_meta: Callable[[], Any], *, decode: bool, layer_timeout_s: float,
                 claim_timeout_s: float, open_threads: int) -> None:
        self._vllm_config = vllm_config
        self._bound_meta = bound_meta    # vLLM's metadata bound for this step
        self._source, self._decode = source, decode
        self._timeout_s = layer_timeout_s
        self._claim_timeout_s = claim_timeout_s
        self._open_threads = open_threads
        self._block_size = vllm_config.cache_config.block_size
        self._caches: dict[int, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self._name_of: dict[int, str] = {}
        self._geom: CacheGeometry | None = None
        self._prepared: DualPathMetadata | None = None
        self._idle = False
        self._sessions = Sessions()
        self._off: OffStep | None = None
        self._load_errors: set[int] = set()
        self._block_tables: dict[str, list[int]] = {}
        self._finishing: dict[str, Future[None]] = {}
        self._done_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._notices: ThreadPoolExecutor | None = None
        self.counters = ConnectorCounters()     # read by the connector's get_kv_connector_stats
        # vLLM's steps, as the node's engine socket sees them (an engine source has one)
        self._steps: StepClock | None = getattr(source, "steps", None)

    # ------------------------------------------------------------------ caches
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for order, (name, cache) in enumerate(kv_caches.items()):
            match = _LAYER_RE.search(name)
            layer = int(match.group(1)) if match else order
            self._layer_of[name] = layer
            self._name_of[layer] = name
            self._caches[layer] = cache
        first = next(iter(kv_caches.values()))
        self._geom = CacheGeometry.of_cache(first)
        spec = self._source.spec
        if (len(self._caches), self._geom.token_bytes) != (spec.num_layers,
                                                           spec.kv_bytes_per_token_per_layer):
            raise ValueError(f"vLLM registered {len(self._caches)} KV layers of "
                             f"{self._geom.token_bytes} B/token; the KV source expects "
                             f"{spec.describe()}")
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dualpath-finish")
        # one thread: a decode request's notices (second token, pages back) reach the node
        # in the order its steps posted them
        self._notices = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dualpath-notice")
        self._off = OffStep(self._source, self._sessions, decode=self._decode,
                            claim_timeout_s=self._claim_timeout_s,
                            num_layers=len(self._caches), check_layout=self._check_layout,
                            copy_hit=self._copy_hit, threads=self._open_threads,
                            counters=self.counters, post=self._notices.submit)
        keep = getattr(self._source, "keep_attached", None)
        if keep is not None:     # attached now and again after a node restart: the node
            keep()               # reports an engine with nothing attached, not placed on
        live = self._live_cache(0) if 0 in self._caches else first
        log.info("dualpath_kv_caches_registered", layers=len(self._caches),
                 geometry=str(self._geom), shape=tuple(first.shape),
                 same_as_forward=live.data_ptr() == self._caches[0].data_ptr())

    def _live_cache(self, layer: int) -> torch.Tensor:
        """The cache tensor the attention layer reads (vLLM's static forward context, which its
        own block zeroing also reads; on the CPU backend it is the registered tensor)."""
        name = self._name_of[layer]
        ctx = self._vllm_config.compilation_config.static_forward_context.get(name)
        cache = getattr(ctx, "kv_cache", None)
        return cache if isinstance(cache, torch.Tensor) else self._caches[layer]

    def _check_layout(self) -> None:
        """Refuse (every request recomputes) on a CPU attention ISA whose in-block KV layout
        was not measured: wrong KV must never reach the cache (geometry.VERIFIED_ISAS)."""
        ctx = self._vllm_config.compilation_config.static_forward_context.get(self._name_of[0])
        isa = getattr(ctx, "isa", None)
        refuse_unverified(isa, VERIFIED_ISAS)
        assert self._geom is not None and isinstance(isa, str)
        if self._geom.isa != isa:             # known only once vLLM built its attention
            try:
                self._geom = self._geom.for_isa(isa)
            except ValueError as e:
                raise LayoutRefused(str(e)) from None

    def _copy_hit(self, session: Any, layer: int, start: int, stop: int,
                  block_ids: list[int]) -> None:
        """Hit tokens ``[start, stop)`` of one layer from the session into the paged cache."""
        assert self._geom is not None
        t0 = time.monotonic()
        src = session.layer(layer, self._timeout_s)[start:stop]
        scatter_range(self._geom, self._live_cache(layer), block_ids, start, stop,
                      torch.from_numpy(src))
        self.counters.loaded((stop - start) * self._geom.token_bytes, time.monotonic() - t0)

    # ------------------------------------------------------------------ per step
    def start(self, forward_context: Any) -> None:
        # vLLM runs a step without a forward (no attention metadata) while requests only
        # wait for KV: that step may wait a little for an outcome instead of spinning
        self._idle = getattr(forward_context, "attn_metadata", None) is None
        self.prepare()

    def prepare(self) -> list[ReqStep]:
        """This step's work, set up once: finishes, claims and loads started. vLLM calls
        ``start_load_kv`` before the forward only when the step has sync loads, after it
        otherwise, so the layer hooks prepare too, whichever comes first."""
        meta = self._vllm_meta()
        if self._prepared is not meta:
            self._prepared = meta
            assert self._off is not None
            for rid, fin in meta.finishes.items():
                self._start_finish(rid, fin)
            for op in meta.opens:
                self._off.open(op)
            for load in meta.loads:
                self._off.load(load)
            for step in meta.steps:
                self._block_tables[step.req_id] = step.block_ids
        return meta.steps

    def _vllm_meta(self) -> DualPathMetadata:
        meta = self._bound_meta()
        assert isinstance(meta, DualPathMetadata)
        return meta

    def load_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: the prefill hit of this layer, into the cache."""
        layer = self._layer_of.get(layer_name)
        if layer is None or self._geom is None:
            return
        for step in self.prepare():
            start, stop = step.load
            if stop <= start:
                continue
            session = self._sessions.get(step.req_id)
            if session is None:
                # dropped earlier in this forward (a save of an earlier layer failed): these
                # rows will never arrive, and vLLM already counts them computed (and cached):
                # report them, or the next request with this prefix computes over them
                self._load_errors.update(self._load_blocks(step))
                continue
            try:
                self._copy_hit(session, layer, start, stop, step.block_ids)
            except Exception as e:  # noqa: BLE001 -- any load failure means: recompute
                self._fail_load(step, layer, e)

    def _fail_load(self, step: ReqStep, layer: int | None, err: Exception) -> None:
        log.warning("dualpath_load_failed", request_id=step.req_id, layer=layer, error=str(err))
        session = self._sessions.pop(step.req_id)
        if session is not None:     # counted once per request: later layers find it gone
            self.counters.add("load_errors")
            self.counters.add("recompute_fallbacks")
        self._load_errors.update(self._load_blocks(step))
        if session is not None:
            session.fail(f"load failed at layer {layer}: {err}")

    def _load_blocks(self, step: ReqStep) -> list[int]:
        """The blocks holding the step's loaded rows (empty when it loads nothing)."""
        start, stop = step.load
        if stop <= start:
            return []
        first, last = start // self._block_size, (stop - 1) // self._block_size
        return step.block_ids[first:last + 1]

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """vLLM's ``save_kv_layer`` (prefill): the new tokens' KV into the output slots."""
        layer = self._layer_of.get(layer_name)
        if layer is None or self._geom is None or self._decode:
            return
        for step in self.prepare():
            session = self._sessions.get(step.req_id)
            if session is None:
                continue
            start, stop = step.save
            if stop <= start:
                continue
            try:
                self._save(session, step, layer, kv_layer, start, stop)
            except Exception as e:  # noqa: BLE001 -- the dualpath attempt fails, vLLM goes on
                log.warning("dualpath_save_failed", request_id=step.req_id, layer=layer,
                            error=str(e))
                self._sessions.pop(step.req_id)     # later layers' loads: reported (load_layer)
                session.fail(f"save of layer {layer} failed: {e}")

    def _save(self, session: SyncPrefillHandle, step: ReqStep, layer: int, kv_layer: torch.Tensor,
              start: int, stop: int) -> None:
        """Gather tokens ``[start, stop)`` of one layer into the session's output slots; put the
        layer once the prompt is complete. The rows come from the paged cache whether this
        forward computed them or vLLM held them (its local hit above the dualpath hit). The
        engine API hands out a layer's output only after its hit was asked for (``layer(l)``),
        which a first forward with nothing to load (no hit, or vLLM's local hit covers it)
        also does here."""
        assert self._geom is not None
        if step.ask_hit:
            session.layer(layer, self._timeout_s)
        hit = session.hit_tokens
        dst = torch.from_numpy(session.output(layer)[start - hit:stop - hit])
        slots = token_slots(step.block_ids, self._block_size, start, stop)
        gather_layer_into(self._geom, kv_layer, slots, dst)
        if stop == step.prompt_tokens:
            # pipelined: no round trip to the node per layer inside the forward; a failed
            # put is raised by the session's next call (the next layer's load or put, or
            # finish, off the forward path), which fails the dualpath attempt as above
            session.put_layer(layer, wait=False)

    def end_step(self) -> None:
        """vLLM's ``wait_for_save``: decode sessions count their forwards (TTST). A decode
        request whose whole hit vLLM held locally (prefix caching) had no load: its first
        forward hands the node's pages back. What they tell the node goes out on the notice
        thread, never waited for here (decode_session.py)."""
        if self._decode and self._prepared is not None:
            for step in self._prepared.steps:
                if (session := self._sessions.get(step.req_id)) is not None:
                    try:
                        session.after_step()
                    except Exception as e:  # noqa: BLE001 -- the KV is in vLLM already
                        log.warning("dualpath_decode_report_failed", request_id=step.req_id,
                                    error=str(e))
        self._prepared = None

    # ------------------------------------------------------------------ finishing
    def _start_finish(self, rid: str, fin: Finish) -> None:
        assert self._off is not None
        blocks = self._block_tables.pop(rid, [])
        if self._off.give_up(rid):
            return                       # the claim or load in flight ends the session
        session = self._sessions.pop(rid)
        done: Future[None] = Future()
        if session is None:
            done.set_result(None)
        else:
            assert self._pool is not None
            done = self._pool.submit(self._finish, rid, session, fin.output_ids, blocks)
        if fin.report:
            with self._done_lock:
                self._finishing[rid] = done

    def _finish(self, rid: str, session: Any, output_ids: list[int] | None,
                blocks: list[int]) -> None:
        """Off the forward path; vLLM keeps the request's blocks until get_finished says so."""
        try:
            if not output_ids:
                session.fail("request ended before its first token")
            elif self._decode:
                session.finish(output_ids, lambda start, page: self._fill(blocks, start, page))
            else:
                session.finish(output_ids[0])
        except Exception:  # noqa: BLE001 -- logged; the request's blocks are freed regardless
            log.exception("dualpath_finish_failed", request_id=rid)
            session.fail("finish failed")

    def _fill(self, blocks: list[int], start: int, page: Any) -> None:
        """Copy tokens ``[start, start + T)`` of every layer into a ``[L, T, B]`` page."""
        assert self._geom is not None
        slots = token_slots(blocks, self._block_size, start, start + page.shape[1])
        for layer in self._caches:
            gather_layer_into(self._geom, self._live_cache(layer), slots,
                              torch.from_numpy(page[layer]))

    # ------------------------------------------------------------------ reporting
    def step_began(self) -> None:
        """vLLM bound this step's metadata: a step (forward or not) runs until its
        :meth:`transfer_results`."""
        if self._steps is not None:
            self._steps.began()

    def transfer_results(self) -> tuple[set[str], set[str], set[str], DualPathWorkerMeta | None]:
        """Finished sessions, loads ended, loads failed, claims answered — once each; the
        step's last connector call."""
        try:
            return self._transfer_results()
        finally:
            if self._steps is not None:
                self._steps.ended()

    def _transfer_results(self) -> tuple[set[str], set[str], set[str], DualPathWorkerMeta | None]:
        assert self._off is not None
        if self._idle:
            self._off.wait_idle(IDLE_WAIT_S)
        opened, received, failed = self._off.drain()
        with self._done_lock:
            done = {rid for rid, fut in self._finishing.items() if fut.done()}
            for rid in done:
                del self._finishing[rid]
        return done, received, failed, DualPathWorkerMeta(opened) if opened else None

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        stop_keeping = getattr(self._source, "stop_keeping", None)
        if stop_keeping is not None:
            stop_keeping()
        if self._off is not None:
            self._off.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._notices is not None:
            self._notices.shutdown(wait=True)
