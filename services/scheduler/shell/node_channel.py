"""The scheduler service's node channel: registration, heartbeats, work fetches and progress.

A layer of :class:`~services.scheduler.service.SchedulerService` (whose module doc describes
the shell); the frontend channel, the lifecycle and the transitions both channels share
(``_end``, ``_after_replan``, ``_revoke``, ``_set_state``) stay there. Node services are the
callers: PE receivers and DE loaders (group leaders), storage gateways, engine emulators —
the sequence is in docs/frontend-api.md ("Node services").
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from common.errors import DualpathError, ErrorCode, InvalidArgument, NotFound, Unavailable
from common.kv import ROOT_KEY, KVSpec, block_keys_from_tokens
from common.protocol import (DecodeBinding, FetchWork, FetchWorkReply, Heartbeat,
                             HeartbeatReply, RegisterNode, RegisterNodeReply, ReportProgress,
                             ReportProgressReply, RequestFailed, RequestFinished, RequestPlaced,
                             RequestPlan)
from common.rpc import CallContext

from .core import Scheduler
from .dispatch import Limits, Outbox, leader_telemetry, take_reply
from .hit_lookup import HitLookup
from .leases import ROLES, LeaseTable, Registration, check_registration
from .longpoll import WorkSignal, group_idle
from .records import Assignment, DEBinding, EngineSpec, Role
from .recovery import KeptResults
from .stored_prefix import PromisedPrefixes
from .request_state import RequestState, State
from .service_config import SchedulerServiceConfig

StageHandler = Callable[[RequestState, ReportProgress, float], None]


class NodeChannel:
    """Handlers of the node channel (``common.protocol.NodeRequest``), mixed into the service.

    The state is the service's (set in ``SchedulerService.__init__``), declared here so the
    handlers are checked against it.
    """

    settings: SchedulerServiceConfig
    kv: KVSpec
    core: Scheduler
    hits: HitLookup
    leases: LeaseTable
    work: WorkSignal
    counters: dict[str, int]
    log: Any
    _reqs: dict[str, RequestState]
    _recent: OrderedDict[str, str]
    _outboxes: dict[tuple[str, str], Outbox]
    _states: Counter[State]
    _limits: Limits
    _closing: bool
    _stages: dict[str, StageHandler]
    epoch: int
    kept: KeptResults
    promised: PromisedPrefixes

    if TYPE_CHECKING:   # the service's shared transitions
        @staticmethod
        def _now() -> float: ...
        def _after_replan(self, requeued: list[str], failed: list[str], reason: str,
                          code: str) -> None: ...
        def _end(self, rs: RequestState, state: State,
                 event: RequestFailed | RequestFinished) -> None: ...
        def _set_state(self, rs: RequestState, state: State) -> None: ...
        def _revoke(self, rs: RequestState, reason: str) -> None: ...
        def _close_attempt(self, rs: RequestState, outcome: str, hop: str, code: str,
                           message: str, read_bytes: int = 0) -> None: ...

    # ------------------------------------------------------------------ node channel
    def _check_leading(self) -> None:
        """A standby replica (epoch 0 until it wins the election) serves nobody."""
        if not self.epoch:
            raise Unavailable(f"scheduler {getattr(self, 'node_id', '')} is a standby, not the "
                              f"leader: resolve the leader again (etcd)", retry_after_s=0.2)

    async def _on_register(self, msg: RegisterNode, ctx: CallContext) -> RegisterNodeReply:
        s = self.settings
        self._check_leading()
        check_registration(msg, s.max_id_chars, s.max_engines_per_node)
        now = self._now()
        old = self.leases.classify(msg, now)
        self._check_kv_tls(msg)
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
                                 self.kv.block_tokens, s.fetch_hold_s, self.epoch)

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

    def _check_kv_tls(self, msg: RegisterNode) -> None:
        """Refuse a node whose KV transport list differs from a live node's: hosts with no
        transport in common cannot move KV between them (issue #17, docs/deploy.md)."""
        mine = _tls_set(msg.kv_tls)
        for reg in self.leases:
            theirs = _tls_set(reg.msg.kv_tls)
            if mine and theirs and reg.node_id != msg.node_id and mine != theirs:
                raise InvalidArgument(
                    f"{msg.node_id}/{msg.service}: KV transports {msg.kv_tls!r} differ from "
                    f"{reg.node_id}'s {reg.msg.kv_tls!r}: give every host the same UCX_TLS "
                    f"list ([transport.traffic_classes.kv.options] TLS)")

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
        self._check_leading()
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
        self._check_leading()
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
            return self._fenced(again)
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
        return self._fenced(take_reply(box, self._reqs, self._limits, self._binding_msg,
                                       self._plan_msg, self._delivered, msg.ack_seq is not None))

    def _fenced(self, reply: FetchWorkReply) -> FetchWorkReply:
        """Stamp the epoch: a node refuses plans from below the highest epoch it has seen."""
        return msgspec.structs.replace(reply, scheduler_epoch=self.epoch)

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
    def _stage_handlers(self) -> dict[str, StageHandler]:
        """``ReportProgress.stage`` → its transition (every ``common.protocol.Stage``)."""
        return {"allocated": self._st_allocated, "read_done": self._st_read_done,
                "prefill_done": self._st_prefill_done, "first_token": self._st_first,
                "second_token": self._st_second, "finished": self._st_finished,
                "failed": self._st_failed}

    async def _on_progress(self, msg: ReportProgress, ctx: CallContext) -> ReportProgressReply:
        stage = self._stages.get(msg.stage)
        if stage is None:
            raise InvalidArgument(f"unknown stage {msg.stage[:40]!r}; one of {list(self._stages)}")
        if msg.tokens < 0:
            raise InvalidArgument(f"tokens={msg.tokens} must be >= 0")
        self._check_leading()
        if msg.scheduler_epoch not in (0, self.epoch):
            return self._earlier_report(msg)
        rs = self._reqs.get(msg.request_id)
        if rs is None or rs.attempt != msg.attempt or not rs.in_core:
            self.counters["stale_reports"] += 1
            if rs is not None and msg.stage == "failed":
                rs.late_failure(msg.attempt, msg.read_bytes)
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

    def _earlier_report(self, msg: ReportProgress) -> ReportProgressReply:
        """A report of an attempt an earlier scheduler planned (redelivered after a restart).

        Only a ``finished`` one is of use: it ends the live request it belongs to (whatever
        attempt this scheduler runs for it is revoked) or waits in ``kept`` for the frontend's
        resubmission. Anything else is stale: the node drops the attempt.
        """
        rs = self._reqs.get(msg.request_id)
        if msg.stage != "finished" or msg.scheduler_epoch > self.epoch:
            self.counters["stale_reports"] += 1
            return ReportProgressReply(False, rs.state.value if rs is not None else "unknown")
        if rs is not None and not rs.terminal:
            self._finish_kept(rs, msg, "redelivered by its node")
            return ReportProgressReply(True, State.FINISHED.value)
        if rs is None and msg.request_id not in self._recent:
            self.kept.put(msg, self._now())
            self.counters["results_kept"] += 1
            return ReportProgressReply(True, "kept")
        return ReportProgressReply(False, self._recent.get(msg.request_id, "unknown"))

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
        stored = _stored_keys(rs.sub, msg.output_token_ids, self.kv.block_tokens)
        self.hits.finished(rs.sub.session_id, stored)
        self.promised.finished(rs.sub.session_id, stored)
        self.counters["finished"] += 1
        self._end(rs, State.FINISHED, rs.finished_event(msg.tokens, now, msg.output_token_ids))

    def _finish_kept(self, rs: RequestState, kept: ReportProgress, why: str) -> None:
        """End ``rs`` with a result a node finished under an earlier scheduler (not redone)."""
        if rs.in_core:
            self.core.cancel(rs.request_id)
            rs.in_core = False
        self._revoke(rs, f"finished under an earlier scheduler ({why})")
        self.counters["results_recovered"] += 1
        stored = _stored_keys(rs.sub, kept.output_token_ids, self.kv.block_tokens)
        self.hits.finished(rs.sub.session_id, stored)
        self.promised.finished(rs.sub.session_id, stored)
        self.log.info("result_recovered", request_id=rs.request_id, attempt=kept.attempt,
                      node=kept.node_id, scheduler_epoch=kept.scheduler_epoch, why=why)
        self._end(rs, State.FINISHED, rs.finished_event(kept.tokens, self._now(),
                                                        kept.output_token_ids))

    def _st_failed(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        code = msg.code if msg.code in ErrorCode.__members__ else ErrorCode.INTERNAL.value
        where = (msg.hop[:80] or "node") + (f" on {msg.node_id[:80]}" if msg.node_id else "")
        reason = f"{where} failed attempt {rs.attempt}: {code}: {msg.message[:500]}"
        self._close_attempt(rs, "failed", msg.hop or "node", code, msg.message,
                            msg.read_bytes)
        if not msg.retryable:
            self._end(rs, State.FAILED, rs.failed_event(code, reason, False))
            return
        res = self.core.fail(rs.request_id)
        self._after_replan(list(res.requeued), list(res.failed), reason, code)


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


def _tls_set(tls: str) -> frozenset[str]:
    """A UCX transport list as a set ("tcp,sm,self" == "self,tcp,sm")."""
    return frozenset(t.strip() for t in tls.split(",") if t.strip())
