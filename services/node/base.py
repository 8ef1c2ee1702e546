"""What a PE receiver and a DE loader share: the node's buffer, transport, arbiter, gateway
clients, its registration with the scheduler (group leader of its engines) and progress reports.

A node service runs with a scheduler (``scheduler_port`` set: register, heartbeat, pull work
with ``FetchWork``, report stages) or standalone (work is handed in by ``submit_plan`` /
``bind``; reports are kept in ``self.reports``) — the second is what tests and benchmarks of
the data path alone use.

Scheduler restarts: every report carries the epoch of the scheduler the node is registered
with, and ``finished`` reports stay in ``self.finished`` for ``finished_keep_s``. When the node
re-registers and finds another scheduler incarnation, it drops its in-flight attempts (their
frontends resubmit them) and redelivers the kept results, so an attempt that finished while
no scheduler listened is not redone (docs/frontend-api.md, "Scheduler restart").

Attempts get the node's I/O (:class:`~services.node.io.NodeIO`: transport, regions, arbiter,
gateways, reports), never the service; the service registers them and runs their tasks.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Iterable
from typing import Any, TYPE_CHECKING

import msgspec
import structlog

from common.auth import load_secret
from common.buffers import PagePool, is_device_array
from common.errors import DualpathError, InvalidArgument
from common.kv import KVSpec, spec_from_config
from common.protocol import (Stage, EngineInfo, EngineLoad, FetchWorkReply, GetStats,
                             GetStatsReply, Ping, Pong, ReportProgress, Revocation)
from common.rpc import CallContext, RpcServer
from common.service import Service
from common.transport import PageTransport
from services.node.arbiter import EgressArbiter
from services.engine_api.collectives import Collectives
from services.engine_api.kv_region import RegionPool
from services.engine_api.server import EngineApiServer
from services.scheduler.client.node_client import NodeSession

from .config import NodeServiceConfig
from .gateway import NodeGateways
from .io import NodeIO

if TYPE_CHECKING:
    from services.config import ServicesConfig

log = structlog.get_logger(__name__)

_REPORT_KEEP = 10_000
_FAILED_KEEP = 4_096


class NodeBase(Service):
    """Base of the PE receiver and the DE loader (see the module docstring)."""

    name = "node"
    role = ""
    request_union: Any = None
    ports: dict[str, Any]                            # engine id → PrefillPort / DecodePort
    attempts: dict[tuple[str, int], Any]             # (request id, attempt) → live attempt

    def __init__(self, cfg: ServicesConfig, node_id: str, settings: NodeServiceConfig, *,
                 spec: KVSpec | None = None, engines: int | None = None,
                 pool_name: str = "buffer") -> None:
        super().__init__(node_id, drain_timeout_s=1.0)
        self.cfg, self.settings = cfg, settings
        self.spec = spec or spec_from_config(cfg.kv)
        n = settings.engines if engines is None else engines
        if n <= 0:
            raise InvalidArgument(f"a node needs at least one engine, got {n}")
        self.engine_ids = [f"{node_id}.e{i}" for i in range(n)]
        shm = (cfg.gateway.shm and bool(settings.gateway_port)) or bool(settings.engine_socket) \
            or cfg.transport.same_host == "shm"
        self.pool = PagePool(settings.page_bytes, settings.num_pages, settings.device, pool_name,
                             shm=shm)  # same-host reads and transfers, engines in other processes
        self.regions = RegionPool(self.pool)
        self.arbiter = EgressArbiter(cfg.arbiter)
        # engines' announced collectives hold the arbiter's KV cap (the ports get this)
        self.collectives = Collectives(self.arbiter, cfg.arbiter.collective_max_s)
        self.transport: PageTransport | None = None
        self.rpc: RpcServer | None = None
        self.session: NodeSession | None = None
        self.read_q: int | None = None
        self.reports: collections.deque[ReportProgress] = collections.deque(maxlen=_REPORT_KEEP)
        # finished reports (and when), for redelivery to a restarted scheduler
        self.finished: collections.OrderedDict[tuple[str, int], tuple[ReportProgress, float]] = \
            collections.OrderedDict()
        # scheduler epoch each attempt was planned under: its reports carry it (fencing)
        self.planned_under: collections.OrderedDict[tuple[str, int], int] = \
            collections.OrderedDict()
        # requests whose last attempt here failed (id -> reason), for engine claims: a claim of
        # one with no live attempt is answered at once instead of waiting out its timeout
        self.failed_ids: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.counters: collections.Counter[str] = collections.Counter()
        self.gateways: NodeGateways | None = None       # once started (they use the transport)
        self.io: NodeIO | None = None                   # what attempts get (once started)
        self._closing = False
        self.extra_stats = None           # () -> dict: e.g. the attached engines' counters
        self.engine_api: EngineApiServer | None = None    # engines in other processes
        self._orphans_logged: list[str] = []    # owners of the leaked pages last warned of

    # ------------------------------------------------------------------ lifecycle
    async def on_start(self) -> None:
        s = self.settings
        # a pool on the GPU sends device memory: peers' device arenas take it directly
        self.transport = PageTransport(self.cfg.transport, self.node_id, shm_arena=self.pool.arena,
                                       device_sources=is_device_array(self.pool.arena))
        await self.transport.start()
        self.gateways = NodeGateways(
            self.cfg.rpc, self.transport, self.pool.arena, self.spec, node_id=self.node_id,
            role=self.name, local=(s.gateway_host, s.gateway_port) if s.gateway_port else None,
            on_local_read_q=self._note_read_q)
        self.io = NodeIO(self.spec, s, self.transport, self.regions, self.arbiter,
                         self.gateways, self.counters, report=self.report,
                         supervise=self.requests.spawn, ended=self._forget)
        self.rpc = RpcServer(self.cfg.rpc, service=self.name, node_id=self.node_id,
                             handlers=self.handlers(), request_type=self.request_union,
                             kv_fingerprint=self.spec.fingerprint(),
                             auth_secret=load_secret(self.cfg.rpc))
        await self.rpc.start(s.host, s.rpc_port)
        if s.engine_socket:
            await self._serve_engines(s.engine_socket)
        etcd = getattr(self.cfg, "etcd", None)
        resolve = None
        if etcd is not None and etcd.endpoints:     # the scheduler leader, found in etcd
            from services.scheduler.client.leader import LeaderResolver
            resolve = LeaderResolver(etcd)
        if s.scheduler_port or resolve is not None:
            infos = [EngineInfo(e, self.role, self.engine_hbm()) for e in self.engine_ids]
            self.session = NodeSession(
                self.cfg.rpc, s.scheduler_host, s.scheduler_port, node_id=self.node_id,
                service=self.name, role=self.role, control=(s.host, self.rpc.port),
                ucx=self.transport.address, engines=infos,
                kv_fingerprint=self.spec.fingerprint(), auth_secret=load_secret(self.cfg.rpc),
                on_lease_lost=self._on_lease_lost, on_scheduler_changed=self._redeliver,
                resolve=resolve, kv_tls=self._kv_tls())
            await self.session.start()
        self.log.info("node_service_listening", rpc_port=self.rpc.port,
                      ucx_port=self.transport.address[1], engines=len(self.engine_ids),
                      buffer_bytes=self.pool.arena.nbytes, kv=self.spec.describe(),
                      scheduler=bool(self.session))

    def _kv_tls(self) -> str:
        """The KV class's UCX transport list as UCX will use it (``UCX_TLS`` wins)."""
        kv = self.cfg.transport.traffic_classes.get("kv")
        return os.environ.get("UCX_TLS", kv.options.get("TLS", "") if kv else "")

    async def _serve_engines(self, path: str) -> None:
        """Serve this node's engine ports on a Unix socket (docs/engine-api.md)."""
        shm = self.pool.shm
        self.engine_api = EngineApiServer(
            self.cfg.rpc, node_id=self.node_id, role=self.role, spec=self.spec,
            ports=self.ports, arena=self.pool.arena, arena_name=shm.name if shm else None,
            owner_of=self._engine_of, failure_of=self._failure_of, abandon=self._abandon,
            allowed_uids=self.settings.engine_socket_uids,
            silence_s=self.settings.engine_silence_s, stuck_s=self.settings.engine_stuck_s)
        await self.engine_api.start(path)

    def _forget(self, key: tuple[str, int], attempt: object) -> None:
        """An attempt ended: drop it from :attr:`attempts` (if it is still the one held)."""
        if self.attempts.get(key) is attempt:
            del self.attempts[key]

    def orphaned_pages(self) -> int:
        """Pages of the buffer that no attempt held here owns: leaked, since nothing will
        ever free them. Every allocation names its attempt ("request#attempt"; a generated
        block "request#attempt/gen") and an attempt frees all it holds before it is
        forgotten, so a live allocation without its attempt is a bug — warned of (with its
        owners) whenever the set changes, and the ``pages_orphaned`` gauge an operator can
        alert on."""
        live = {f"{rid}#{n}" for rid, n in self.attempts}
        lost = [a for a in self.pool.live_allocations()
                if a.owner not in live and a.owner.rsplit("/", 1)[0] not in live]
        owners = sorted({a.owner for a in lost})
        pages = sum(a.n_pages for a in lost)
        if owners != self._orphans_logged:
            self._orphans_logged = owners
            if owners:
                log.warning("pages_orphaned", pages=pages, owners=owners[:8],
                            allocations=len(lost))
        return pages

    def _engine_of(self, request_id: str) -> str | None:
        """The engine a live attempt of ``request_id`` is assigned to (None: none here)."""
        for (rid, _), att in self.attempts.items():
            if rid == request_id and not getattr(att, "done", False):
                return att.engine_id
        return None

    def _abandon(self, request_id: str, engine_id: str, err: DualpathError,
                 attempt: int | None = None) -> bool:
        """Engine ``engine_id`` will not claim ``request_id`` (its attempt ``attempt``, when
        given): fail its live attempts of it now (each reports ``failed``, retryable), so the
        scheduler re-plans at once."""
        found = False
        for (rid, number), att in list(self.attempts.items()):
            if rid == request_id and att.engine_id == engine_id and not att.dropped() and (
                    attempt is None or number == attempt):
                self.counters["attempts_abandoned_by_engine"] += 1
                att.engine_gave_up(err)
                found = True
        return found

    def loops(self):
        out = []
        if self.session is not None:
            out.append(self._fetch_loop)
        if self.settings.gateway_port:
            out.append(self._read_q_loop)
        return out

    async def stop(self) -> None:
        self._closing = True
        if self.status.value == "running":
            await self.drop_all("service stopping")
        await super().stop()

    async def on_stop(self) -> None:
        if self.engine_api is not None:
            await self.engine_api.stop()
        if self.session is not None:
            await self.session.close()
        if self.rpc is not None:
            await self.rpc.stop(grace_s=0.5)
        if self.gateways is not None:
            await self.gateways.close()
        if self.transport is not None:
            await self.transport.stop()
        self.pool.close()                 # unlinks its /dev/shm segment, if any

    @property
    def rpc_port(self) -> int:
        return self.rpc.port

    @property
    def ucx_address(self) -> tuple[str, int]:
        return self.transport.address

    def buffer_room(self, pending_prompt_tokens: Iterable[int]) -> int:
        """The node buffer's free bytes less the pages of prompts taken on and not allocated
        yet (each of ``pending_prompt_tokens`` a prompt's token count): the room a node
        reports to the scheduler for buffer admission (docs/datapath.md "Buffer admission in
        the scheduler")."""
        per_token = self.spec.bytes_per_token
        pending = sum(self.pool.pages_for(n * per_token) for n in pending_prompt_tokens)
        return max(self.pool.free_pages - pending, 0) * self.pool.page_bytes

    # ------------------------------------------------------------------ to override
    def handlers(self) -> dict[type, Any]:
        return {Ping: self._ping, GetStats: self._stats}

    def engine_hbm(self) -> int:
        return 0

    def engine_loads(self) -> list[EngineLoad]:
        return []

    async def apply(self, reply: FetchWorkReply) -> None:
        """Work pulled from the scheduler (revocations were applied already)."""

    def revoke(self, r: Revocation) -> None:
        """Drop one attempt (scheduler revocation)."""

    async def drop_all(self, reason: str) -> None:
        """Drop every attempt (lease lost, stopping)."""

    def node_counters(self) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------------ scheduler
    async def _fetch_loop(self) -> None:
        s = self.session
        while True:
            try:
                reply = await s.fetch(self._reported_loads(), self.read_q)
            except asyncio.CancelledError:
                raise
            except DualpathError as e:
                log.warning("fetch_failed", node=self.node_id, error=repr(e))
                await asyncio.sleep(max(s.fetch_interval_s, 0.1))
                continue
            for r in reply.revoked:
                self.revoke(r)
            self._note_epoch(reply, s.scheduler_epoch)
            await self.apply(reply)
            if not reply.more:
                await asyncio.sleep(s.fetch_interval_s)

    def _reported_loads(self) -> list[EngineLoad]:
        """The engines' loads as the scheduler gets them. Behind an engine socket an engine
        whose process is not attached (died, or not started yet) is reported so: the scheduler
        re-plans what it held and places nothing on it until it attaches again."""
        loads = self.engine_loads()
        api = self.engine_api
        if api is None:
            return loads
        return [msgspec.structs.replace(load, attached=load.engine_id in api.sessions,
                                        attaches=api.attach_counts[load.engine_id])
                for load in loads]

    async def _on_lease_lost(self) -> None:
        await self.drop_all("scheduler lease lost (the scheduler re-planned our work)")

    def _failure_of(self, request_id: str) -> str | None:
        """Why ``request_id`` failed here, if its last attempt did and none is live now."""
        why = self.failed_ids.get(request_id)
        return why if why is not None and self._engine_of(request_id) is None else None

    async def report(self, request_id: str, attempt: int, stage: Stage, **kw: Any) -> bool:
        """Report a stage; False when the scheduler says the attempt is no longer current."""
        self.counters[f"reported_{stage}"] += 1
        if stage == "failed":
            self.failed_ids[request_id] = str(kw.get("message", ""))[:200]
            self.failed_ids.move_to_end(request_id)
            while len(self.failed_ids) > _FAILED_KEEP:
                self.failed_ids.popitem(last=False)
        if self.session is None:
            self.reports.append(ReportProgress(request_id, attempt, stage, node_id=self.node_id,
                                               **kw))
            return True
        epoch = self.planned_under.get((request_id, attempt), self.session.scheduler_epoch)
        msg = ReportProgress(request_id, attempt, stage, node_id=self.node_id,
                             scheduler_epoch=epoch, **kw)
        if stage == "finished":
            self._keep_finished(msg)
        try:
            reply = await self.session.send_report(msg)
        except DualpathError as e:
            log.warning("report_failed", request_id=request_id, attempt=attempt, stage=stage,
                        error=repr(e))
            return True        # unknown: carry on; leases and revocations settle it
        return reply.current

    def _note_epoch(self, reply: FetchWorkReply, epoch: int) -> None:
        """Remember which scheduler planned each attempt (bounded, oldest out first)."""
        marks = self.planned_under
        for work in (*reply.plans, *reply.bindings):
            marks[(work.request_id, work.attempt)] = epoch
        while len(marks) > _REPORT_KEEP:
            marks.popitem(last=False)

    def _keep_finished(self, msg: ReportProgress) -> None:
        """Keep a result for ``finished_keep_s`` (bounded), should the scheduler restart."""
        now = asyncio.get_running_loop().time()
        kept = self.finished
        kept[(msg.request_id, msg.attempt)] = (msg, now)
        while kept and (len(kept) > _REPORT_KEEP or
                        next(iter(kept.values()))[1] < now - self.settings.finished_keep_s):
            kept.popitem(last=False)

    async def _redeliver(self, old_epoch: int) -> None:
        """The scheduler restarted: hand it the results its predecessor may not have passed
        on (it keeps them for the frontends' resubmissions; duplicates are harmless)."""
        sent = 0
        for msg, _ in list(self.finished.values()):
            if msg.scheduler_epoch != old_epoch or not old_epoch or self.session is None:
                continue
            try:
                await self.session.send_report(msg)
                sent += 1
            except DualpathError as e:
                log.warning("result_redelivery_failed", request_id=msg.request_id,
                            attempt=msg.attempt, error=repr(e))
        self.counters["results_redelivered"] += sent
        log.info("results_redelivered", node=self.node_id, node_service=self.name,
                 results=sent, old_epoch=old_epoch)

    def _note_read_q(self, tokens: int) -> None:
        """The local gateway's read queue as a read reply stated it (newer than any telemetry
        sample received before it). Only while the telemetry watch runs: without it the node
        sends no read queue (None) and the scheduler keeps its own count."""
        if self.read_q is not None:
            self.read_q = tokens

    async def _read_q_loop(self) -> None:
        """Follow this node's gateway read queue (sent with each FetchWork)."""
        client = self.gateways.local()
        interval = self.settings.telemetry_interval_s
        while True:
            try:
                async for t in client.watch_telemetry(interval):
                    self.read_q = t.read_q_tokens
            except asyncio.CancelledError:
                raise
            except DualpathError as e:
                log.debug("gateway_telemetry_lost", error=repr(e))
            self.read_q = None
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ admin
    async def _ping(self, msg: Ping, ctx: CallContext) -> Pong:
        return Pong(msg.payload)

    async def _stats(self, msg: GetStats, ctx: CallContext) -> GetStatsReply:
        return GetStatsReply(self.name, self.node_id, self.stats())

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.pool.counters().items()}
        out.update({f"transport_{k}": v for k, v in self.transport.stats().items()})
        out.update(self.arbiter.stats())
        out.update(self.collectives.stats())
        out.update({k: float(v) for k, v in self.counters.items()})
        out.update(self.node_counters())
        if self.session is not None:      # heartbeats delayed, and by what (NodeSession.stats)
            out.update(self.session.stats())
        if self.engine_api is not None:
            out.update({f"engine_api_{k}": v for k, v in self.engine_api.stats().items()})
            out.update({f"engine_{k}": v for k, v in self.engine_api.engine_counters().items()})
        if self.extra_stats is not None:
            out.update({f"engine_{k}": float(v) for k, v in self.extra_stats().items()})
        out.update({f"rpc_{k}": float(v) for k, v in self.rpc.stats().items()})
        out.update(rpc_port=float(self.rpc.port), ucx_port=float(self.transport.address[1]),
                   regions_live=float(self.regions.live),
                   pages_orphaned=float(self.orphaned_pages()))
        return out
