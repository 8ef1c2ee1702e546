"""The PE receiver: one per prefill node, group leader of its prefill engines, owner of the PE
buffer (paper §2.4–2.5; docs/datapath.md).

It pulls plans from the scheduler (or takes them from :meth:`PEReceiverService.submit_plan`
when standalone), runs one :class:`~services.pe_receiver.attempt.PrefillAttempt` per request
attempt, feeds the engines layer by layer through the engine API (one
:class:`~services.engine_api.prefill.PrefillPort` per engine) and reports each stage. Its RPC
port serves health and stats only; the data-path channel is the DE loaders'.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, TYPE_CHECKING

import msgspec

from common.errors import DualpathError, InvalidArgument
from common.kv import KVSpec
from common.protocol import (AdminRequest, DataPathReply, EngineLoad, Endpoint,
                             FetchWorkReply, RequestPlan, Revocation)
from common.rpc import RpcClient
from services.engine_api.prefill import PrefillPort
from services.engine_api.prompt import make_prompt

from services.node.base import NodeBase
from services.node.errors import with_hop
from services.node.reports import cancel_and_wait

from .attempt import PrefillAttempt

if TYPE_CHECKING:
    from services.config import ServicesConfig

SERVICE_NAME = "pe_receiver"


class PEReceiverService(NodeBase):
    """``async with PEReceiverService(cfg, "p0") as pe:`` — engines attach to ``pe.ports``."""

    name = SERVICE_NAME
    role = "prefill"
    request_union = AdminRequest

    def __init__(self, cfg: ServicesConfig, node_id: str, *, spec: KVSpec | None = None,
                 engines: int | None = None) -> None:
        super().__init__(cfg, node_id, cfg.pe_receiver, spec=spec, engines=engines,
                         pool_name="pe_buffer")
        self.ports = {e: PrefillPort(e, self.collectives) for e in self.engine_ids}
        self.attempts: dict[tuple[str, int], PrefillAttempt] = {}
        self._data_paths: dict[tuple[str, int], RpcClient] = {}
        # tok_e in the scheduler core's unit (prefill-cost-weighted by default): the core
        # replaces its own figure with ours, so a raw count would undercount cold prompts ~40×
        self._pe_load = cfg.scheduler.pe_load_counter()

    async def on_stop(self) -> None:
        for port in self.ports.values():
            port.close()
        for client in self._data_paths.values():
            await client.close()
        await super().on_stop()

    # ------------------------------------------------------------------ work
    async def apply(self, reply: FetchWorkReply) -> None:
        for plan in reply.plans:
            try:
                self.submit_plan(plan)
            except DualpathError as e:
                await self.report(plan.request_id, plan.attempt, "failed", code=e.code.value,
                                  message=e.message[:500], retryable=e.retryable,
                                  hop=getattr(e, "hop", None) or SERVICE_NAME)

    def submit_plan(self, plan: RequestPlan) -> PrefillAttempt:
        """Start one attempt; a bad plan raises InvalidArgument before anything is allocated."""
        if self._closing:
            raise with_hop(InvalidArgument(f"{self.node_id} is stopping"), SERVICE_NAME)
        key = (plan.request_id, plan.attempt)
        if key in self.attempts:
            return self.attempts[key]
        info = self._check_plan(plan)
        budget = plan.deadline_s if plan.deadline_s is not None else \
            self.settings.default_deadline_s
        deadline_at = asyncio.get_running_loop().time() + max(budget, 0.0)
        att = PrefillAttempt(self.io, self.ports[plan.pe_engine], self.data_path(plan), plan, info,
                             deadline_at)
        self.attempts[key] = att
        self.counters["plans"] += 1
        self.requests.spawn(att.run(), name=f"prefill-{plan.request_id}-{plan.attempt}")
        return att

    def _check_plan(self, plan: RequestPlan):
        try:
            if plan.pe_engine not in self.ports:
                raise InvalidArgument(f"plan for {plan.request_id!r} names engine "
                                      f"{plan.pe_engine!r}, not one of {self.node_id}'s "
                                      f"{sorted(self.ports)}")
            if plan.de_loader is None:
                raise InvalidArgument(f"plan for {plan.request_id!r} has no DE loader endpoint "
                                      f"(is a de_loader registered on {plan.de_node!r}?)")
            keys = list(plan.hit_keys) + list(plan.new_keys)
            hit = plan.hit_tokens > 0
            read_side = plan.read_side if hit else "none"
            return make_prompt(
                self.spec, request_id=plan.request_id, attempt=plan.attempt,
                session_id=plan.session_id, prompt_tokens=plan.hit_tokens + plan.new_tokens,
                hit_tokens=plan.hit_tokens, gen_tokens=plan.gen_tokens,
                hit_keys=keys[:len(plan.hit_keys)], new_keys=keys[len(plan.hit_keys):],
                tail_token_ids=plan.tail_token_ids, read_side=read_side,
                max_prompt_tokens=self.settings.max_prompt_tokens,
                split_tokens=plan.split_tokens if hit else 0)
        except DualpathError as e:
            self.counters["plans_rejected"] += 1
            raise with_hop(e, SERVICE_NAME) from None

    def revoke(self, r: Revocation) -> None:
        att = self.attempts.get((r.request_id, r.attempt))
        if att is not None:
            self.counters["revocations"] += 1
            att.drop(r.reason)

    async def drop_all(self, reason: str) -> None:
        for att in list(self.attempts.values()):
            att.drop(reason)
        tasks = [att.run_task for att in self.attempts.values() if att.run_task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.engine_release_timeout_s)

    # ------------------------------------------------------------------ peers
    def data_path(self, plan: RequestPlan) -> RpcClient:
        """The RPC client of the plan's DE loader (its data-path channel), cached."""
        ep: Endpoint | None = plan.de_loader
        if ep is None:
            raise with_hop(InvalidArgument("plan has no DE loader endpoint"), SERVICE_NAME)
        addr = (ep.control_host, ep.control_port)
        client = self._data_paths.get(addr)
        if client is None:
            from common.auth import load_secret
            client = RpcClient(self.cfg.rpc, addr[0], addr[1], role=SERVICE_NAME,
                               node_id=self.node_id, reply_type=DataPathReply,
                               kv_fingerprint=self.spec.fingerprint(),
                               auth_secret=load_secret(self.cfg.rpc))
            self._data_paths[addr] = client
        return client

    # ------------------------------------------------------------------ telemetry
    def engine_hbm(self) -> int:
        """The node's buffer, registered with each engine (the scheduler keeps it per node):
        every attempt stages its whole prompt's KV here, so the scheduler sends the node no
        more prompts than it holds (``policy.has_buffer_room``)."""
        return self.pool.num_pages * self.pool.page_bytes

    def free_buffer_bytes(self) -> int:
        """The pool's free pages less those of attempts received and not allocated yet."""
        return self.buffer_room(att.plan.hit_tokens + att.plan.new_tokens
                                for att in self.attempts.values() if att.region is None)

    def engine_loads(self) -> list[EngineLoad]:
        """seq/tok per engine: attempts received and not yet prefilled (paper §6.1); with
        each, the node's free buffer (:meth:`free_buffer_bytes`)."""
        loads = plan_loads(self.ports, (att.plan for att in self.attempts.values()
                                        if not att.finished_prefill), self._pe_load)
        free = self.free_buffer_bytes()
        return [msgspec.structs.replace(load, free_hbm_bytes=free) for load in loads]

    def node_counters(self) -> dict[str, float]:
        return {"attempts_live": float(len(self.attempts)),
                "engine_queue": float(sum(len(p) for p in self.ports.values()))}

    def layer_timings(self, request_id: str, attempt: int = 0) -> dict[str, Any] | None:
        """DE-path pull timings of a live attempt (benchmarks)."""
        att = self.attempts.get((request_id, attempt))
        if att is None:
            return None
        return {"pull_start": att.t_pull_start, "requested": list(att.layer_requested),
                "arrival": list(att.layer_arrival)}


def plan_loads(engine_ids: Iterable[str], plans: Iterable[RequestPlan],
               pe_load: Callable[[int, int], int]) -> list[EngineLoad]:
    """Per engine: how many of ``plans`` it holds and their summed ``pe_load(hit, new)``.

    ``pe_load`` is ``SchedulerConfig.pe_load_counter()``, the scheduler core's tok_e unit, and
    the plan's hit/new are the ones the core placed it with, so the scheduler's view of this
    node after a fetch equals its own accounting (``tests/test_scheduler_flow_control.py``).
    """
    seq = dict.fromkeys(engine_ids, 0)
    tok = dict.fromkeys(engine_ids, 0)
    for plan in plans:
        e = plan.pe_engine
        if e in seq:
            seq[e] += 1
            tok[e] += pe_load(plan.hit_tokens, plan.new_tokens)
    return [EngineLoad(e, seq[e], tok[e]) for e in seq]


async def stop_engines(tasks) -> None:
    await cancel_and_wait(list(tasks))
