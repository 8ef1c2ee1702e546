"""The live central scheduler: the policy core behind one RPC port for frontends and nodes.

One ``RpcServer`` serves both channels (``common.protocol.SchedulerRequest`` = the frontend
union + the node union + Ping/GetStats): one port to deploy, configure and health-check;
frontends and node services are told apart by what they call, and only a frontend
connection's requests are cancelled when it goes away (node services are judged by leases).

Shell around the sans-I/O :class:`~services.scheduler.core.Scheduler` (docs/contributing.md,
'Sans-I/O cores'): every handler validates, then calls the core synchronously (never across an
``await``), so the core sees one caller. The shell adds what needs a clock or a socket:

* leases of node services (``leases.LeaseTable``): expiry or a restart (higher epoch) removes the
  node's engines from the core, whose requests are re-planned (``max_replans``) or failed with
  the reason — never dropped silently;
* the pull model: a group leader's ``FetchWork`` applies its telemetry and runs the core's fetch
  for its group; decisions go out through that group's ``dispatch.Outbox``;
* per-request state, timestamps and events (``request_state``), deadlines (a loop timer per
  request), hit lookup (``hit_lookup``), bounded admission (OVERLOADED with a retry hint).

This module holds the lifecycle, the frontend channel and the transitions both channels share
(``_end``, ``_after_replan``); the node channel's handlers (register, heartbeat, fetch, progress
reports) are mixed in from ``node_channel``.

How a node service drives it, step by step: docs/frontend-api.md ("Node services").
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, OrderedDict
from typing import Any

import msgspec
import structlog

from common.auth import load_secret
from services.config import ServicesConfig
from common.errors import (AlreadyExists, DualpathError, ErrorCode, NotFound,
                           Overloaded, Unavailable)
from common.kv import spec_from_config
from common.metrics import observe_failed_attempt, observe_request
from common.protocol import (CancelRequest, CancelRequestReply, ClusterStatus, EngineStatus,
                             FetchWork, GetClusterStatus, GetStats, GetStatsReply, Heartbeat, Ping,
                             Pong, RegisterNode, ReportProgress, RequestFailed, RequestFinished,
                             RequestQueued, Revocation, SchedulerRequest, SubmitRequest)
from common.rpc import CallContext, RpcServer, ServerConnection
from common.service import Service

from .core import Scheduler
from .dispatch import Limits, Outbox
from .hit_lookup import HitLookup, SessionPrefixIndex
from .leases import LeaseTable
from .longpoll import WorkSignal
from .node_channel import NodeChannel
from .records import Phase, Request, Role
from .recovery import KeptResults
from .stored_prefix import PromisedPrefixes
from .request_state import (SUPERSEDED, TERMINAL, RequestState, State, Submission,
                            check_submit, usable_hit_blocks)

log = structlog.get_logger(__name__)

CALL_MARGIN_S = 0.05     # a request's deadline fires this much before its stream's call deadline
STOP_RETRY_AFTER_S = 1.0
_UNSET: Any = object()

COUNTERS = ("submitted", "finished", "failed", "cancelled", "deadline_exceeded", "replans",
            "rejected_invalid", "rejected_overload", "registrations", "leases_expired",
            "fetches", "fetch_resends", "fetch_holds", "plans_sent", "bindings_sent",
            "revocations_sent", "hit_lookup_failures", "hit_lookup_retries", "stale_reports",
            "attempts_failed", "resubmits", "detached", "results_kept", "results_recovered",
            "hit_shortfalls", "hit_shortfall_tokens", "discovery_gone")


class SchedulerService(NodeChannel, Service):
    """Central scheduler service; ``port`` is known after ``start()``."""

    name = "scheduler"

    def __init__(self, config: ServicesConfig | None = None, *, host: str | None = None,
                 port: int | None = None, hit_lookup: HitLookup | None = None,
                 node_id: str = "scheduler", auth_secret: bytes | None = _UNSET,
                 epoch: int | None = None) -> None:
        cfg = config if config is not None else ServicesConfig()
        self.settings = s = cfg.scheduler_service
        super().__init__(node_id, drain_timeout_s=s.drain_grace_s)
        self.config = cfg
        self.kv = spec_from_config(cfg.kv)
        self.core = Scheduler(cfg.scheduler)
        self.hits: HitLookup = hit_lookup or SessionPrefixIndex(s.max_sessions)
        self.leases = LeaseTable(s.lease_s)
        # This incarnation, told to nodes at registration: a node that sees it change knows
        # the scheduler restarted and redelivers the results it kept (``recovery``). With
        # etcd it is the election's fencing epoch, 0 (standby: every call refused) until won.
        self.epoch = time.time_ns() if epoch is None else epoch
        self.kept = KeptResults(s.kept_results, s.kept_result_s)
        self.promised = PromisedPrefixes(s.max_sessions)    # what finished turns stored
        self._host = host or s.host or cfg.rpc.host
        self._port = s.port if port is None else port
        self._reqs: dict[str, RequestState] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._outboxes: dict[tuple[str, str], Outbox] = {}
        self.work = WorkSignal()            # wakes held (long-poll) fetches: ``longpoll``
        self._states: Counter[State] = Counter()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._limits = Limits(s.max_plans_per_fetch, s.max_bindings_per_fetch,
                              s.max_revocations_per_fetch, s.fetch_reply_budget_bytes)
        self._closing = False
        self.discovery: Any = None          # etcd mode: the leader's ``ClusterView``
        self._stages = self._stage_handlers()
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

    def loops(self):
        return [self._lease_loop]

    async def on_stop(self) -> None:
        self._closing = True
        self.work.kick()
        for rs in list(self._reqs.values()):
            event = rs.failed_event(ErrorCode.UNAVAILABLE, "the scheduler is shutting down", True,
                                    STOP_RETRY_AFTER_S)
            self._end(rs, State.FAILED, msgspec.structs.replace(event, resubmit=True))
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
        rs, queue = self._admit(msg, ctx)
        try:
            if queue is None:               # a new request (not a resubmission of a live one)
                queue = rs.events
                kept = self.kept.take(rs.request_id, self._now())
                if kept is not None:
                    self._finish_kept(rs, kept, "its frontend resubmitted it")
                else:
                    await self._enqueue(rs)
            while True:
                event = await queue.get()
                if event is SUPERSEDED:     # a resubmission took the stream over: this one ends
                    yield rs.failed_event(ErrorCode.ALREADY_EXISTS, "a resubmission of this "
                                          "request took its event stream over", False)
                    return
                yield event
                if isinstance(event, (RequestFinished, RequestFailed)):
                    return
        finally:
            if not rs.terminal and rs.events is queue:
                if ctx.conn.closed:         # the connection dropped: wait for a resubmission
                    self._detach(rs, ctx.conn_id)
                else:                       # the frontend left (cancel, call deadline)
                    self._end(rs, State.CANCELLED, rs.failed_event(
                        ErrorCode.CANCELLED, "the frontend closed the submit stream", False))

    def _admit(self, msg: SubmitRequest,
               ctx: CallContext) -> tuple[RequestState, asyncio.Queue | None]:
        """Checks that need no await; the request is registered (its id taken) on return.

        A resubmission of a live request (same id and content) returns it with the event queue
        it now streams to; a new request returns None for the queue.
        """
        s = self.settings
        if self._closing:
            raise Unavailable("the scheduler is shutting down", retry_after_s=STOP_RETRY_AFTER_S)
        self._check_leading()
        try:
            sub = check_submit(msg, s, self.kv.block_tokens)
            live = self._reqs.get(sub.request_id)
            if live is not None:
                return live, self._reattach(live, sub, ctx)
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
        return self._register_request(sub, ctx), None

    def _reattach(self, rs: RequestState, sub: Submission, ctx: CallContext) -> asyncio.Queue:
        """A frontend resubmitted a live request (after reconnecting): it gets the stream."""
        if not rs.same_request(sub):
            raise AlreadyExists(f"request {sub.request_id!r} is already queued or running with "
                                f"other content; request ids must be unique among live requests")
        self.counters["resubmits"] += 1
        self.log.info("request_resubmitted", request_id=rs.request_id, state=rs.state.value,
                      attempt=rs.attempt, old_conn=rs.conn_id, conn=ctx.conn_id)
        queue = rs.attach(ctx.conn_id)
        # an event at once tells the frontend the request is held again (its wait is bounded)
        queue.put_nowait(RequestQueued(rs.request_id, 0, rs.hit_tokens,
                                       hit_lookup_failed=rs.hit_lookup_failed))
        return queue

    def _detach(self, rs: RequestState, conn_id: int) -> None:
        """The frontend's connection dropped: cancel after ``reattach_grace_s`` unless it
        resubmits the request (``_reattach``) before then."""
        grace = self.settings.reattach_grace_s
        if grace <= 0 or self._closing:
            self._end(rs, State.CANCELLED, rs.failed_event(
                ErrorCode.CANCELLED, "the frontend disconnected", False))
            return
        if rs.detach_timer is None:
            self.counters["detached"] += 1
            rs.detach_timer = asyncio.get_running_loop().call_later(
                grace, self._detach_expired, rs, conn_id)

    def _detach_expired(self, rs: RequestState, conn_id: int) -> None:
        rs.detach_timer = None
        if rs.terminal or rs.conn_id != conn_id or self._reqs.get(rs.request_id) is not rs:
            return
        self._end(rs, State.CANCELLED, rs.failed_event(
            ErrorCode.CANCELLED, f"the frontend disconnected and did not resubmit within "
            f"scheduler_service.reattach_grace_s={self.settings.reattach_grace_s}s", False))

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
            rs.hit_lookup_failed = blocks is None
            hit = usable_hit_blocks(blocks or 0, len(sub.keys), sub.prompt_tokens, bt) * bt
            if blocks is not None:
                self._check_shortfall(rs, hit // bt)
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
        rs.events.put_nowait(RequestQueued(sub.request_id, position, hit,
                                           hit_lookup_failed=rs.hit_lookup_failed,
                                           hit_shortfall_tokens=rs.hit_shortfall_tokens))

    def _check_shortfall(self, rs: RequestState, found_blocks: int) -> None:
        """Count and log a hit shorter than what the session's last turn stored."""
        sub, bt = rs.sub, self.kv.block_tokens
        short = self.promised.shortfall(sub.session_id, sub.keys, found_blocks,
                                        (sub.prompt_tokens - 1) // bt)
        if not short:
            return
        rs.hit_shortfall_tokens = short * bt
        self.counters["hit_shortfalls"] += 1
        self.counters["hit_shortfall_tokens"] += short * bt
        self.log.warning("hit_shorter_than_stored", request_id=sub.request_id,
                         session_id=sub.session_id, found_blocks=found_blocks,
                         missing_blocks=short, missing_tokens=short * bt)

    async def _lookup(self, sub: Submission) -> int | None:
        """Stored leading blocks; None when the lookup failed (the caller takes hit 0)."""
        try:
            async with asyncio.timeout(self.settings.hit_lookup_timeout_s):
                return await self.hits.lookup(sub.session_id, sub.keys)
        except Exception as e:      # no hit is always correct, only slower — but never silent
            self._lookup_failed(sub, e)
            return None
        finally:                    # a retrying lookup (GatewayHitLookup) counts its retries
            self.counters["hit_lookup_retries"] = getattr(self.hits, "retries", 0)

    def _lookup_failed(self, sub: Submission, e: Exception) -> None:
        """Count (``dualpath_hit_lookup_failures_total``) and log why the hit is taken as 0."""
        self.counters["hit_lookup_failures"] += 1
        # a slow or unreachable index is expected; anything else is a bug: keep its traceback
        if isinstance(e, DualpathError):
            code, reason = e.code, e.message
        elif isinstance(e, TimeoutError):
            code = ErrorCode.DEADLINE_EXCEEDED
            reason = (f"no answer within scheduler_service.hit_lookup_timeout_s="
                      f"{self.settings.hit_lookup_timeout_s}s")
        else:
            code, reason = "", repr(e)
        self.log.warning("hit_lookup_failed", request_id=sub.request_id,
                         session_id=sub.session_id, keys=len(sub.keys), code=code,
                         reason=reason, hit_tokens=0, exc_info=not code)

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
        for rs in gone:                 # normally their streams' ``finally`` did this already
            self._detach(rs, conn.conn_id)
        if gone:
            self.log.info("frontend_disconnected", conn_id=conn.conn_id, detached=len(gone),
                          grace_s=self.settings.reattach_grace_s)

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
                             self.core.queue_lengths(), by_state,
                             {**self.counters, "epoch": self.epoch},   # fencing epoch
                             self._discovery_status())

    def _discovery_status(self) -> dict[str, str]:
        """etcd mode: every registered key as ``ok`` or ``refused: <reason>``."""
        view = self.discovery
        if view is None:
            return {}
        return {**{k: f"ok {r.role} {r.host}:{r.rpc_port}" for k, r in view.members.items()},
                **{k: f"refused: {why}" for k, why in view.refused.items()}}

    def node_gone(self, node_id: str, service: str, rpc_port: int) -> bool:
        """etcd mode: the node's key vanished (its lease ran out: dead, or cut off from etcd)
        — drop its RPC registration now instead of after the scheduler's own lease; True when
        one was dropped. A registration at another port is a newer process: kept."""
        reg = self.leases.get(node_id, service)
        if reg is None or reg.msg.control_port != rpc_port:
            return False
        self.counters["discovery_gone"] += 1
        self._drop_registration(reg, f"{node_id}/{service} etcd key gone (lease expired)")
        return True

    async def _on_ping(self, msg: Ping, ctx: CallContext) -> Pong:
        return Pong(msg.payload)

    async def _on_stats(self, msg: GetStats, ctx: CallContext) -> GetStatsReply:
        counters = {**self.counters, **self._server.stats(), "requests_live": len(self._reqs),
                    "nodes": len(self.leases)}
        return GetStatsReply(self.name, self.node_id, {k: float(v) for k, v in counters.items()})

    # ------------------------------------------------------------------ shared transitions
    def _after_replan(self, requeued: list[str], failed: list[str], reason: str,
                      code: str) -> None:
        """Mirror the core's re-plans: revoke the old attempt, queue the new one, or fail."""
        for rid in requeued:
            rs = self._reqs.get(rid)
            if rs is None:
                continue
            self._close_attempt(rs, "failed", "scheduler", code, reason)
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
        event = self._with_attempts(rs, state, event)
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
                      hit_lookup_failed=rs.hit_lookup_failed,
                      prompt_tokens=rs.sub.prompt_tokens, **_summary(event))

    def _close_attempt(self, rs: RequestState, outcome: str, hop: str, code: str,
                       message: str, read_bytes: int = 0) -> None:
        """Record how the current attempt ended (once); a failure is counted per hop/code."""
        rec = rs.close_attempt(outcome, hop, code, message, read_bytes)
        if rec is None or outcome != "failed":
            return
        self.counters["attempts_failed"] += 1
        observe_failed_attempt(rec.hop, rec.code)   # dualpath_failed_attempts_total
        self.log.info("attempt_failed", request_id=rs.request_id, attempt=rec.attempt,
                      hop=rec.hop, code=rec.code, stage=rec.stage, read_bytes=rec.read_bytes,
                      reason=rec.message)

    def _with_attempts(self, rs: RequestState, state: State,
                       event: RequestFailed | RequestFinished) -> RequestFailed | RequestFinished:
        """Close the last attempt and put every attempt's record into the final event."""
        if isinstance(event, RequestFinished):
            self._close_attempt(rs, "finished", "", "", "")
        else:
            outcome = "cancelled" if state is State.CANCELLED else "failed"
            self._close_attempt(rs, outcome, "scheduler", event.code, event.message)
        return msgspec.structs.replace(event, attempts=list(rs.attempts),
                                       hit_lookup_failed=rs.hit_lookup_failed,
                                       hit_shortfall_tokens=rs.hit_shortfall_tokens)

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




def _revocation(rs: RequestState, reason: str) -> Revocation:
    return Revocation(rs.request_id, rs.attempt, reason[:300])


def _summary(event: RequestFailed | RequestFinished) -> dict[str, Any]:
    if isinstance(event, RequestFinished):
        return {"tokens": event.tokens, "ttft_ms": round(event.ttft_s * 1e3, 3),
                "e2e_ms": round(event.e2e_s * 1e3, 3)}
    return {"code": event.code, "reason": event.message}
