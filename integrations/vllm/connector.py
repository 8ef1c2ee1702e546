"""``DualPathConnector``: vLLM 0.32's KV connector API driven by dualpath (docs/vllm.md).

Load it with::

    --kv-transfer-config '{"kv_connector": "DualPathConnector",
      "kv_connector_module_path": "integrations.vllm.connector", "kv_role": "kv_producer",
      "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'

A request takes part when its ``kv_transfer_params`` hold ``{"dualpath": {...}}`` (the front
puts the plan there); others run as plain vLLM.

* Scheduler side (engine-core process): ``get_num_new_matched_tokens`` is the planned hit;
  block tables, token ranges and finishes travel to the worker as plain data in
  ``DualPathMetadata`` (on CPU, vLLM always runs the worker in its own process).
* Worker side: the first step of a request opens its session. ``wait_for_layer_load(l)``
  scatters layer ``l`` of the hit into the paged cache — the session blocks until that layer
  arrived, so layer ``l+1`` loads while ``l`` computes (paper §4.2). ``save_kv_layer`` gathers
  the new tokens' KV of each finished layer into the session's output slots and puts the layer
  once the prompt is complete. ``request_finished`` delays the block free; the next step tells
  the worker the first token, the worker finishes the session off the forward path and reports
  the request in ``get_finished``.
* A load that fails, times out or comes up short fails the session (dualpath re-plans it) and
  reports the request's loaded blocks through ``get_block_ids_with_load_errors``, so vLLM
  recomputes them (``kv_load_failure_policy="recompute"``): never wrong KV, never a hang.
* Tensor parallelism 1 only: a TP > 1 vLLM would announce its collectives to the node
  (``collective_begin`` / ``collective_end`` on the engine client) so KV egress stays below
  them; not supported yet (docs/vllm.md, "Collectives").
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from common.kv import PRESETS
from integrations.vllm.geometry import (
    VERIFIED_ISAS,
    CacheGeometry,
    gather_layer_into,
    scatter_range,
    token_slots,
)
from integrations.vllm.kv_spec import check_same_layout, check_supported, spec_from_vllm
from integrations.vllm.local_store import LocalKVStore
from integrations.vllm.sessions import KVSource
from services.engine_api.blocking import SyncPrefillHandle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)

PARAMS_KEY = "dualpath"
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class OpenRequest:
    """First step of a request: what the worker needs to open its session."""

    dualpath_id: str
    token_ids: list[int]
    planned_hit: int


@dataclass
class ReqStep:
    """One request's work in one step: hit tokens to load, tokens computed, its blocks."""

    req_id: str
    block_ids: list[int]
    load: tuple[int, int]          # [start, stop) of hit tokens to load now
    computed: tuple[int, int]      # [start, stop) of tokens computed this step
    prompt_tokens: int
    open: OpenRequest | None = None


@dataclass
class DualPathMetadata(KVConnectorMetadata):
    steps: list[ReqStep] = field(default_factory=list)
    finishes: dict[str, list[int] | None] = field(default_factory=dict)  # req -> output ids


@dataclass
class _SchedReq:
    params: dict[str, Any]
    token_ids: list[int]
    planned_hit: int
    opened: bool = False
    blocks: list[int] = field(default_factory=list)
    pending_load: int = 0


def _make_source(extra: dict[str, Any], vllm_config: VllmConfig) -> KVSource:
    """The KV source ``kv_connector_extra_config`` names, after the KV-spec check."""
    model_spec = spec_from_vllm(vllm_config)
    preset = extra.get("kv_preset")
    if preset is not None:
        check_same_layout(model_spec, PRESETS[preset], f"the cluster's preset {preset!r}")
    kind = extra.get("source", "local")
    if kind == "local":
        return LocalKVStore(extra["store_dir"], model_spec)
    if kind == "engine":
        from integrations.vllm.engine_source import EngineSource

        role = "decode" if vllm_config.kv_transfer_config.kv_role == "kv_consumer" else "prefill"
        spec = PRESETS[preset] if preset is not None else model_spec
        return EngineSource(extra["engine_socket"], extra["engine_id"], role, spec,
                            float(extra.get("connect_timeout_s", 10.0)))
    raise ValueError(f"DualPathConnector: unknown source {kind!r} (known: local, engine)")


