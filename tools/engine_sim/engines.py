"""Emulated prefill and decode engines: real KV bytes through the engine API, cost-model time.

* :class:`PrefillEngineSim` — FIFO forward batches under the compute quota
  (``services.compute_model.batching.PrefillBatcher``); per layer it awaits the hit KV (layer-wise
  mode: layer ``l+1`` loads while ``l`` computes; whole mode: every layer first), checks it
  against the stored pattern, spends ``prefill_s / L`` of the cost model (× ``time_scale``),
  writes the new tokens' KV (``kv_pattern``) and puts the layer.
* :class:`DecodeEngineSim` — checks the full prompt KV (oracle: the new tokens' part; the hit
  is resident by assumption), copies it ("H2D"), then decodes all
  its requests together, one step per ``decode_step_s``; token ids are deterministic
  (``kv_pattern.token_id``); every block of prompt tail + generated tokens that has KV goes
  back through ``new_block``/``put_block``.
* :class:`EngineHost` — runs one emulated engine per port of a PE receiver or DE loader.

With ``collective_fraction`` > 0 both spend that share of every layer (prefill) / step
(decode) inside a modelled TP/EP collective announced to the node (``collective_begin`` /
``collective_end``), so the node's arbiter caps KV egress then (docs/qos.md).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from common.errors import ChecksumMismatch, DualpathError, InvalidArgument
from common.kv import KVSpec
from services.engine_api.decode import DecodePort
from services.engine_api.handles import (CollectiveSignals, DecodeHandle, DecodeQueue,
                                         PrefillHandle, PrefillQueue)
from services.engine_api.prefill import PrefillPort
from services.compute_model.batching import PrefillBatcher
from services.compute_model.cost_model import ModelCost, cost_model

from tools.config import EngineSimConfig
from .kv_pattern import check_tokens, fill_tokens, layer_pattern, token_id

log = structlog.get_logger(__name__)
_KEEP = 4096


def _cost(spec: KVSpec, cfg: EngineSimConfig) -> ModelCost:
    return cost_model(cfg.model or spec.name)


async def spend(port: CollectiveSignals, seconds: float, fraction: float) -> None:
    """Spend ``seconds`` of modelled compute, the last ``fraction`` of it in a collective the
    node is told about (begin/end), so its arbiter caps KV meanwhile (docs/qos.md)."""
    compute = seconds * (1 - fraction)
    if compute > 0:
        await asyncio.sleep(compute)
    if fraction <= 0:
        return
    await port.collective_begin()
    try:
        if seconds > 0:
            await asyncio.sleep(seconds * fraction)
    finally:
        try:
            await port.collective_end()
        except DualpathError as e:     # the node is gone; its detach ended the collective
            log.info("collective_end_unacknowledged", engine=getattr(port, "engine_id", "?"),
                     error=repr(e))


@dataclass
class PrefillTiming:
    """Where one request's prefill time went (the overlap benchmark reads these)."""

    request_id: str
    hit_tokens: int
    new_tokens: int
    start: float = 0.0
    end: float = 0.0
    wait_s: float = 0.0          # waiting for hit KV (load not hidden behind compute)
    compute_s: float = 0.0


