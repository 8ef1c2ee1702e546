"""The connector's scheduler half (vLLM's engine-core process): when a request may run.

A request that takes part is held back until its claim is known, so waiting for dualpath
never stalls the running batch (docs/vllm.md "Asynchronous loads"):

1. first ask (``matched``): the request's claim is sent to the worker (``OpenRequest``) and
   vLLM hears ``None`` — "ask again next step" — while it keeps stepping every other request;
2. the worker claims off the step and reports the usable hit (``DualPathWorkerMeta``);
   a request it could not open is computed without dualpath (hit 0);
3. prefill: the hit loads layer by layer inside the request's first forward (paper §4.2),
   so vLLM hears ``(hit - local, False)``; decode: the prompt KV is already assembled, so
   vLLM hears ``(hit - local, True)`` — an asynchronous load: the worker copies it into the
   blocks vLLM allocated, off the step, and reports the request received; only then is it
   scheduled. ``local`` is vLLM's own prefix-cache hit: rows it holds are never loaded over
   (at or above the hit, nothing loads), and the prefill gathers every row it forwards from
   the paged cache, held or computed (:mod:`integrations.vllm.rows`).

A request loaded once and preempted later recomputes: its hit pages went back to the node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from integrations.vllm.metadata import (
    AsyncLoad,
    DualPathMetadata,
    DualPathWorkerMeta,
    Finish,
    OpenRequest,
    ReqStep,
)
from integrations.vllm.rows import step_rows
from integrations.vllm.sessions import KVSource

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

PARAMS_KEY = "dualpath"


@dataclass
class _SchedReq:
    params: dict[str, Any]
    token_ids: list[int]
    planned_hit: int
    hit: int | None = None          # the claimed, usable hit; None while the claim is pending
    refused: bool = False           # not opened (or its load failed): plain vLLM
    loading: bool = False           # decode: its asynchronous load is in flight
    loaded: bool = False            # decode: its hit reached the paged cache once
    opened: bool = False            # scheduled once: the worker has its block table
    blocks: list[int] = field(default_factory=list)
    pending_load: int = 0
    saved: int = 0                  # prefill: prompt rows gathered for the PE so far


class SchedulerHalf:
    """Per-request state of the engine-core process (module docstring)."""

    def __init__(self, source: KVSource, decode: bool) -> None:
        self._source = source
        self._decode = decode
        self._reqs: dict[str, _SchedReq] = {}
        self._opens: list[OpenRequest] = []
        self._loads: list[AsyncLoad] = []
        self._finishes: dict[str, Finish] = {}

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: None until the claim is known."""
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if params is None:
            return 0, False
        rid = request.request_id
        req = self._reqs.get(rid)
        if req is None:
            ids = list(request.prompt_token_ids or [])
            req = self._reqs[rid] = _SchedReq(dict(params), ids,
                                              self._source.planned_hit(params, ids))
            attempt = params.get("attempt")
            self._opens.append(OpenRequest(rid, str(params.get("request_id", rid)), ids,
                                           req.planned_hit,
                                           attempt if isinstance(attempt, int) else None))
            return None, False
        if req.refused or req.loaded:
            return 0, False
        if req.hit is None:
            return None, False
        n = max(0, req.hit - num_computed_tokens)
        return n, self._decode and n > 0

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        """vLLM's ``update_state_after_alloc``: decode's load goes off the step, prefill's
        into the next forward."""
        req = self._reqs.get(request.request_id)
        if req is None or num_external <= 0 or req.hit is None:
            return
        if self._decode:
            req.loading = True
            self._loads.append(AsyncLoad(request.request_id, list(blocks.get_block_ids()[0]),
                                         req.hit - num_external, req.hit))
        else:
            req.pending_load = num_external

    def worker_output(self, output: KVConnectorOutput) -> None:
        """vLLM's ``update_connector_output``: claims answered, asynchronous loads done."""
        meta = output.kv_connector_worker_meta
        if isinstance(meta, DualPathWorkerMeta):
            for rid, hit in meta.opened.items():
                if (req := self._reqs.get(rid)) is not None:
                    req.hit = hit
                    req.refused = hit is None
        failed = output.failed_recving or set()
        for rid in output.finished_recving or ():
            if (req := self._reqs.get(rid)) is not None and req.loading:
                req.loading = False
                req.loaded = rid not in failed
                req.refused = rid in failed

    def build_meta(self, scheduler_output: SchedulerOutput) -> DualPathMetadata:
        meta = DualPathMetadata(self._opens, self._loads, [], self._finishes)
        self._opens, self._loads, self._finishes = [], [], {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if (req := self._reqs.get(new.req_id)) is not None and not req.refused:
                req.blocks = list(new.block_ids[0])
                meta.steps.append(self._step(new.req_id, req, new.num_computed_tokens,
                                             scheduled[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if (req := self._reqs.get(rid)) is not None and req.opened and not req.refused:
                new_ids = cached.new_block_ids[i]
                if rid in cached.resumed_req_ids:           # preempted: a new block table
                    req.blocks = list(new_ids[0]) if new_ids is not None else []
                elif new_ids is not None:
                    req.blocks.extend(new_ids[0])
                meta.steps.append(self._step(rid, req, cached.num_computed_tokens[i],
                                             scheduled[rid]))
        return meta

    def _step(self, rid: str, req: _SchedReq, computed: int, scheduled: int) -> ReqStep:
        """One request's rows this step (:func:`~integrations.vllm.rows.step_rows`): ``computed``
        includes vLLM's own local hit (prefix caching), which may be below, at or above the
        dualpath hit."""
        external, req.pending_load = req.pending_load, 0
        first, req.opened = not req.opened, True
        load, save = step_rows(hit=req.hit or 0, saved=req.saved, computed=computed,
                               scheduled=scheduled, external=external,
                               prompt=len(req.token_ids))
        req.saved = max(req.saved, save[1])
        return ReqStep(rid, list(req.blocks), load, save, first and load[1] <= load[0],
                       len(req.token_ids))

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: a request that ran keeps its blocks until the worker
        finished its session (write-back); one that never ran is only told to the worker."""
        req = self._reqs.pop(request.request_id, None)
        if req is None:
            return False, None
        out = [int(t) for t in request.output_token_ids]
        self._finishes[request.request_id] = Finish(out if (req.opened and out) else None,
                                                    report=req.opened)
        return req.opened, {PARAMS_KEY: {"planned_hit_tokens": req.planned_hit,
                                         "hit_tokens": req.hit or 0,
                                         "first_token_id": out[0] if out else None}}