class DualPathConnector(KVConnectorBase_V1):
    """vLLM KV connector whose hits and new KV go through dualpath (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        if ktc.kv_load_failure_policy != "recompute":
            raise ValueError("DualPathConnector needs kv_load_failure_policy='recompute' in "
                             "--kv-transfer-config: a failed load must be recomputed")
        check_supported(vllm_config)
        extra = dict(ktc.kv_connector_extra_config)
        self._source = _make_source(extra, vllm_config)
        self._timeout_s = float(extra.get("layer_timeout_s", 10.0))
        # a claim waits for the node to have the request: on the decode side that is the whole
        # prefill (the prompt KV assembled), so it gets its own, longer deadline
        self._claim_timeout_s = float(extra.get("claim_timeout_s", 300.0))
        self._block_size = vllm_config.cache_config.block_size
        self._decode = ktc.kv_role == "kv_consumer"
        if self._decode and extra.get("source") != "engine":
            raise ValueError("DualPathConnector: kv_consumer (decode) needs source='engine'")
        # scheduler side
        self._reqs: dict[str, _SchedReq] = {}
        self._finishes: dict[str, list[int] | None] = {}
        # worker side
        self._caches: dict[int, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self._name_of: dict[int, str] = {}
        self._geom: CacheGeometry | None = None
        self._prepared: DualPathMetadata | None = None
        self._sessions: dict[str, Any] = {}      # SyncPrefillHandle, or a DecodeSession
        self._load_errors: set[int] = set()
        self._block_tables: dict[str, list[int]] = {}
        self._finishing: dict[str, Future[None]] = {}
        self._done_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if params is None:
            return 0, False
        rid = request.request_id
        if rid not in self._reqs:
            ids = list(request.prompt_token_ids or [])
            self._reqs[rid] = _SchedReq(dict(params), ids, self._source.planned_hit(params, ids))
        return max(0, self._reqs[rid].planned_hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        req = self._reqs.get(request.request_id)
        if req is not None and num_external_tokens > 0:
            req.pending_load = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = DualPathMetadata(finishes=self._finishes)
        self._finishes = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if (req := self._reqs.get(new.req_id)) is not None:
                req.blocks = list(new.block_ids[0])
                meta.steps.append(self._step(new.req_id, req, new.num_computed_tokens,
                                             scheduled[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if (req := self._reqs.get(rid)) is not None and req.opened:
                new_ids = cached.new_block_ids[i]
                if rid in cached.resumed_req_ids:           # preempted: a new block table
                    req.blocks = list(new_ids[0]) if new_ids is not None else []
                elif new_ids is not None:
                    req.blocks.extend(new_ids[0])
                meta.steps.append(self._step(rid, req, cached.num_computed_tokens[i],
                                             scheduled[rid]))
        return meta

    def _step(self, rid: str, req: _SchedReq, computed: int, scheduled: int) -> ReqStep:
        loaded, req.pending_load = req.pending_load, 0
        opening = None if req.opened else OpenRequest(
            str(req.params.get("request_id", rid)), req.token_ids, req.planned_hit)
        req.opened = True
        return ReqStep(rid, list(req.blocks), (computed - loaded, computed),
                       (computed, computed + scheduled), len(req.token_ids), opening)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req = self._reqs.pop(request.request_id, None)
        if req is None:
            return False, None
        out = [int(t) for t in request.output_token_ids]
        # the worker finishes the session in a later step and reports it in get_finished
        self._finishes[request.request_id] = out if (req.opened and out) else None
        return True, {PARAMS_KEY: {"planned_hit_tokens": req.planned_hit,
                                   "first_token_id": out[0] if out else None}}

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
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
        connect = getattr(self._source, "client", None)
        if connect is not None:
            connect()        # attach to the node now: it places requests on attached engines
        live = self._live_cache(0) if 0 in self._caches else first
        log.info("dualpath_kv_caches_registered", layers=len(self._caches),
                 geometry=str(self._geom), shape=tuple(first.shape),
                 same_as_forward=live.data_ptr() == self._caches[0].data_ptr())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._prepare()

    def _prepare(self) -> list[ReqStep]:
        """This step's work, set up once: sessions opened, finishes started. vLLM calls
        ``start_load_kv`` before the forward only when the step has sync loads, after it
        otherwise, so the layer hooks prepare too, whichever comes first."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualPathMetadata)
        if self._prepared is not meta:
            self._prepared = meta
            for rid, output_ids in meta.finishes.items():
                self._start_finish(rid, output_ids)
            for step in meta.steps:
                self._block_tables[step.req_id] = step.block_ids
                if step.open is not None:
                    self._open(step)
        return meta.steps

    def _check_layout(self) -> None:
        """Refuse (every request recomputes) on a CPU attention ISA whose in-block KV layout
        was not measured: wrong KV must never reach the cache (geometry.VERIFIED_ISAS)."""
        ctx = self._vllm_config.compilation_config.static_forward_context.get(self._name_of[0])
        isa = getattr(ctx, "isa", None)
        if isa not in VERIFIED_ISAS:
            raise RuntimeError(f"vLLM CPU attention ISA {isa!r}: its KV cache layout is not "
                               f"verified for dualpath (verified: {VERIFIED_ISAS})")

    def _open(self, step: ReqStep) -> None:
        assert step.open is not None
        op = step.open
        try:
            self._check_layout()
            session: Any
            if self._decode:
                from integrations.vllm.decode_session import DecodeSession

                session = DecodeSession(self._source.open_decode(  # type: ignore[attr-defined]
                    op.dualpath_id, op.token_ids, self._claim_timeout_s), op.token_ids)
            else:
                session = self._source.open_prefill(op.dualpath_id, op.token_ids,
                                                    op.planned_hit, self._claim_timeout_s)
        except Exception as e:  # noqa: BLE001 -- an unusable hit is recomputed, never fatal
            self._fail_load(step, None, e)
            return
        self._sessions[step.req_id] = session
        if session.hit_tokens < step.open.planned_hit:
            self._fail_load(step, None, RuntimeError(
                f"usable hit {session.hit_tokens} < planned {step.open.planned_hit} tokens"))

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None or self._geom is None:
            return
        for step in self._prepare():
            start, stop = step.load
            session = self._sessions.get(step.req_id)
            if stop <= start or session is None:
                continue
            try:
                src = session.layer(layer, self._timeout_s)[start:stop]
                scatter_range(self._geom, self._live_cache(layer), step.block_ids, start, stop,
                              torch.from_numpy(src))
            except Exception as e:  # noqa: BLE001 -- any load failure means: recompute
                self._fail_load(step, layer, e)

    def _fail_load(self, step: ReqStep, layer: int | None, err: Exception) -> None:
        log.warning("dualpath_load_failed", request_id=step.req_id, layer=layer, error=str(err))
        start, stop = step.load
        if stop > start:
            first, last = start // self._block_size, (stop - 1) // self._block_size
            self._load_errors.update(step.block_ids[first:last + 1])
        session = self._sessions.pop(step.req_id, None)
        if session is not None:
            session.fail(f"load failed at layer {layer}: {err}")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None or self._geom is None or self._decode:
            return
        for step in self._prepare():
            session = self._sessions.get(step.req_id)
            if session is None:
                continue
            hit = session.hit_tokens
            start, stop = max(step.computed[0], hit), min(step.computed[1], step.prompt_tokens)
            if stop <= start:
                continue
            try:
                self._save(session, step, layer, kv_layer, start, stop)
            except Exception as e:  # noqa: BLE001 -- the dualpath attempt fails, vLLM goes on
                log.warning("dualpath_save_failed", request_id=step.req_id, layer=layer,
                            error=str(e))
                self._sessions.pop(step.req_id, None)
                session.fail(f"save of layer {layer} failed: {e}")

    def _save(self, session: SyncPrefillHandle, step: ReqStep, layer: int, kv_layer: torch.Tensor,
              start: int, stop: int) -> None:
        """Gather tokens ``[start, stop)`` of one layer into the session's output slots; put the
        layer once the prompt is complete. The engine API hands out a layer's output only after
        its hit was asked for (``layer(l)``), which a request without a hit also does here."""
        assert self._geom is not None
        if step.load[1] <= step.load[0] and step.computed[0] <= session.hit_tokens:
            session.layer(layer, self._timeout_s)
        hit = session.hit_tokens
        dst = torch.from_numpy(session.output(layer)[start - hit:stop - hit])
        slots = token_slots(step.block_ids, self._block_size, start, stop)
        gather_layer_into(self._geom, kv_layer, slots, dst)
        if stop == step.prompt_tokens:
            session.put_layer(layer)

    def wait_for_save(self) -> None:
        if self._decode and self._prepared is not None:
            for step in self._prepared.steps:
                if (session := self._sessions.get(step.req_id)) is not None:
                    try:
                        session.after_step()
                    except Exception as e:  # noqa: BLE001 -- the KV is in vLLM already
                        log.warning("dualpath_decode_report_failed", request_id=step.req_id,
                                    error=str(e))
        self._prepared = None

    def _start_finish(self, rid: str, output_ids: list[int] | None) -> None:
        session = self._sessions.pop(rid, None)
        blocks = self._block_tables.pop(rid, [])
        done: Future[None] = Future()
        if session is None:
            done.set_result(None)
        else:
            assert self._pool is not None
            done = self._pool.submit(self._finish, rid, session, output_ids, blocks)
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

    def _live_cache(self, layer: int) -> torch.Tensor:
        """The cache tensor the attention layer reads (vLLM's static forward context, which its
        own block zeroing also reads; on the CPU backend it is the registered tensor)."""
        name = self._name_of[layer]
        ctx = self._vllm_config.compilation_config.static_forward_context.get(name)
        cache = getattr(ctx, "kv_cache", None)
        return cache if isinstance(cache, torch.Tensor) else self._caches[layer]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._done_lock:
            done = {rid for rid, fut in self._finishing.items() if fut.done()}
            for rid in done:
                del self._finishing[rid]
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
