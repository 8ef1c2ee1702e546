"""The live central scheduler: the policy core behind one RPC port for frontends and nodes.

One ``RpcServer`` serves both channels (``common.protocol.SchedulerRequest`` = the frontend
union + the node union + Ping/GetStats): one port to deploy, configure and health-check;
frontends and node services are told apart by what they call, and only a frontend
connection's requests are cancelled when it goes away (node services are judged by leases).

Shell around the sans-I/O :class:`~services.scheduler.core.scheduler.Scheduler` (docs/contributing.md):
every handler validates, then calls the core synchronously (never across an ``await``), so the
core sees one caller. :class:`SchedulerService` is the composition — lifecycle, the RPC
dispatch table and the read-only views (status, stats); the work is done by objects it builds
and hands their collaborators:

* ``table.RequestTable`` — the live requests, their timers and the ended ones' outcomes; a
  request's status is derived from the core's phase plus that outcome;
* ``lifecycle.RequestLifecycle`` — the transitions both channels share (end, re-plan, finish);
* ``frontend_channel.FrontendChannel`` — submit (hit lookup, bounded admission with OVERLOADED
  and a retry hint, deadlines), cancel, disconnects and resubmissions;
* ``node_channel.NodeChannel`` — registrations and leases (``leases.LeaseTable``: expiry or a
  restart removes the node's engines from the core, whose requests are re-planned or failed
  with the reason — never dropped silently), heartbeats, and the pull model: a group leader's
  ``FetchWork`` applies its telemetry and runs the core's fetch for its group; decisions go
  out through that group's ``dispatch.Outbox``;
* ``progress.ProgressReports`` — the stages nodes report.

How a node service drives it, step by step: docs/frontend-api.md ("Node services").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec

from common.auth import load_secret
from common.errors import ErrorCode, NotFound
from common.kv import spec_from_config
from common.protocol import (CancelRequest, ClusterStatus, EngineStatus, FetchWork,
                             GetClusterStatus, GetStats, GetStatsReply, Heartbeat, Ping, Pong,
                             RegisterNode, ReportProgress, SchedulerRequest, SubmitRequest)
from common.rpc import CallContext, RpcServer
from common.service import Service
from services.config import ServicesConfig

from ..core.scheduler import Scheduler, attempt_base
from .dispatch import Outboxes
from .frontend_channel import FrontendChannel
from .gate import STOP_RETRY_AFTER_S, Gate
from .hit_lookup import HitLookup, SessionPrefixIndex
from .leases import LeaseTable
from .lifecycle import RequestLifecycle
from .longpoll import WorkSignal
from .node_channel import NodeChannel
from .progress import ProgressReports
from .recovery import KeptResults
from .request_state import Status
from .stored_prefix import PromisedPrefixes
from .table import RequestTable, loop_now

_UNSET: Any = object()

COUNTERS = ("submitted", "finished", "failed", "cancelled", "deadline_exceeded", "replans",
            "rejected_invalid", "rejected_overload", "registrations", "leases_expired",
            "fetches", "fetch_resends", "fetch_holds", "plans_sent", "bindings_sent",
            "revocations_sent", "hit_lookup_failures", "hit_lookup_retries",
            "hit_lookup_stall_retries", "stale_reports",
            "dropped_reports", "attempts_failed", "resubmits", "detached", "results_kept",
            "results_recovered", "hit_shortfalls", "hit_shortfall_tokens", "discovery_gone",
            "lease_sweeps_stalled", "lease_unconfirmed", "engines_detached", "engines_attached")

# stats() keys the metrics floor (common.metrics) turns into labelled series: live requests per
# status, and the core's planned reads per node and per read side
STATE_PREFIX = "requests_state_"
PLANNED_PREFIX = "read_planned_tokens:"
SIDE_PREFIX = "read_side_tokens:"


class SchedulerService(Service):
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
        self.core = Scheduler(cfg.scheduler, block_tokens=self.kv.block_tokens)
        self.hits: HitLookup = hit_lookup or SessionPrefixIndex(s.max_sessions)
        self.leases = LeaseTable(s.lease_s)
        # This incarnation, told to nodes at registration: a node that sees it change knows
        # the scheduler restarted and redelivers the results it kept (``recovery``). With
        # etcd it is the election's fencing epoch, 0 (standby: every call refused) until won.
        self.gate = Gate(node_id, time.time_ns() if epoch is None else epoch)
        self.core.attempt_base = attempt_base(self.gate.epoch)
        self.kept = KeptResults(s.kept_results, s.kept_result_s)
        self.promised = PromisedPrefixes(s.max_sessions)    # what finished turns stored
        self.table = RequestTable(self.core, s.recent_requests)
        self.outboxes = Outboxes()
        self.work = WorkSignal()            # wakes held (long-poll) fetches: ``longpoll``
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.discovery: Any = None          # etcd mode: the leader's ``ClusterView``
        self._host = host or s.host or cfg.rpc.host
        self._port = s.port if port is None else port
        counters, work, log = self.counters, self.work, self.log
        self.lifecycle = RequestLifecycle(self.core, self.table, self.outboxes, hits=self.hits,
                                          promised=self.promised,
                                          block_tokens=self.kv.block_tokens,
                                          counters=counters, work=work, log=log)
        self.frontends = FrontendChannel(self.core, self.table, self.lifecycle, settings=s,
                                         kv=self.kv, gate=self.gate, hits=self.hits,
                                         promised=self.promised, kept=self.kept,
                                         counters=counters, work=work, log=log)
        self.nodes = NodeChannel(self.core, self.table, self.lifecycle, self.outboxes,
                                 self.leases, settings=s, kv=self.kv, gate=self.gate,
                                 counters=counters, work=work, log=log)
        self.progress = ProgressReports(self.core, self.table, self.lifecycle, gate=self.gate,
                                        kept=self.kept, counters=counters, work=work,
                                        engine_detached=self.nodes.engine_detached)
        self.handlers: dict[type, Any] = {
            SubmitRequest: self.frontends.on_submit, CancelRequest: self.frontends.on_cancel,
            GetClusterStatus: self._on_status, RegisterNode: self.nodes.on_register,
            Heartbeat: self.nodes.on_heartbeat, FetchWork: self.nodes.on_fetch,
            ReportProgress: self.progress.on_progress, Ping: self._on_ping,
            GetStats: self._on_stats,
        }
        secret = load_secret(cfg.rpc) if auth_secret is _UNSET else auth_secret
        self._server = RpcServer(cfg.rpc, service=self.name, node_id=node_id,
                                 handlers=self.handlers, request_type=SchedulerRequest,
                                 kv_fingerprint=self.kv.fingerprint(), auth_secret=secret,
                                 on_disconnect=self.frontends.on_disconnect)

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        return self._server.port

    @property
    def host(self) -> str:
        return self._host

    @property
    def epoch(self) -> int:
        """The fencing epoch (0: a standby); set by the election when this replica wins."""
        return self.gate.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.gate.epoch = value
        self.core.attempt_base = attempt_base(value)

    def lease_unconfirmed(self, reason: str) -> None:
        """etcd mode: the leader lease went a whole lease without renewal. Every call is
        refused (``Gate.check_leading``) and node leases stop running down (their heartbeats
        are refused too) until :meth:`lease_confirmed`."""
        if self.gate.unconfirmed is None:
            self.counters["lease_unconfirmed"] += 1
            self.log.warning("leader_lease_unconfirmed", epoch=self.epoch, reason=reason)
        self.gate.unconfirmed = reason

    def lease_confirmed(self, unconfirmed_s: float) -> None:
        """etcd renewed the lease again (it never lapsed, so no other replica led meanwhile):
        serve on with the same epoch (node leases stood still meanwhile: ``_lease_loop``)."""
        if self.gate.unconfirmed is None:
            return
        self.gate.unconfirmed = None
        self.work.kick()
        self.log.warning("leader_lease_confirmed", epoch=self.epoch,
                         unconfirmed_s=round(unconfirmed_s, 3))

    @property
    def active_requests(self) -> int:
        return len(self.table)

    def request_state(self, request_id: str) -> Status | None:
        """A live request's status (``queued`` … ``decoding``); None when none has this id."""
        return self.table.status_of(request_id)

    def node_gone(self, node_id: str, service: str, rpc_port: int) -> bool:
        """etcd mode: a node's key vanished (``NodeChannel.node_gone``)."""
        return self.nodes.node_gone(node_id, service, rpc_port)

    async def on_start(self) -> None:
        await self._server.start(self._host, self._port)
        self.log.info("scheduler_listening", host=self._host, port=self.port,
                      policy=self.core.config.policy, alpha=self.core.alpha, beta=self.core.beta)

    def loops(self):
        return [self._lease_loop]

    async def on_stop(self) -> None:
        self.gate.closing = True
        self.work.kick()
        for rs in self.table:
            event = rs.failed_event(ErrorCode.UNAVAILABLE, "the scheduler is shutting down", True,
                                    STOP_RETRY_AFTER_S)
            self.lifecycle.end(rs, Status.FAILED, msgspec.structs.replace(event, resubmit=True))
        await self._server.stop(grace_s=self.settings.drain_grace_s)

    async def _lease_loop(self) -> None:
        """Sweep the leases every ``lease_check_s``.

        A sweep that wakes later than one period past its due time means this process did not
        run meanwhile (a GC pause, CPU starvation, a stopped VM, or — in an in-process cluster
        — a node sharing this loop that held it): the nodes' heartbeats may sit unread in its
        sockets, so that stall is not held against them. Every lease is extended by it
        (``LeaseTable.extend``) before the sweep, counted in ``lease_sweeps_stalled`` and, past
        a second, logged: a node silent for ``lease_s`` of *this scheduler's running time* is
        dropped, never every node at once because the scheduler itself stood still."""
        period = self.settings.lease_check_s
        due = loop_now() + period
        while True:
            await asyncio.sleep(max(0.0, due - loop_now()))
            now = loop_now()
            if self.gate.unconfirmed is not None:   # heartbeats refused: nobody runs down
                self.leases.extend(now - due + period)
                due = now + period
                continue
            stalled = now - due
            if stalled > period:
                self.leases.extend(stalled)
                self.counters["lease_sweeps_stalled"] += 1
                if stalled > 1.0:
                    self.log.warning("scheduler_loop_stalled", stalled_s=round(stalled, 3),
                                     leases_extended=len(self.leases))
            self.nodes.expire_leases(now)
            due = now + period

    # ------------------------------------------------------------------ views
    def stats(self) -> dict[str, float]:
        """Counters, live requests (in all and per status), nodes, and the core's planned reads
        (cumulative hit tokens per node and per read side) — what the metrics floor exports."""
        out = {k: float(v) for k, v in self.counters.items()}
        for status, n in self.table.by_status(zeros=True).items():
            out[f"{STATE_PREFIX}{status.value}"] = float(n)
        out["requests_live"] = float(len(self.table))
        out["nodes"] = float(len(self.leases))
        out.update({f"rpc_{k}": float(v) for k, v in self._server.stats().items()})
        out.update({f"{PLANNED_PREFIX}{node}": float(v)
                    for node, v in self.core.read_planned().items()})
        out.update({f"{SIDE_PREFIX}{side}": float(v)
                    for side, v in self.core.read_side_tokens.items()})
        return out

    async def _on_status(self, msg: GetClusterStatus, ctx: CallContext) -> ClusterStatus:
        now = loop_now()
        nodes = [reg.status(now) for reg in self.leases]
        where = {e.engine_id: (reg.node_id, reg.role) for reg in self.leases for e in reg.engines}
        engines = [EngineStatus(r.engine_id, *where.get(r.engine_id, ("", "")), r.seq, r.tok,
                                r.free_hbm_bytes) for r in self.core.engine_reports()]
        engines += [EngineStatus(eid, reg.node_id, reg.role, 0, 0, attached=False)
                    for reg in self.leases for eid in sorted(reg.detached)]
        read_q = {}
        for reg in self.leases:
            if reg.engines and reg.node_id not in read_q:
                with contextlib.suppress(NotFound):   # every engine of the node detached
                    read_q[reg.node_id] = self.core.read_queue(reg.node_id)
        by_state = {s.value: n for s, n in self.table.by_status().items()}  # ended: counters
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

    async def _on_ping(self, msg: Ping, ctx: CallContext) -> Pong:
        return Pong(msg.payload)

    async def _on_stats(self, msg: GetStats, ctx: CallContext) -> GetStatsReply:
        counters = {**self.counters, **self._server.stats(), "requests_live": len(self.table),
                    "nodes": len(self.leases)}
        return GetStatsReply(self.name, self.node_id, {k: float(v) for k, v in counters.items()})