class PrefillEngineSim:
    """One emulated prefill engine on a :class:`PrefillQueue` (in-process or remote)."""

    def __init__(self, port: PrefillQueue, spec: KVSpec, cfg: EngineSimConfig,
                 cost: ModelCost | None = None) -> None:
        self.port, self.spec, self.cfg = port, spec, cfg
        self.cost = cost or _cost(spec, cfg)
        self.batcher = PrefillBatcher(self.cost.attention_s, cfg.quota_s, cfg.max_batch_tokens)
        self.handles: dict[str, PrefillHandle] = {}
        self.timings: collections.deque[PrefillTiming] = collections.deque(maxlen=_KEEP)
        self._timing: dict[str, PrefillTiming] = {}
        self._verified: set[str] = set()
        self._finishing: set[asyncio.Task] = set()
        self.counters = collections.Counter()

    async def run(self) -> None:
        try:
            while True:
                self._admit(await self.port.next_request())
                while self.batcher.pending_tokens or len(self.batcher):
                    while (h := self.port.try_next()) is not None:
                        self._admit(h)
                    batch = self.batcher.next_batch()
                    if batch is None:
                        break
                    await self._forward(batch)
        finally:
            for h in list(self.handles.values()):
                await h.fail(None)
            for t in list(self._finishing):
                t.cancel()

    def _admit(self, h: PrefillHandle) -> None:
        self.handles[h.request_id] = h
        self._timing[h.request_id] = PrefillTiming(h.request_id, h.hit_tokens, h.new_tokens,
                                                   time.monotonic())
        self.batcher.add(h.request_id, h.hit_tokens, h.new_tokens)

    async def _forward(self, batch) -> None:
        items = [(self.handles[it.request_id], it) for it in batch.items
                 if it.request_id in self.handles]
        scale = self.cfg.time_scale / self.spec.num_layers
        per_layer = sum(self.cost.prefill_s(it.cached, it.new) for _, it in items) * scale
        if self.cfg.mode == "whole":
            for layer in range(self.spec.num_layers):
                items = [x for x in items if await self._load(x[0], layer)]
        for layer in range(self.spec.num_layers):
            if self.cfg.mode == "layerwise":
                items = [x for x in items if await self._load(x[0], layer)]
            t0 = time.monotonic()
            await spend(self.port, per_layer, self.cfg.collective_fraction)
            for h, _ in items:
                self._timing[h.request_id].compute_s += time.monotonic() - t0
            items = [x for x in items if not x[1].last or await self._produce(x[0], layer)]
        for h, it in items:
            if it.last:
                self._done(h)

    async def _load(self, h: PrefillHandle, layer: int) -> bool:
        """Await layer ``layer``'s hit KV (and check it once); False: the request is gone."""
        t0 = time.monotonic()
        try:
            hit_kv = await h.layer(layer)
            self._timing[h.request_id].wait_s += time.monotonic() - t0
            key = (h.request_id, layer)
            # oracle ("none" with a hit): the hit is resident by assumption, nothing was
            # loaded into these rows, so there is nothing to check
            if self.cfg.verify and h.hit_tokens and h.info.read_side != "none" \
                    and key not in self._verified:
                self._verify(h, hit_kv, layer)
                self._verified.add(key)
            return True
        except DualpathError as e:
            await self._drop(h, e)
            return False

    def _verify(self, h: PrefillHandle, hit_kv: np.ndarray, layer: int) -> None:
        info = h.info
        bad = check_tokens(hit_kv, self.spec, info.block_keys, info.tail_key, layer, 0,
                           h.hit_tokens)
        if bad is not None:
            self.counters["hit_mismatches"] += 1
            raise ChecksumMismatch(f"prefill engine {self.port.engine_id}: hit KV of "
                                   f"{h.request_id} layer {layer} differs from storage at "
                                   f"token {bad}")
        self.counters["verified_layers"] += 1
        self.counters["verified_bytes"] += hit_kv.nbytes

    async def _produce(self, h: PrefillHandle, layer: int) -> bool:
        info = h.info
        try:
            fill_tokens(h.output(layer), self.spec, info.block_keys, info.tail_key, layer,
                        h.hit_tokens, info.prompt_tokens)
            await h.put_layer(layer)
            return True
        except DualpathError as e:
            await self._drop(h, e)
            return False

    def _done(self, h: PrefillHandle) -> None:
        rid = h.request_id
        self.handles.pop(rid, None)
        timing = self._timing.pop(rid)
        timing.end = time.monotonic()
        self.timings.append(timing)
        for layer in range(self.spec.num_layers):
            self._verified.discard((rid, layer))
        first = token_id(h.info.session_id, h.info.prompt_tokens, self.cfg.vocab)
        task = asyncio.get_running_loop().create_task(self._finish(h, first))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, h: PrefillHandle, first: int) -> None:
        try:
            await h.finish(first)
            self.counters["prefilled"] += 1
        except DualpathError as e:
            self.counters["finish_failed"] += 1
            log.info("prefill_finish_failed", request_id=h.request_id, error=repr(e))

    async def _drop(self, h: PrefillHandle, e: DualpathError) -> None:
        rid = h.request_id
        self.counters["dropped"] += 1
        self.handles.pop(rid, None)
        self._timing.pop(rid, None)
        self.batcher.cancel(rid)
        for layer in range(self.spec.num_layers):
            self._verified.discard((rid, layer))
        await h.fail(e)


@dataclass
class _Seq:
    req: DecodeHandle
    out: list[int]
    hbm: list[np.ndarray] = field(default_factory=list)
    blocks_done: int = 0

    @property
    def info(self):
        return self.req.info


