"""The scheduler service's node channel: registration, heartbeats and work fetches.

Node services are the callers: PE receivers and DE loaders (group leaders), storage gateways,
engine emulators — the sequence is in docs/frontend-api.md ("Node services"). A registration
adds the node's engines to the core and opens its group's outbox; losing it (lease expiry, a
restart, its etcd key gone) removes them, and the core re-plans their requests. A group
leader's fetch applies its telemetry, runs the core's placement for its group and takes the
next reply from the outbox (held while the group is idle and nothing changes: ``longpoll``).
Progress reports are ``progress.ProgressReports``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from common.errors import AlreadyExists, DualpathError, ErrorCode, InvalidArgument, NotFound
from common.kv import KVSpec
from common.protocol import (DecodeBinding, FetchWork, FetchWorkReply, Heartbeat,
                             HeartbeatReply, RegisterNode, RegisterNodeReply, RequestPlaced,
                             RequestPlan)
from common.rpc import CallContext

from ..core.records import Assignment, DEBinding, EngineSpec, Role
from ..core.scheduler import Scheduler
from ..service_config import SchedulerServiceConfig
from .dispatch import Limits, Outbox, Outboxes, leader_telemetry, take_reply
from .gate import Gate
from .leases import ROLES, LeaseTable, Registration, check_registration
from .lifecycle import RequestLifecycle
from .longpoll import WorkSignal, group_idle
from .request_state import RequestState
from .table import RequestTable, loop_now


class NodeChannel:
    """Handlers of the node channel (``common.protocol.NodeRequest``) but progress reports."""

    def __init__(self, core: Scheduler, table: RequestTable, lifecycle: RequestLifecycle,
                 outboxes: Outboxes, leases: LeaseTable, *, settings: SchedulerServiceConfig,
                 kv: KVSpec, gate: Gate, counters: dict[str, int], work: WorkSignal,
                 log: Any) -> None:
        self.core, self.table, self.lifecycle = core, table, lifecycle
        self.outboxes, self.leases = outboxes, leases
        self.settings, self.kv, self.gate = settings, kv, gate
        self.counters, self.work, self.log = counters, work, log
        self._limits = Limits(settings.max_plans_per_fetch, settings.max_bindings_per_fetch,
                              settings.max_revocations_per_fetch,
                              settings.fetch_reply_budget_bytes)

    # ------------------------------------------------------------------ registration
    async def on_register(self, msg: RegisterNode, ctx: CallContext) -> RegisterNodeReply:
        s = self.settings
        self.gate.check_leading()
        check_registration(msg, s.max_id_chars, s.max_engines_per_node)
        now = loop_now()
        old = self.leases.classify(msg, now)
        self._check_kv_tls(msg)
        if old is not None and old.same_incarnation(msg):
            self.leases.renew(old, now)         # a retried registration: nothing changes
            return self._register_reply()
        if old is not None:
            self.drop_registration(old, f"{msg.node_id}/{msg.service} restarted "
                                         f"(epoch {old.epoch} → {msg.epoch})")
        self._add_engines(msg)
        reg = self.leases.add(msg, now)
        if msg.engines:
            self.outboxes.open(msg.role, reg.group_id)
        self.counters["registrations"] += 1
        self.work.kick()
        self.log.info("node_registered", node=msg.node_id, node_service=msg.service,
                      role=msg.role, epoch=msg.epoch, engines=len(msg.engines))
        return self._register_reply()

    def _register_reply(self) -> RegisterNodeReply:
        s = self.settings
        return RegisterNodeReply(s.lease_s, s.heartbeat_s, s.fetch_interval_s,
                                 self.kv.block_tokens, s.fetch_hold_s, self.gate.epoch)

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

    def drop_registration(self, reg: Registration, reason: str) -> None:
        """Forget a node service; its engines leave the core and their requests re-plan."""
        self.leases.remove(reg)
        self.log.warning("node_removed", node=reg.node_id, node_service=reg.msg.service,
                         epoch=reg.epoch, reason=reason, engines=len(reg.engines))
        if not reg.engines:
            return
        self.outboxes.close(reg.role, reg.group_id)
        self.work.kick()
        self._remove_engines([e.engine_id for e in reg.engines], reason)

    def _remove_engines(self, engine_ids: list[str], reason: str) -> tuple[int, int]:
        """Take engines out of the core (those already out are skipped): their requests are
        re-planned (old attempts revoked) or failed past ``max_replans``; (requeued, failed)."""
        requeued: dict[str, None] = {}
        failed: list[str] = []
        for eid in engine_ids:
            try:
                res = self.core.remove_engine(eid)
            except NotFound:
                continue
            requeued.update(dict.fromkeys(res.requeued))
            failed.extend(res.failed)
        for rid in failed:
            requeued.pop(rid, None)
        self.lifecycle.after_replan(list(requeued), failed, reason, ErrorCode.PEER_FAILED)
        return len(requeued), len(failed)

    async def on_heartbeat(self, msg: Heartbeat, ctx: CallContext) -> HeartbeatReply:
        self.gate.check_leading()
        reg = self.leases.live(msg.node_id, msg.service, msg.epoch)
        self.leases.renew(reg, loop_now())
        if msg.read_q_tokens is not None:
            if msg.read_q_tokens < 0:
                raise InvalidArgument(f"read_q_tokens={msg.read_q_tokens} must be >= 0")
            self.core.update_read_queue(msg.node_id, msg.read_q_tokens)
        return HeartbeatReply(self.settings.lease_s)

    async def on_fetch(self, msg: FetchWork, ctx: CallContext) -> FetchWorkReply:
        if msg.role not in ROLES:
            raise InvalidArgument(f"FetchWork.role {msg.role!r} must be one of {ROLES}")
        self.gate.check_leading()
        reg = self.leases.live_leader(msg.node_id, msg.role, msg.epoch)
        if msg.group_id and msg.group_id != reg.group_id:
            raise InvalidArgument(f"{msg.node_id} leads group {reg.group_id!r}, not "
                                  f"{msg.group_id!r}")
        now = loop_now()
        self.leases.renew(reg, now)
        self.counters["fetches"] += 1
        box = self.outboxes[(msg.role, reg.group_id)]
        again = box.resend(msg.ack_seq)
        if again is not None:
            self.counters["fetch_resends"] += 1
            return self.gate.fence(again)
        hold_until = now + min(msg.wait_s, self.settings.fetch_hold_s) \
            if msg.wait_s > 0 and group_idle(msg.engines) else now
        if ctx.deadline is not None:            # answer inside the caller's deadline
            hold_until = min(hold_until, ctx.deadline - 0.1)
        while True:
            telemetry = leader_telemetry(reg, msg, box, self.table.live(), self.core.pe_load)
            self._note_attachment(reg, msg)
            if len(reg.detached) == len(reg.engines):     # no engine of the group to place on
                if telemetry is not None:
                    self.core.apply_telemetry(telemetry)  # its node's read queue still counts
            elif msg.role == Role.PREFILL:
                for a in self.core.on_pe_group_fetch(reg.group_id, telemetry):
                    self._on_assignment(a, box, now)
            else:
                for b in self.core.on_de_group_fetch(reg.group_id, telemetry):
                    self._on_binding(b, box)
            if box:                             # placed something: a binding here may be
                self.work.kick()                # what another held group is waiting for
                break
            left = hold_until - loop_now()
            if left <= 0 or self.gate.closing or ctx.cancelled:
                break
            self.counters["fetch_holds"] += 1
            if not await self.work.wait(left):
                break
            reg = self.leases.live_leader(msg.node_id, msg.role, msg.epoch)  # dropped meanwhile?
            box, now = self.outboxes[(msg.role, reg.group_id)], loop_now()
        return self.gate.fence(take_reply(box, self.table.live(), self._limits,
                                          self._binding_msg, self._plan_msg, self._delivered,
                                          msg.ack_seq is not None))

    def _note_attachment(self, reg: Registration, msg: FetchWork) -> None:
        """An engine its node reports not attached (its process died or has not started)
        leaves the core — what it held re-plans onto the others, nothing new is placed on it —
        and returns when the node reports another attachment of it (docs/engine-api.md, "An
        engine that is not attached"). "Attached" under the number of an attachment known to
        have ended is telemetry from before its end (a fetch held here since, or sent before
        the node's failure report came): it changes nothing. The telemetry was checked: every
        id is one of ``reg``'s."""
        for e in msg.engines:
            reg.attaches[e.engine_id] = max(reg.attaches.get(e.engine_id, 0), e.attaches)
        gone = {e.engine_id: e.attaches for e in msg.engines
                if not e.attached and e.engine_id not in reg.detached}
        back = [e.engine_id for e in msg.engines if e.attached and e.engine_id in reg.detached
                and e.attaches != reg.detached[e.engine_id]]
        for info in reg.engines:
            if info.engine_id in back:
                del reg.detached[info.engine_id]
                self.counters["engines_attached"] += 1
                self.log.info("engine_attached", node=reg.node_id, engine=info.engine_id)
                with contextlib.suppress(AlreadyExists):     # never left: nothing to add
                    self.core.add_engine(EngineSpec(info.engine_id, Role(reg.role),
                                                    reg.node_id,
                                                    hbm_capacity_bytes=info.hbm_capacity_bytes))
        if back:
            self.work.kick()
        if gone:
            self._detach(reg, gone, f"engine {', '.join(gone)} on {reg.node_id} is not "
                                    f"attached to its node")

    def engine_detached(self, node_id: str, engine_id: str, attach_no: int, why: str) -> None:
        """A node's failure report says attachment ``attach_no`` of its engine ``engine_id``
        ended (the engine's process died holding the request): the engine leaves the core
        now, so the request re-plans once, onto another engine — not at the node's next fetch,
        by which a fetch held here could have placed it on the dead engine again (a second
        re-plan of its ``max_replans``). An engine id the node does not lead is ignored, and so
        is the end of an attachment older than one the node's telemetry already reported (the
        engine was back before the report came)."""
        for role in ROLES:
            reg = self.leases.leader(node_id, role)
            if reg is None or engine_id not in {e.engine_id for e in reg.engines}:
                continue
            if reg.attaches.get(engine_id, 0) > attach_no:
                return
            if engine_id in reg.detached:       # out already: remember the later end
                reg.detached[engine_id] = max(reg.detached[engine_id], attach_no)
            else:
                self._detach(reg, {engine_id: attach_no}, f"engine {engine_id} on {node_id} "
                                                          f"detached: {why[:300]}")
            return

    def _detach(self, reg: Registration, gone: dict[str, int], reason: str) -> None:
        """Take ``gone`` (engine id → the ended attachment's number) out of the core: their
        requests re-plan onto the role's other engines."""
        reg.detached.update(gone)
        self.counters["engines_detached"] += len(gone)
        requeued, failed = self._remove_engines(list(gone), reason)
        # an engine that starts after its node is reported detached once: info, not a warning
        (self.log.warning if requeued or failed else self.log.info)(
            "engine_detached", node=reg.node_id, engines=list(gone), requeued=requeued,
            failed=failed)
        self.work.kick()

    def _on_binding(self, b: DEBinding, box: Outbox) -> None:
        rs = self.table.get(b.request_id)
        if rs is None:                          # cannot happen: the core only holds live ones
            self.log.error("binding_for_unknown_request", request_id=b.request_id)
            self.core.cancel(b.request_id)
            return
        rs.de_engine, rs.de_node = b.de_engine, b.de_node
        box.bindings.append((rs.request_id, rs.attempt))

    def _on_assignment(self, a: Assignment, box: Outbox, now: float) -> None:
        rs = self.table.get(a.request_id)
        if rs is None:
            self.log.error("assignment_for_unknown_request", request_id=a.request_id)
            self.core.cancel(a.request_id)
            return
        # a.attempt == rs.attempt: the shell copies the core's count at every re-plan
        rs.assignment, rs.t_placed = a, now
        rs.de_engine, rs.de_node = a.de_engine, a.de_node
        self.work.kick()                        # placed: held fetches look again
        box.plans.append((rs.request_id, rs.attempt))
        rs.events.put_nowait(RequestPlaced(rs.request_id, a.pe_engine, a.pe_node, a.de_engine,
                                           a.de_node, a.read_side.value, a.hit_tokens,
                                           a.attempt, a.split_tokens))

    def _binding_msg(self, rs: RequestState) -> DecodeBinding:
        sub = rs.sub
        return DecodeBinding(rs.request_id, rs.attempt, sub.session_id, rs.de_engine,
                             sub.prompt_tokens, rs.hit_tokens, sub.gen_tokens, rs.hbm_bytes,
                             rs.remaining(loop_now()))

    def _plan_msg(self, rs: RequestState) -> RequestPlan:
        a, sub = rs.assignment, rs.sub
        hit_blocks = rs.hit_tokens // self.kv.block_tokens
        de_loader = self.leases.leader(a.de_node, Role.DECODE)
        gateway = (self.leases.find_service(a.read_node, self.settings.gateway_service)
                   if a.read_node else None)
        # a split read: the DE's node reads the leading part through its own gateway
        split_gw = (self.leases.find_service(a.de_node, self.settings.gateway_service)
                    if a.split_tokens else None)
        return RequestPlan(
            rs.request_id, rs.attempt, sub.session_id, a.pe_engine, a.pe_node, a.de_engine,
            a.de_node, a.read_side.value, a.read_node or "", a.hit_tokens, a.new_tokens,
            a.gen_tokens, rs.hbm_bytes, list(sub.keys[:hit_blocks]), list(sub.keys[hit_blocks:]),
            de_loader.endpoint() if de_loader else None,
            gateway.endpoint() if gateway else None, rs.remaining(loop_now()),
            list(sub.tail_token_ids) if sub.tail_token_ids is not None else None,
            a.split_tokens, split_gw.endpoint() if split_gw else None)

    def _delivered(self, rs: RequestState, kind: str) -> None:
        if kind == "binding":
            rs.de_group = rs.de_node
            self.counters["bindings_sent"] += 1
            return
        rs.pe_group = rs.assignment.pe_node
        rs.t_dispatched = loop_now()
        self.counters["plans_sent"] += 1
        self.work.kick()                        # loading: held fetches look again

    def expire_leases(self, now: float) -> None:
        """Drop every registration whose lease ran out (the service's lease loop)."""
        for reg in self.leases.expired(now):
            try:
                self.counters["leases_expired"] += 1
                self.drop_registration(reg, f"{reg.node_id}/{reg.msg.service} lease expired "
                                            f"(silent for {self.settings.lease_s}s)")
            except Exception:       # one broken registration must not stop the scheduler
                self.log.exception("lease_expiry_failed", node=reg.node_id,
                                   service=reg.msg.service)

    def node_gone(self, node_id: str, service: str, rpc_port: int) -> bool:
        """etcd mode: the node's key vanished (its lease ran out: dead, or cut off from etcd)
        — drop its RPC registration now instead of after the scheduler's own lease; True when
        one was dropped. A registration at another port is a newer process: kept."""
        reg = self.leases.get(node_id, service)
        if reg is None or reg.msg.control_port != rpc_port:
            return False
        self.counters["discovery_gone"] += 1
        self.drop_registration(reg, f"{node_id}/{service} etcd key gone (lease expired)")
        return True


def _tls_set(tls: str) -> frozenset[str]:
    """A UCX transport list as a set ("tcp,sm,self" == "self,tcp,sm")."""
    return frozenset(t.strip() for t in tls.split(",") if t.strip())
