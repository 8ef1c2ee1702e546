"""The DE loader: one per decode node, group leader of its decode engines, owner of the DE
buffer; serves the data-path channel the PE receivers call (paper §2.4–2.7; docs/datapath.md).

Bindings (``DecodeBinding`` from ``FetchWork``) reserve an engine for an attempt; the PE
receiver of the plan then drives the attempt with ``PrepareDecode`` / ``PullLayers`` /
``PrefillDone`` (a PE's contact may also come before its binding: it is accepted). Each
attempt is a :class:`~services.de_loader.attempt.DecodeAttempt`; assembled requests go to
the engines through :class:`~services.engine_api.decode.DecodePort` s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncio

from common.errors import DualpathError, InvalidArgument, NotFound
from common.kv import KVSpec
from common.protocol import (AbortDecode, AbortDecodeReply, DataPathRequest, DecodeBinding,
                             EngineLoad, FetchWorkReply, PrefillDone, PrefillDoneReply,
                             PrepareDecode, PrepareDecodeReply, PullLayers, PullLayersReply,
                             Revocation)
from common.rpc import CallContext
from services.engine_api.decode import DecodePort
from services.engine_api.prompt import make_prompt
from services.node.base import NodeBase

from .attempt import DecodeAttempt, HitSource

if TYPE_CHECKING:
    from services.config import ServicesConfig

SERVICE_NAME = "de_loader"


class DELoaderService(NodeBase):
    """``async with DELoaderService(cfg, "d0") as de:`` — engines attach to ``de.ports``."""

    name = SERVICE_NAME
    role = "decode"
    request_union = DataPathRequest

    def __init__(self, cfg: ServicesConfig, node_id: str, *, spec: KVSpec | None = None,
                 engines: int | None = None, hit_source: HitSource | None = None) -> None:
        super().__init__(cfg, node_id, cfg.de_loader, spec=spec, engines=engines,
                         pool_name="de_buffer")
        self.ports = {e: DecodePort(e, self.collectives) for e in self.engine_ids}
        self.attempts: dict[tuple[str, int], DecodeAttempt] = {}
        # Benchmarks/tests: where DE-path hit KV comes from instead of the gateway.
        self.hit_source = hit_source

    def handlers(self):
        return {**super().handlers(), PrepareDecode: self._prepare, PullLayers: self._pull,
                PrefillDone: self._prefill_done, AbortDecode: self._abort}

    def engine_hbm(self) -> int:
        """What one engine here can be given: its KV HBM, but no more than the node's DE
        buffer, where every attempt stages its prompt's KV from its binding until its
        write-back (:meth:`engine_loads`). A request needing more is refused typed at the
        scheduler's submit instead of failing at this node's pool."""
        return min(self.settings.hbm_capacity_bytes, self.pool.num_pages * self.pool.page_bytes)

    async def on_stop(self) -> None:
        for port in self.ports.values():
            port.close()
        await super().on_stop()

    # ------------------------------------------------------------------ bindings
    async def apply(self, reply: FetchWorkReply) -> None:
        for b in reply.bindings:
            try:
                self.bind(b)
            except DualpathError as e:
                await self.report(b.request_id, b.attempt, "failed", code=e.code.value,
                                  message=e.message[:500], retryable=False, hop=SERVICE_NAME)

    def bind(self, b: DecodeBinding) -> DecodeAttempt:
        """Reserve ``b.de_engine`` for the attempt (its PE will contact us)."""
        if b.de_engine not in self.ports:
            raise InvalidArgument(f"binding of {b.request_id!r} names engine {b.de_engine!r}, "
                                  f"not one of {self.node_id}'s {sorted(self.ports)}")
        att = self._attempt(b.request_id, b.attempt, b.de_engine, b.deadline_s)
        att.bind(b)
        self.counters["bindings"] += 1
        return att

    def _attempt(self, rid: str, attempt: int, engine: str,
                 deadline_s: float | None) -> DecodeAttempt:
        key = (rid, attempt)
        att = self.attempts.get(key)
        if att is None:
            budget = deadline_s if deadline_s is not None else self.settings.default_deadline_s
            deadline_at = asyncio.get_running_loop().time() + max(budget, 0.0)
            att = DecodeAttempt(self.io, self.ports[engine], rid, attempt, engine, deadline_at,
                                hit_source=self.hit_source)
            self.attempts[key] = att
        elif att.engine_id != engine:
            raise InvalidArgument(f"{rid!r} attempt {attempt} is bound to {att.engine_id}, "
                                  f"not {engine}")
        return att

    def revoke(self, r: Revocation) -> None:
        att = self.attempts.get((r.request_id, r.attempt))
        if att is not None:
            self.counters["revocations"] += 1
            att.drop(r.reason)

    async def drop_all(self, reason: str) -> None:
        atts = list(self.attempts.values())
        for att in atts:
            att.drop(reason)
        tasks = [a.release_task for a in atts if a.release_task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.engine_release_timeout_s)

    def _live(self, rid: str, attempt: int) -> DecodeAttempt:
        att = self.attempts.get((rid, attempt))
        if att is None or att.done:
            raise NotFound(f"{self.node_id} has no live attempt {attempt} of {rid!r} (never "
                           f"prepared, or it ended: revoked, failed, expired)")
        return att

    # ------------------------------------------------------------------ data-path channel
    async def _prepare(self, msg: PrepareDecode, ctx: CallContext) -> PrepareDecodeReply:
        if self._closing:
            raise InvalidArgument(f"{self.node_id} is stopping")
        if msg.de_engine not in self.ports:
            raise InvalidArgument(f"PrepareDecode for {msg.request_id!r} names engine "
                                  f"{msg.de_engine!r}, not one of {sorted(self.ports)}")
        info = make_prompt(self.spec, request_id=msg.request_id, attempt=msg.attempt,
                           session_id=msg.session_id, prompt_tokens=msg.prompt_tokens,
                           hit_tokens=msg.hit_tokens, gen_tokens=msg.gen_tokens,
                           hit_keys=msg.hit_keys, new_keys=msg.new_keys,
                           tail_token_ids=msg.tail_token_ids, read_side=msg.read_side,
                           max_prompt_tokens=self.settings.max_prompt_tokens,
                           split_tokens=msg.split_tokens)
        if info.read_side != msg.read_side and msg.read_side != "none":
            raise InvalidArgument(f"PrepareDecode: read side {msg.read_side!r} with a usable "
                                  f"hit of {info.hit_tokens} tokens")
        att = self._attempt(msg.request_id, msg.attempt, msg.de_engine, msg.deadline_s)
        if att.done:
            raise NotFound(f"attempt {msg.attempt} of {msg.request_id!r} already ended here")
        self.counters["prepares"] += 1
        try:
            forward = await att.prepare(msg, info)
        except DualpathError as e:
            att.abort(e, report=False)
            raise
        return PrepareDecodeReply(msg.request_id, msg.attempt, forward)

    async def _pull(self, msg: PullLayers, ctx: CallContext) -> PullLayersReply:
        att = self._live(msg.request_id, msg.attempt)
        hit, returns = await att.pull(msg)
        return PullLayersReply(msg.request_id, msg.attempt, hit, returns)

    async def _prefill_done(self, msg: PrefillDone, ctx: CallContext) -> PrefillDoneReply:
        att = self._live(msg.request_id, msg.attempt)
        await att.prefill_done(msg)
        return PrefillDoneReply(msg.request_id, msg.attempt)

    async def _abort(self, msg: AbortDecode, ctx: CallContext) -> AbortDecodeReply:
        att = self.attempts.get((msg.request_id, msg.attempt))
        if att is None or att.done:
            return AbortDecodeReply(msg.request_id, False)
        att.drop(f"PE aborted: {msg.reason[:200]}")
        return AbortDecodeReply(msg.request_id, True)

    # ------------------------------------------------------------------ telemetry
    def free_buffer_bytes(self) -> int:
        """The DE buffer's free pages less those of attempts bound and not allocated yet."""
        return self.buffer_room(att.binding.prompt_tokens for att in self.attempts.values()
                                if att.region is None and att.binding is not None
                                and not att.done)

    def engine_loads(self) -> list[EngineLoad]:
        """seq/tok per decode engine (attempts bound here and not finished) and the room the
        scheduler may place into: the engine's free HBM (of :meth:`engine_hbm`) and, shared by
        all of them, the node's free buffer (:meth:`free_buffer_bytes`, protocol v7).

        Why the buffer: every attempt stages its whole prompt's KV in the node's DE buffer
        from its binding until its write-back, so a decode node bound more prompts than its
        buffer holds makes each wait at the pool (``alloc_timeout_s``) while its PE's
        ``PrepareDecode`` runs out of time and the engines fall back to computing without
        dualpath — seen in ``bench engine_agents`` once β admitted a wave (docs/datapath.md
        "Buffer admission in the scheduler"). The scheduler keeps such requests in the group's
        queue (``pick_de``), bounded by their deadlines, and takes every binding to any of the
        node's engines off the one buffer figure, so two engines are never each given the same
        free bytes; the pool's bounded wait stays the backstop."""
        seq = dict.fromkeys(self.ports, 0)
        tok = dict.fromkeys(self.ports, 0)
        hbm = dict.fromkeys(self.ports, 0)
        for att in self.attempts.values():
            if att.engine_id in seq and not att.done:
                seq[att.engine_id] += 1
                tok[att.engine_id] += att.tokens
                hbm[att.engine_id] += att.hbm_bytes
        cap = self.engine_hbm()
        buffer = self.free_buffer_bytes()
        return [EngineLoad(e, seq[e], tok[e], max(cap - hbm[e], 0), buffer_free_bytes=buffer)
                for e in self.ports]

    def node_counters(self) -> dict[str, float]:
        return {"attempts_live": float(len(self.attempts)),
                "engine_queue": float(sum(len(p) for p in self.ports.values()))}
