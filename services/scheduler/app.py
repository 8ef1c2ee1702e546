"""The scheduler's composition root: a typed config in, a running (elected) scheduler out.

* :func:`start_scheduler` — the service and its hit lookup over the storage gateways of the
  shared store (``LookupPrefix``, one gateway per lookup in turn, the next one when one fails:
  :class:`~services.scheduler.shell.gateway_lookup.GatewayHitLookup`); no gateway known (static
  mode): the scheduler's per-session index. What the in-process cluster runs.
* :func:`serve_scheduler` — the whole process. Static mode: that, exported stats and the
  ``/metrics`` endpoint. etcd mode (``[etcd] endpoints``): a :class:`SchedulerReplica` —
  listen as a standby (refusing every call), campaign, serve once elected with the election's
  fencing epoch, watch the node registrations (:func:`watch_cluster`), and when the leader
  lease cannot be kept step down and campaign again (another replica may lead meanwhile).
  docs/cluster.md ("etcd").

Every service here is typed against ``services.config.ServicesConfig``, the scheduler's own
config root.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog

from common.kv import spec_from_config
from common.errors import InternalError
from common.metrics import export_source, scheduler_stats, serve_metrics
from common.protocol.base import PROTOCOL_VERSION
from common.service import Service
from storage_gateway.client import GatewayClient

from services.scheduler.etcd.discovery import NodeRecord
from services.scheduler.etcd.discovery_watch import ClusterView, DiscoveryWatch
from services.scheduler.etcd.election import SchedulerElection
from services.scheduler.shell.gateway_lookup import GatewayHitLookup, PrefixLookupClient
from services.scheduler.shell.service import SchedulerService

# the seam to run a scheduler: what tools (the launcher, the in-process cluster) may use
__all__ = ["GatewayHitLookup", "SchedulerReplica", "SchedulerService", "lookup_client",
           "serve_scheduler", "start_scheduler", "watch_cluster"]

if TYPE_CHECKING:
    from services.config import ServicesConfig

log = structlog.get_logger(__name__)

Gateways = Mapping[str, tuple[str, int]]       # name → RPC address of a storage gateway


def lookup_client(cfg: ServicesConfig, host: str, port: int) -> GatewayClient:
    """A gateway client for the scheduler's hit lookups only: ``lookup_prefix`` is one RPC
    call and never touches the transport or arena the data path needs, so neither is made."""
    return GatewayClient.connect(cfg.rpc, host, port, None,  # type: ignore[arg-type]
                                 None, spec_from_config(cfg.kv), node_id="scheduler")


async def start_scheduler(stack: contextlib.AsyncExitStack, cfg: ServicesConfig,
                          gateways: Gateways | None, *, host: str | None = None,
                          port: int | None = 0, epoch: int | None = None,
                          node_id: str = "scheduler"
                          ) -> tuple[SchedulerService, GatewayHitLookup | None]:
    """A started scheduler and its hit lookup over ``gateways`` (every gateway of the shared
    store); None or empty: the per-session index, and None for the lookup — except in etcd
    mode, where the registered gateways join later."""
    hit_lookup = None
    dynamic = bool(cfg.etcd.endpoints)
    if gateways or dynamic:
        clients: dict[str, PrefixLookupClient] = {
            name: lookup_client(cfg, h, p) for name, (h, p) in (gateways or {}).items()}
        hit_lookup = GatewayHitLookup(clients, cfg.scheduler_service.hit_lookup_timeout_s,
                                      allow_empty=dynamic)
        stack.push_async_callback(hit_lookup.close)
    svc = SchedulerService(cfg, host=host, port=port, hit_lookup=hit_lookup, epoch=epoch,
                           node_id=node_id)
    await stack.enter_async_context(svc)
    return svc, hit_lookup


async def serve_scheduler(stack: contextlib.AsyncExitStack, cfg: ServicesConfig,
                          gateways: Gateways, *, port: int | None = None,
                          replica: str | None = None, metrics_port: int | None = None
                          ) -> tuple[Service, dict[str, Any]]:
    """The scheduler process (a :class:`SchedulerReplica` in etcd mode); its ready-line
    fields. In etcd mode it returns only once first elected, so the ready line means
    "leader"."""
    svc: SchedulerService | SchedulerReplica
    if cfg.etcd.endpoints:
        svc = SchedulerReplica(cfg, gateways, port, replica or f"scheduler-{os.getpid()}")
        await stack.enter_async_context(svc)
        info = {"host": svc.host, "rpc_port": svc.port, "epoch": svc.epoch,
                "replica": svc.node_id}
    else:
        svc, _ = await start_scheduler(stack, cfg, gateways, port=port)
        info = {"host": svc.host, "rpc_port": svc.port}
    export_source(stack, "scheduler", "scheduler", scheduler_stats(svc))
    info["metrics_port"] = await serve_metrics(stack, metrics_port, svc.host or cfg.rpc.host)
    return svc, info


class SchedulerReplica(Service):
    """etcd mode's process: one scheduler replica through every term it wins.

    A term is a fresh standby :class:`SchedulerService` (epoch 0: every call refused) on the
    replica's port, the campaign, the leader's watch of the registrations, and the leader
    lease kept until it is lost. Losing it (etcd says it lapsed, the key is gone, or
    ``etcd.step_down_s`` passed without a renewal) ends the term: that service stops — its
    live requests fail with ``resubmit`` and nodes re-register, as after any failover — and
    the replica campaigns again as a fresh standby. It never exits for a lost lease: when etcd
    stalls longer than the lease, every replica may be deposed in turn, and one leads again as
    soon as etcd answers, with no supervisor restarting anything (ci73: both replicas exited
    and no scheduler led for the front's whole resubmit window). A fresh service per term, not
    a reset one, so nothing a deposed leader held (requests, leases, outboxes, kept results)
    reaches a later term; the fencing epoch of the later term is higher."""

    name = "scheduler"

    def __init__(self, cfg: ServicesConfig, gateways: Gateways, port: int | None,
                 replica: str) -> None:
        super().__init__(replica)
        self.cfg, self.gateways = cfg, dict(gateways)
        self.election = SchedulerElection(cfg.etcd, replica)
        self._port = port                     # None: [scheduler_service] port
        self._term: contextlib.AsyncExitStack | None = None
        self.svc: SchedulerService | None = None      # the current term's service
        self.terms = 0                        # terms won (elections)
        self.step_downs = 0                   # terms ended by a lost lease

    @property
    def host(self) -> str:
        return self._current().host

    @property
    def port(self) -> int:
        return self._current().port

    @property
    def epoch(self) -> int:
        return self._current().epoch

    def _current(self) -> SchedulerService:
        if self.svc is None:
            raise InternalError("the scheduler replica has no term running")
        return self.svc

    def stats(self) -> dict[str, float]:
        """The current term's scheduler stats (its counters start at 0 each term) plus the
        replica's ``terms`` and ``step_downs`` and the term's ``epoch``."""
        out = self.svc.stats() if self.svc is not None else {}
        return {**out, "terms": float(self.terms), "step_downs": float(self.step_downs),
                "epoch": float(self.svc.epoch if self.svc is not None else 0)}

    async def on_start(self) -> None:
        await self.election.check()          # etcd unreachable at start: exit 1 naming it
        await self._campaign(self._port)

    def loops(self):
        return [self._lead]

    async def on_stop(self) -> None:
        await self._end_term()
        await self.election.resign()         # a clean stop hands over at once

    async def _lead(self) -> None:
        """Keep the lease while the term's service runs; a lost lease ends the term and
        starts the next campaign. The service stopping on its own (a fatal loop error) ends
        the replica (exit 1)."""
        while True:
            svc = self._current()
            keep = asyncio.ensure_future(self.election.keep(svc.lease_unconfirmed,
                                                            svc.lease_confirmed))
            stopped = asyncio.ensure_future(svc.wait_stopped())
            try:
                await asyncio.wait((keep, stopped), return_when=asyncio.FIRST_COMPLETED)
            finally:
                keep.cancel()
                stopped.cancel()
            if not keep.done():
                raise InternalError(f"the scheduler stopped on its own (status "
                                    f"{svc.status.value}) while it led epoch {svc.epoch}")
            self.step_downs += 1
            self.log.error("scheduler_stepped_down", epoch=svc.epoch, reason=keep.result(),
                           then="campaigning again as a standby")
            port = svc.port
            await self._end_term()
            await self.election.release()
            await self._campaign(port)

    async def _campaign(self, port: int | None) -> None:
        """A new term: a standby service on ``port`` (the last term's, or any free one when
        another process took it), elected, watching the registrations."""
        term = contextlib.AsyncExitStack()
        try:
            try:
                svc, hit_lookup = await start_scheduler(term, self.cfg, self.gateways,
                                                        port=port, epoch=0,
                                                        node_id=self.node_id)
            except OSError as e:
                if port in (self._port, 0, None):
                    raise
                self.log.warning("scheduler_port_taken", port=port, error=str(e))
                svc, hit_lookup = await start_scheduler(term, self.cfg, self.gateways,
                                                        port=self._port, epoch=0,
                                                        node_id=self.node_id)
            self._term, self.svc = term, svc
            svc.epoch = await self.election.win(svc.host, svc.port)
            await watch_cluster(term, self.cfg, svc, hit_lookup, self.gateways)
        except BaseException:
            await term.aclose()
            self._term = None
            raise
        self.terms += 1

    async def _end_term(self) -> None:
        term, self._term = self._term, None
        if term is not None:
            await term.aclose()


# --------------------------------------------------------------------------- discovery

class _Follower:
    """Applies the registrations to one scheduler: the gateways its hit lookup asks (the
    static ones only while none is registered), node services whose key vanished dropped at
    once."""

    def __init__(self, cfg: ServicesConfig, svc: SchedulerService,
                 hit_lookup: GatewayHitLookup, static: Gateways) -> None:
        self.cfg, self.svc, self.hit_lookup = cfg, svc, hit_lookup
        self.static = dict(static)
        self.addrs: dict[str, tuple[str, int]] = dict(static)
        self.clients: dict[str, PrefixLookupClient] = hit_lookup.clients
        self._closing: set[asyncio.Task] = set()

    def __call__(self, view: ClusterView, gone: list[NodeRecord]) -> None:
        for rec in gone:
            if rec.role != "gateway":
                self.svc.node_gone(rec.node_id, rec.service, rec.rpc_port)
        self._gateways(view.gateways() or self.static)

    def _gateways(self, want: dict[str, tuple[str, int]]) -> None:
        if want == self.addrs:
            return
        clients: dict[str, PrefixLookupClient] = {
            name: (self.clients[name] if self.addrs.get(name) == addr
                   else lookup_client(self.cfg, *addr)) for name, addr in want.items()}
        for old in self.hit_lookup.replace(clients):
            if not isinstance(old, GatewayClient):     # every client here is one of ours
                continue
            task = asyncio.create_task(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.addrs, self.clients = dict(want), clients
        log.info("hit_lookup_gateways", gateways=sorted(want))


async def watch_cluster(stack: contextlib.AsyncExitStack, cfg: ServicesConfig,
                        svc: SchedulerService, hit_lookup: GatewayHitLookup | None,
                        static: Gateways) -> DiscoveryWatch:
    """Start the leader's watch of the registrations (a task, cancelled with the stack);
    returns once its first snapshot is read (or after the etcd dial timeout)."""
    if hit_lookup is None:          # etcd mode always builds one (allow_empty)
        raise ValueError("watch_cluster needs the scheduler's gateway hit lookup")
    view = ClusterView(svc.kv.fingerprint(), PROTOCOL_VERSION)
    watch = DiscoveryWatch(cfg.etcd, view, _Follower(cfg, svc, hit_lookup, static))
    svc.discovery = view
    task = asyncio.create_task(watch.run(), name="discovery-watch")
    stack.push_async_callback(watch.close)
    stack.callback(task.cancel)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(cfg.etcd.dial_timeout_s * len(cfg.etcd.endpoints)):
            await watch.synced.wait()
    return watch