class DecodeEngineSim:
    """One emulated decode engine on a :class:`DecodeQueue` (in-process or remote)."""

    def __init__(self, port: DecodeQueue, spec: KVSpec, cfg: EngineSimConfig,
                 cost: ModelCost | None = None) -> None:
        self.port, self.spec, self.cfg = port, spec, cfg
        self.cost = cost or _cost(spec, cfg)
        self.active: dict[str, _Seq] = {}
        self.counters = collections.Counter()

    async def run(self) -> None:
        try:
            while True:
                if not self.active:
                    await self._admit(await self.port.next_ready())
                while len(self.active) < self.cfg.decode_max_batch and \
                        (req := self.port.try_next()) is not None:
                    await self._admit(req)
                if self.active:
                    await self._step()
        finally:
            for s in list(self.active.values()):
                await s.req.fail(None)

    async def _admit(self, req: DecodeHandle) -> None:
        info = req.info
        try:
            if self.cfg.verify:
                self._verify(req)
            hbm = [req.layer(layer).copy() for layer in range(self.spec.num_layers)] \
                if self.cfg.hbm_copy else []
            await req.took_kv()
        except DualpathError as e:
            await self._drop(req, e)
            return
        first = req.first_token_id if req.first_token_id is not None else \
            token_id(info.session_id, info.prompt_tokens, self.cfg.vocab)
        seq = _Seq(req, [first], hbm)
        self.active[req.request_id] = seq
        if info.gen_tokens == 1:
            # a one-token request ends here, not in _step: its attempt may have been dropped
            # while took_kv() waited (the node's scheduler lease lost in a failover), and that
            # finish fails typed — the request fails, the engine keeps serving (before, the
            # error ended this engine's task silently and every later request on it hung)
            try:
                await self._end(seq)
            except DualpathError as e:
                await self._drop(req, e)

    def _verify(self, req: DecodeHandle) -> None:
        info = req.info
        # oracle: the hit's rows were never sent (resident in this engine's HBM by
        # assumption); the new tokens' KV, the part that crossed PE -> DE, is checked
        first = req.hit_tokens if info.read_side == "none" else 0
        for layer in range(self.spec.num_layers):
            bad = check_tokens(req.layer(layer)[first:], self.spec, info.block_keys,
                               info.tail_key, layer, first, info.prompt_tokens)
            if bad is not None:
                self.counters["prompt_mismatches"] += 1
                raise ChecksumMismatch(f"decode engine {self.port.engine_id}: prompt KV of "
                                       f"{req.request_id} layer {layer} is wrong at token {bad} "
                                       f"(hit {req.hit_tokens})")
        self.counters["verified_requests"] += 1

    async def _step(self) -> None:
        seqs = list(self.active.values())
        ctx = sum(s.info.prompt_tokens + len(s.out) for s in seqs)
        delay = self.cost.decode_step_s(len(seqs), ctx) * self.cfg.time_scale
        await spend(self.port, delay, self.cfg.collective_fraction)
        if delay <= 0:
            await asyncio.sleep(0)
        for s in seqs:
            if s.req.request_id not in self.active:
                continue
            info = s.info
            s.out.append(token_id(info.session_id, info.prompt_tokens + len(s.out), self.cfg.vocab))
            try:
                if len(s.out) == 2:
                    await s.req.second_token()
                await self._blocks(s)
                if len(s.out) >= info.gen_tokens:
                    await self._end(s)
            except DualpathError as e:
                await self._drop(s.req, e)

    async def _blocks(self, s: _Seq) -> None:
        """Persist each block of prompt tail + generated tokens whose KV now exists."""
        info, bt = s.info, self.spec.block_tokens
        if info.tail_tokens and info.tail_token_ids is None:
            return                           # the tail's ids are unknown: cannot key blocks
        known = list(info.tail_token_ids or ()) + s.out[:-1]   # the last token has no KV yet
        while len(known) >= (s.blocks_done + 1) * bt:
            ids = known[s.blocks_done * bt:(s.blocks_done + 1) * bt]
            blk = await s.req.new_block(ids)
            for layer in range(self.spec.num_layers):
                layer_pattern(blk.key, layer, self.spec.layer_block_bytes, blk.view[layer])
            await s.req.put_block(blk)
            s.blocks_done += 1
            self.counters["blocks_generated"] += 1

    async def _end(self, s: _Seq) -> None:
        self.active.pop(s.req.request_id, None)
        await s.req.finish(s.out)
        self.counters["finished"] += 1

    async def _drop(self, req: DecodeHandle, e: DualpathError) -> None:
        """``req`` failed typed: out of the batch, counted, failed to its node."""
        self.active.pop(req.request_id, None)
        self.counters["dropped"] += 1
        await req.fail(e)


def _report_death(task: asyncio.Task) -> None:
    """An engine's task ended while its host runs: log it at once (an engine that stopped
    serving leaves every request placed on it waiting; found at stop, it was found too late)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("engine_failed", task=task.get_name(), exc_info=task.exception())


class EngineHost:
    """Runs one emulated engine per port of a node service (``service.ports``)."""

    def __init__(self, service: Any, cfg: EngineSimConfig, spec: KVSpec | None = None) -> None:
        self.service, self.cfg = service, cfg
        self.spec = spec or service.spec
        self.engines: list[Any] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for port in self.service.ports.values():
            if isinstance(port, PrefillPort):
                eng: Any = PrefillEngineSim(port, self.spec, self.cfg)
            elif isinstance(port, DecodePort):
                eng = DecodeEngineSim(port, self.spec, self.cfg)
            else:
                raise InvalidArgument(f"unknown port type {type(port).__name__}")
            self.engines.append(eng)
            task = asyncio.get_running_loop().create_task(eng.run(),
                                                          name=f"engine-{port.engine_id}")
            task.add_done_callback(_report_death)
            self._tasks.append(task)

    async def stop(self) -> None:
        running = [t for t in self._tasks if not t.done()]    # the others were reported
        for t in running:
            t.remove_done_callback(_report_death)
            t.cancel()
        if running:
            await asyncio.wait(running)
        for t in running:
            if not t.cancelled() and t.exception() is not None:
                log.error("engine_failed", task=t.get_name(), exc_info=t.exception())
        self._tasks.clear()

    def counters(self) -> dict[str, float]:
        total: collections.Counter = collections.Counter()
        for e in self.engines:
            total.update(e.counters)
        return {k: float(v) for k, v in total.items()}

    async def __aenter__(self) -> EngineHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
