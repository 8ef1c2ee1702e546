"""The live central scheduler: the policy core behind one RPC port for frontends and nodes.

One ``RpcServer`` serves both channels (``common.protocol.SchedulerRequest`` = the frontend
union + the node union + Ping/GetStats): one port to deploy, configure and health-check;
frontends and node services are told apart by what they call, and only a frontend
connection's requests are cancelled when it goes away (node services are judged by leases).

Shell around the sans-I/O :class:`~services.scheduler.core.Scheduler` (CONVENTIONS §3): every
handler validates, then calls the core synchronously (never across an ``await``), so the core
sees one caller. The shell adds what needs a clock or a socket:

* leases of node services (``leases.LeaseTable``): expiry or a restart (higher epoch) removes the
  node's engines from the core, whose requests are re-planned (``max_replans``) or failed with
  the reason — never dropped silently;
* the pull model: a group leader's ``FetchWork`` applies its telemetry and runs the core's fetch
  for its group; decisions go out through that group's ``dispatch.Outbox``;
* per-request state, timestamps and events (``request_state``), deadlines (a loop timer per
  request), hit lookup (``hit_lookup``), bounded admission (OVERLOADED with a retry hint).

How a node service drives it, step by step: docs/frontend-api.md ("Node services").
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import structlog

from common.auth import load_secret
from services.config import ServicesConfig
from common.errors import (AlreadyExists, DualpathError, ErrorCode, InvalidArgument, NotFound,
                           Overloaded, Unavailable)
from common.kv import ROOT_KEY, block_keys_from_tokens, spec_from_config
from common.metrics import observe_request
from common.protocol import (CancelRequest, CancelRequestReply, ClusterStatus, DecodeBinding,
                             EngineStatus, FetchWork, FetchWorkReply, GetClusterStatus,
                             GetStats, GetStatsReply, Heartbeat, HeartbeatReply, Ping, Pong,
                             RegisterNode, RegisterNodeReply, ReportProgress,
                             ReportProgressReply, RequestFailed, RequestFinished,
                             RequestPlaced, RequestPlan, RequestQueued, Revocation,
                             SchedulerRequest, SubmitRequest)
from common.rpc import CallContext, RpcServer, ServerConnection
from common.service import Service

from .core import Scheduler
from .dispatch import Limits, Outbox, leader_telemetry, take_reply
from .hit_lookup import HitLookup, SessionPrefixIndex
from .leases import ROLES, LeaseTable, Registration, check_registration
from .longpoll import WorkSignal, group_idle
from .records import Assignment, DEBinding, EngineSpec, Phase, Request, Role
from .request_state import (TERMINAL, RequestState, State, Submission, check_submit,
                            usable_hit_blocks)

log = structlog.get_logger(__name__)

CALL_MARGIN_S = 0.05     # a request's deadline fires this much before its stream's call deadline
STOP_RETRY_AFTER_S = 1.0
_UNSET: Any = object()

COUNTERS = ("submitted", "finished", "failed", "cancelled", "deadline_exceeded", "replans",
            "rejected_invalid", "rejected_overload", "registrations", "leases_expired",
            "fetches", "fetch_resends", "fetch_holds", "plans_sent", "bindings_sent",
            "revocations_sent", "hit_lookup_failures", "stale_reports")


class SchedulerService(Service):
    """Central scheduler service; ``port`` is known after ``start()``."""

    name = "scheduler"

    def __init__(self, config: ServicesConfig | None = None, *, host: str | None = None,
                 port: int | None = None, hit_lookup: HitLookup | None = None,
                 node_id: str = "scheduler", auth_secret: bytes | None = _UNSET,
                 on_listening: Callable[[str, int], None] | None = None) -> None:
        cfg = config if config is not None else ServicesConfig()
        self.settings = s = cfg.scheduler_service
        super().__init__(node_id, drain_timeout_s=s.drain_grace_s)
        self.config = cfg
        self.kv = spec_from_config(cfg.kv)
        self.core = Scheduler(cfg.scheduler)
        self.hits: HitLookup = hit_lookup or SessionPrefixIndex(s.max_sessions)
        self.leases = LeaseTable(s.lease_s)
        self._host = host or s.host or cfg.rpc.host
        self._port = s.port if port is None else port
        self._on_listening = on_listening
        self._reqs: dict[str, RequestState] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._outboxes: dict[tuple[str, str], Outbox] = {}
        self.work = WorkSignal()            # wakes held (long-poll) fetches: ``longpoll``
        self._states: Counter[State] = Counter()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._limits = Limits(s.max_plans_per_fetch, s.max_bindings_per_fetch,
                              s.max_revocations_per_fetch, s.fetch_reply_budget_bytes)
        self._closing = False
        self._stages = {"allocated": self._st_allocated, "read_done": self._st_read_done,
                        "prefill_done": self._st_prefill_done, "first_token": self._st_first,
                        "second_token": self._st_second, "finished": self._st_finished,
                        "failed": self._st_failed}
        self.handlers: dict[type, Any] = {
            SubmitRequest: self._on_submit, CancelRequest: self._on_cancel,
            GetClusterStatus: self._on_status, RegisterNode: self._on_register,
            Heartbeat: self._on_heartbeat, FetchWork: self._on_fetch,
            ReportProgress: self._on_progress, Ping: self._on_ping, GetStats: self._on_stats,
        }
        secret = load_secret(cfg.rpc) if auth_secret is _UNSET else auth_secret
        self._server = RpcServer(cfg.rpc, service=self.name, node_id=node_id,
                                 handlers=self.handlers, request_type=SchedulerRequest,
                                 kv_fingerprint=self.kv.fingerprint(), auth_secret=secret,
                                 on_disconnect=self._on_disconnect)

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        return self._server.port

    @property
    def host(self) -> str:
        return self._host

    @property
    def active_requests(self) -> int:
        return len(self._reqs)

    def request_state(self, request_id: str) -> State | None:
        rs = self._reqs.get(request_id)
        return rs.state if rs is not None else None

    async def on_start(self) -> None:
        await self._server.start(self._host, self._port)
        self.log.info("scheduler_listening", host=self._host, port=self.port,
                      policy=self.core.config.policy, alpha=self.core.alpha, beta=self.core.beta)
        if self._on_listening is not None:
            self._on_listening(self._host, self.port)

    def loops(self):
        return [self._lease_loop]

    async def on_stop(self) -> None:
        self._closing = True
        self.work.kick()
        for rs in list(self._reqs.values()):
            self._end(rs, State.FAILED, rs.failed_event(
                ErrorCode.UNAVAILABLE, "the scheduler is shutting down", True, STOP_RETRY_AFTER_S))
        await self._server.stop(grace_s=self.settings.drain_grace_s)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_check_s)
            for reg in self.leases.expired(self._now()):
                try:
                    self.counters["leases_expired"] += 1
                    self._drop_registration(reg, f"{reg.node_id}/{reg.msg.service} lease expired "
                                                 f"(silent for {self.settings.lease_s}s)")
                except Exception:       # one broken registration must not stop the scheduler
                    self.log.exception("lease_expiry_failed", node=reg.node_id,
                                       service=reg.msg.service)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    # ------------------------------------------------------------------ frontend channel
    async def _on_submit(self, msg: SubmitRequest, ctx: CallContext):
        rs = self._admit(msg, ctx)
        try:
            await self._enqueue(rs)
            while True:
                event = await rs.events.get()
                yield event
                if isinstance(event, (RequestFinished, RequestFailed)):
                    return
        finally:
            if not rs.terminal:     # the frontend left (cancel, disconnect, call deadline)
                self._end(rs, State.CANCELLED, rs.failed_event(
                    ErrorCode.CANCELLED, "the frontend closed the submit stream", False))

    def _admit(self, msg: SubmitRequest, ctx: CallContext) -> RequestState:
        """Checks that need no await; the request is registered (its id taken) on return."""
        s = self.settings
        if self._closing:
            raise Unavailable("the scheduler is shutting down", retry_after_s=STOP_RETRY_AFTER_S)
        try:
            sub = check_submit(msg, s, self.kv.block_tokens)
            if sub.request_id in self._reqs:
                raise AlreadyExists(f"request {sub.request_id!r} is already queued or running; "
                                    f"request ids must be unique among live requests")
        except DualpathError:
            self.counters["rejected_invalid"] += 1
            raise
        waiting = self._states[State.QUEUED]
        if waiting >= s.max_queued_requests or len(self._reqs) >= s.max_active_requests:
            self.counters["rejected_overload"] += 1
            raise Overloaded(f"{waiting} requests wait for placement and {len(self._reqs)} are "
                             f"live (limits scheduler_service.max_queued_requests="
                             f"{s.max_queued_requests}, max_active_requests="
                             f"{s.max_active_requests}); retry later",
                             retry_after_s=s.overload_retry_after_s)
        return self._register_request(sub, ctx)

    def _register_request(self, sub: Submission, ctx: CallContext) -> RequestState:
        loop = asyncio.get_running_loop()
        now = loop.time()
        budget = min(sub.deadline_s if sub.deadline_s is not None else math.inf,
                     ctx.remaining() - CALL_MARGIN_S)
        deadline = now + max(budget, 0.0) if math.isfinite(budget) else None
        rs = RequestState(sub, ctx.conn_id, now, deadline)
        self._reqs[sub.request_id] = rs
        self._states[State.QUEUED] += 1
        self.counters["submitted"] += 1
        if deadline is not None:
            rs.timer = loop.call_at(deadline, self._on_deadline, rs)
        return rs

    async def _enqueue(self, rs: RequestState) -> None:
        """Hit length, then into the core's queues; announces RequestQueued."""
        sub, bt = rs.sub, self.kv.block_tokens
        if sub.hit_tokens is not None:
            hit = sub.hit_tokens
        elif sub.keys:
            blocks = await self._lookup(sub)
            hit = usable_hit_blocks(blocks, len(sub.keys), sub.prompt_tokens, bt) * bt
        else:
            hit = 0
        if rs.terminal:             # cancelled or expired during the lookup
            return
        rs.hit_tokens = hit
        req = Request.sized(sub.request_id, sub.session_id, hit, sub.prompt_tokens - hit,
                            sub.gen_tokens, self.kv.bytes_per_token)
        try:
            self.core.submit(req)
        except DualpathError as e:
            self.counters["rejected_invalid"] += 1
            self._end(rs, State.FAILED, rs.failed_event(e.code, e.message, e.retryable))
            raise
        rs.in_core, rs.hbm_bytes = True, req.hbm_bytes
        self.work.kick()                    # queued: held fetches place it now
        q = self.core.queue_lengths()
        position = q["global"] + q["private"] + q["pe"] - 1
        rs.events.put_nowait(RequestQueued(sub.request_id, position, hit))

    async def _lookup(self, sub: Submission) -> int:
        try:
            async with asyncio.timeout(self.settings.hit_lookup_timeout_s):
                return await self.hits.lookup(sub.session_id, sub.keys)
        except Exception as e:      # no hit is always correct, only slower
            self.counters["hit_lookup_failures"] += 1
            self.log.warning("hit_lookup_failed", request_id=sub.request_id, error=repr(e))
            return 0

    def _on_deadline(self, rs: RequestState) -> None:
        if self._reqs.get(rs.request_id) is not rs or rs.terminal:
            return
        self.counters["deadline_exceeded"] += 1
        self._end(rs, State.FAILED, rs.failed_event(
            ErrorCode.DEADLINE_EXCEEDED, f"request {rs.request_id!r} ran past its deadline "
            f"({rs.sub.deadline_s}s) while {rs.state.value}", True))

    async def _on_cancel(self, msg: CancelRequest, ctx: CallContext) -> CancelRequestReply:
        rs = self._reqs.get(msg.request_id)
        if rs is None:
            state = self._recent.get(msg.request_id)
            if state is None:
                raise NotFound(f"request {msg.request_id[:80]!r} is not known (never submitted, "
                               f"or it ended long ago)")
            return CancelRequestReply(msg.request_id, False, state)
        self._end(rs, State.CANCELLED, rs.failed_event(
            ErrorCode.CANCELLED, "cancelled by CancelRequest", False))
        return CancelRequestReply(msg.request_id, True, State.CANCELLED.value)

    def _on_disconnect(self, conn: ServerConnection) -> None:
        gone = [rs for rs in self._reqs.values() if rs.conn_id == conn.conn_id]
        for rs in gone:
            self._end(rs, State.CANCELLED, rs.failed_event(
                ErrorCode.CANCELLED, "the frontend disconnected", False))
        if gone:
            self.log.info("frontend_disconnected", conn_id=conn.conn_id, cancelled=len(gone))

    async def _on_status(self, msg: GetClusterStatus, ctx: CallContext) -> ClusterStatus:
        now = self._now()
        nodes = [reg.status(now) for reg in self.leases]
        where = {e.engine_id: (reg.node_id, reg.role) for reg in self.leases for e in reg.engines}
        engines = [EngineStatus(r.engine_id, *where.get(r.engine_id, ("", "")), r.seq, r.tok,
                                r.free_hbm_bytes) for r in self.core.engine_reports()]
        read_q = {}
        for reg in self.leases:
            if reg.engines and reg.node_id not in read_q:
                read_q[reg.node_id] = self.core.read_queue(reg.node_id)
        by_state = {s.value: self._states[s] for s in State
                    if self._states[s] and s not in TERMINAL}   # ended ones: counters
        return ClusterStatus(self.core.config.policy, nodes, engines, read_q,
                             self.core.queue_lengths(), by_state, dict(self.counters))

    async def _on_ping(self, msg: Ping, ctx: CallContext) -> Pong:
        return Pong(msg.payload)

    async def _on_stats(self, msg: GetStats, ctx: CallContext) -> GetStatsReply:
        counters = {**self.counters, **self._server.stats(), "requests_live": len(self._reqs),
                    "nodes": len(self.leases)}
        return GetStatsReply(self.name, self.node_id, {k: float(v) for k, v in counters.items()})

    # ------------------------------------------------------------------ node channel
    async def _on_register(self, msg: RegisterNode, ctx: CallContext) -> RegisterNodeReply:
        s = self.settings
        check_registration(msg, s.max_id_chars, s.max_engines_per_node)
        old = self.leases.classify(msg)
        now = self._now()
        if old is not None and old.same_incarnation(msg):
            self.leases.renew(old, now)         # a retried registration: nothing changes
            return self._register_reply()
        if old is not None:
            self._drop_registration(old, f"{msg.node_id}/{msg.service} restarted "
                                         f"(epoch {old.epoch} → {msg.epoch})")
        self._add_engines(msg)
        reg = self.leases.add(msg, now)
        if msg.engines:
            self._outboxes[(msg.role, reg.group_id)] = Outbox(msg.role, reg.group_id)
        self.counters["registrations"] += 1
        self.work.kick()
        self.log.info("node_registered", node=msg.node_id, node_service=msg.service,
                      role=msg.role, epoch=msg.epoch, engines=len(msg.engines))
        return self._register_reply()

    def _register_reply(self) -> RegisterNodeReply:
        s = self.settings
        return RegisterNodeReply(s.lease_s, s.heartbeat_s, s.fetch_interval_s,
                                 self.kv.block_tokens, s.fetch_hold_s)

    def _add_engines(self, msg: RegisterNode) -> None:
        added: list[str] = []
        try:
            for e in msg.engines:
                self.core.add_engine(EngineSpec(e.engine_id, Role(msg.role), msg.node_id,
                                                hbm_capacity_bytes=e.hbm_capacity_bytes))
                added.append(e.engine_id)
        except DualpathError:
            for eid in added:                   # fresh engines hold no requests
                self.core.remove_engine(eid)
            raise

    def _drop_registration(self, reg: Registration, reason: str) -> None:
        """Forget a node service; its engines leave the core and their requests re-plan."""
        self.leases.remove(reg)
        self.log.warning("node_removed", node=reg.node_id, node_service=reg.msg.service,
                         epoch=reg.epoch, reason=reason, engines=len(reg.engines))
        if not reg.engines:
            return
        self._outboxes.pop((reg.role, reg.group_id), None)
        self.work.kick()
        requeued: dict[str, None] = {}
        failed: list[str] = []
        for e in reg.engines:
            try:
                res = self.core.remove_engine(e.engine_id)
            except NotFound:
                continue
            requeued.update(dict.fromkeys(res.requeued))
            failed.extend(res.failed)
        for rid in failed:
            requeued.pop(rid, None)
        self._after_replan(list(requeued), failed, reason, ErrorCode.PEER_FAILED)

    async def _on_heartbeat(self, msg: Heartbeat, ctx: CallContext) -> HeartbeatReply:
        reg = self.leases.live(msg.node_id, msg.service, msg.epoch)
        self.leases.renew(reg, self._now())
        if msg.read_q_tokens is not None:
            if msg.read_q_tokens < 0:
                raise InvalidArgument(f"read_q_tokens={msg.read_q_tokens} must be >= 0")
            self.core.update_read_queue(msg.node_id, msg.read_q_tokens)
        return HeartbeatReply(self.settings.lease_s)

    async def _on_fetch(self, msg: FetchWork, ctx: CallContext) -> FetchWorkReply:
        if msg.role not in ROLES:
            raise InvalidArgument(f"FetchWork.role {msg.role!r} must be one of {ROLES}")
        reg = self.leases.live_leader(msg.node_id, msg.role, msg.epoch)
        if msg.group_id and msg.group_id != reg.group_id:
            raise InvalidArgument(f"{msg.node_id} leads group {reg.group_id!r}, not "
                                  f"{msg.group_id!r}")
        now = self._now()
        self.leases.renew(reg, now)
        self.counters["fetches"] += 1
        box = self._outboxes[(msg.role, reg.group_id)]
        again = box.resend(msg.ack_seq)
        if again is not None:
            self.counters["fetch_resends"] += 1
            return again
        hold_until = now + min(msg.wait_s, self.settings.fetch_hold_s) \
            if msg.wait_s > 0 and group_idle(msg.engines) else now
        if ctx.deadline is not None:            # answer inside the caller's deadline
            hold_until = min(hold_until, ctx.deadline - 0.1)
        while True:
            telemetry = leader_telemetry(reg, msg, box, self._reqs, self.core.pe_load)
            if msg.role == Role.PREFILL:
                for a in self.core.on_pe_group_fetch(reg.group_id, telemetry):
                    self._on_assignment(a, box, now)
            else:
                for b in self.core.on_de_group_fetch(reg.group_id, telemetry):
                    self._on_binding(b, box)
            if box:                             # placed something: a binding here may be
                self.work.kick()                # what another held group is waiting for
                break
            left = hold_until - self._now()
            if left <= 0 or self._closing or ctx.cancelled:
                break
            self.counters["fetch_holds"] += 1
            if not await self.work.wait(left):
                break
            reg = self.leases.live_leader(msg.node_id, msg.role, msg.epoch)  # dropped meanwhile?
            box, now = self._outboxes[(msg.role, reg.group_id)], self._now()
        return take_reply(box, self._reqs, self._limits, self._binding_msg, self._plan_msg,
                          self._delivered, msg.ack_seq is not None)

    def _on_binding(self, b: DEBinding, box: Outbox) -> None:
        rs = self._reqs.get(b.request_id)
        if rs is None:                          # cannot happen: the core only holds live ones
            self.log.error("binding_for_unknown_request", request_id=b.request_id)
            self.core.cancel(b.request_id)
            return
        rs.de_engine, rs.de_node = b.de_engine, b.de_node
        box.bindings.append((rs.request_id, rs.attempt))

    def _on_assignment(self, a: Assignment, box: Outbox, now: float) -> None:
        rs = self._reqs.get(a.request_id)
        if rs is None:
            self.log.error("assignment_for_unknown_request", request_id=a.request_id)
            self.core.cancel(a.request_id)
            return
        if a.attempt != rs.attempt:             # the core counts re-plans too; it wins
            self.log.warning("attempt_out_of_sync", request_id=rs.request_id,
                             core=a.attempt, service=rs.attempt)
            rs.attempt = a.attempt
        rs.assignment, rs.t_placed = a, now
        rs.de_engine, rs.de_node = a.de_engine, a.de_node
        self._set_state(rs, State.PLACED)
        box.plans.append((rs.request_id, rs.attempt))
        rs.events.put_nowait(RequestPlaced(rs.request_id, a.pe_engine, a.pe_node, a.de_engine,
                                           a.de_node, a.read_side.value, a.hit_tokens,
                                           a.attempt))

    def _binding_msg(self, rs: RequestState) -> DecodeBinding:
        sub = rs.sub
        return DecodeBinding(rs.request_id, rs.attempt, sub.session_id, rs.de_engine,
                             sub.prompt_tokens, rs.hit_tokens, sub.gen_tokens, rs.hbm_bytes,
                             rs.remaining(self._now()))

    def _plan_msg(self, rs: RequestState) -> RequestPlan:
        a, sub = rs.assignment, rs.sub
        hit_blocks = rs.hit_tokens // self.kv.block_tokens
        de_loader = self.leases.leader(a.de_node, Role.DECODE)
        gateway = (self.leases.find_service(a.read_node, self.settings.gateway_service)
                   if a.read_node else None)
        return RequestPlan(
            rs.request_id, rs.attempt, sub.session_id, a.pe_engine, a.pe_node, a.de_engine,
            a.de_node, a.read_side.value, a.read_node or "", a.hit_tokens, a.new_tokens,
            a.gen_tokens, rs.hbm_bytes, list(sub.keys[:hit_blocks]), list(sub.keys[hit_blocks:]),
            de_loader.endpoint() if de_loader else None,
            gateway.endpoint() if gateway else None, rs.remaining(self._now()),
            list(sub.tail_token_ids) if sub.tail_token_ids is not None else None)

    def _delivered(self, rs: RequestState, kind: str) -> None:
        if kind == "binding":
            rs.de_group = rs.de_node
            self.counters["bindings_sent"] += 1
            return
        rs.pe_group = rs.assignment.pe_node
        rs.t_dispatched = self._now()
        self.counters["plans_sent"] += 1
        if rs.state is State.PLACED:
            self._set_state(rs, State.LOADING)

    # ------------------------------------------------------------------ progress reports
    async def _on_progress(self, msg: ReportProgress, ctx: CallContext) -> ReportProgressReply:
        stage = self._stages.get(msg.stage)
        if stage is None:
            raise InvalidArgument(f"unknown stage {msg.stage[:40]!r}; one of {list(self._stages)}")
        if msg.tokens < 0:
            raise InvalidArgument(f"tokens={msg.tokens} must be >= 0")
        rs = self._reqs.get(msg.request_id)
        if rs is None or rs.attempt != msg.attempt or not rs.in_core:
            self.counters["stale_reports"] += 1
            state = rs.state.value if rs is not None else self._recent.get(msg.request_id,
                                                                           "unknown")
            return ReportProgressReply(False, state)
        if rs.assignment is None and msg.stage != "failed":
            raise InvalidArgument(f"stage {msg.stage!r} for request {rs.request_id!r} attempt "
                                  f"{rs.attempt}, which has not been placed yet")
        stage(rs, msg, self._now())
        self.work.kick()                    # capacity may have freed up (finished, failed)
        live = rs.attempt == msg.attempt and (not rs.terminal or rs.state is State.FINISHED)
        return ReportProgressReply(live, rs.state.value)

    def _st_allocated(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        if rs.t_allocated is None:
            rs.t_allocated = now
        if rs.state is State.PLACED:
            self._set_state(rs, State.LOADING)

    def _st_read_done(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        self.core.read_done(rs.request_id)
        if rs.t_read is None:
            rs.t_read = now
        if rs.state in (State.PLACED, State.LOADING):
            self._set_state(rs, State.PREFILLING)

    def _st_prefill_done(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        self.core.prefill_done(rs.request_id)
        self._st_first(rs, msg, now)

    def _st_first(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        if rs.t_first is None:
            rs.events.put_nowait(rs.first_token_event(now))
        if rs.state is not State.DECODING:
            self._set_state(rs, State.DECODING)

    def _st_second(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        self._st_first(rs, msg, now)
        if rs.t_second is None:
            rs.t_second = now

    def _st_finished(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        self.core.complete(rs.request_id)
        rs.in_core = False
        self._st_first(rs, msg, now)
        self.hits.finished(rs.sub.session_id, _stored_keys(rs.sub, msg.output_token_ids,
                                                           self.kv.block_tokens))
        self.counters["finished"] += 1
        self._end(rs, State.FINISHED, rs.finished_event(msg.tokens, now, msg.output_token_ids))

    def _st_failed(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        code = msg.code if msg.code in ErrorCode.__members__ else ErrorCode.INTERNAL.value
        where = (msg.hop[:80] or "node") + (f" on {msg.node_id[:80]}" if msg.node_id else "")
        reason = f"{where} failed attempt {rs.attempt}: {code}: {msg.message[:500]}"
        if not msg.retryable:
            self._end(rs, State.FAILED, rs.failed_event(code, reason, False))
            return
        res = self.core.fail(rs.request_id)
        self._after_replan(list(res.requeued), list(res.failed), reason, code)

    # ------------------------------------------------------------------ shared transitions
    def _after_replan(self, requeued: list[str], failed: list[str], reason: str,
                      code: str) -> None:
        """Mirror the core's re-plans: revoke the old attempt, queue the new one, or fail."""
        for rid in requeued:
            rs = self._reqs.get(rid)
            if rs is None:
                continue
            self._revoke(rs, reason)
            keep_de = self.core.phase(rid) is Phase.BOUND
            rs.next_attempt(keep_de)
            self._set_state(rs, State.QUEUED)
            self.counters["replans"] += 1
            if keep_de:                          # same DE, new attempt: tell its loader again
                box = self._outboxes.get((Role.DECODE.value, rs.de_node))
                if box is not None:
                    box.bindings.append((rid, rs.attempt))
            self.log.info("request_replanned", request_id=rid, attempt=rs.attempt,
                          kept_de=keep_de, reason=reason)
        for rid in failed:
            rs = self._reqs.get(rid)
            if rs is None:
                continue
            rs.in_core = False                   # the core gave up on it already
            limit = self.core.config.max_replans
            self._end(rs, State.FAILED, rs.failed_event(
                code, f"{reason}; gave up after {limit} re-plans (scheduler.max_replans)",
                True))

    def _end(self, rs: RequestState, state: State, event: RequestFailed | RequestFinished) -> None:
        """The one way out: release the core, revoke dispatched work, push the last event."""
        if rs.terminal:
            return
        if rs.in_core:
            self.core.cancel(rs.request_id)
            rs.in_core = False
        if state is not State.FINISHED:
            self._revoke(rs, getattr(event, "message", state.value))
            self.counters["cancelled" if state is State.CANCELLED else "failed"] += 1
        if rs.timer is not None:
            rs.timer.cancel()
        self._set_state(rs, state)
        if state is State.FINISHED:
            observe_request(event)          # TTFT/TTST/TPOT histograms (common.metrics)
        rs.events.put_nowait(event)
        if self._reqs.get(rs.request_id) is rs:
            del self._reqs[rs.request_id]
        self._recent[rs.request_id] = state.value
        while len(self._recent) > self.settings.recent_requests:
            self._recent.popitem(last=False)
        self.log.info("request_ended", request_id=rs.request_id, state=state.value,
                      attempt=rs.attempt, hit_tokens=rs.hit_tokens,
                      prompt_tokens=rs.sub.prompt_tokens, **_summary(event))

    def _revoke(self, rs: RequestState, reason: str) -> None:
        for role, group in ((Role.DECODE.value, rs.de_group), (Role.PREFILL.value, rs.pe_group)):
            box = self._outboxes.get((role, group)) if group is not None else None
            if box is not None:
                box.revoked.append(_revocation(rs, reason))
                self.counters["revocations_sent"] += 1
        rs.de_group = rs.pe_group = None
        self.work.kick()

    def _set_state(self, rs: RequestState, state: State) -> None:
        self._states[rs.state] -= 1
        self._states[state] += 1
        rs.state = state
        self.work.kick()                    # queued / placed / ended: held fetches look again


def _stored_keys(sub, output_token_ids: list[int] | None, block_tokens: int) -> tuple[str, ...]:
    """Prompt keys plus the generated blocks the decode side wrote back (data path rule:
    full blocks of prompt + output without its last token, whose KV is not computed yet)."""
    if not output_token_ids or sub.tail_token_ids is None:
        return sub.keys
    parent = sub.keys[-1] if sub.keys else ROOT_KEY
    more = list(sub.tail_token_ids) + list(output_token_ids[:-1])
    try:
        return sub.keys + tuple(block_keys_from_tokens(more, block_tokens, parent))
    except DualpathError:       # out-of-range ids from a node: keep what is certain
        return sub.keys


def _revocation(rs: RequestState, reason: str) -> Revocation:
    return Revocation(rs.request_id, rs.attempt, reason[:300])


def _summary(event: RequestFailed | RequestFinished) -> dict[str, Any]:
    if isinstance(event, RequestFinished):
        return {"tokens": event.tokens, "ttft_ms": round(event.ttft_s * 1e3, 3),
                "e2e_ms": round(event.e2e_s * 1e3, 3)}
    return {"code": event.code, "reason": event.message}
