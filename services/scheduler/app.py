"""The scheduler's composition root: a typed config in, a running (elected) scheduler out.

* :func:`start_scheduler` — the service and its hit lookup over the storage gateways of the
  shared store (``LookupPrefix``, one gateway per lookup in turn, the next one when one fails:
  :class:`~services.scheduler.shell.gateway_lookup.GatewayHitLookup`); no gateway known (static
  mode): the scheduler's per-session index. What the in-process cluster runs.
* :func:`serve_scheduler` — the whole process. Static mode: that, exported stats and the
  ``/metrics`` endpoint. etcd mode (``[etcd] endpoints``): listen as a standby (refusing every
  call), campaign, serve once elected with the election's fencing epoch, watch the node
  registrations (:func:`watch_cluster`), and stop when the leader lease cannot be kept (a
  standby takes over). docs/cluster.md ("etcd").

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
from common.metrics import export_source, scheduler_stats, serve_metrics
from common.protocol.base import PROTOCOL_VERSION
from storage_gateway.client import GatewayClient

from services.scheduler.etcd.discovery import NodeRecord
from services.scheduler.etcd.discovery_watch import ClusterView, DiscoveryWatch
from services.scheduler.etcd.election import SchedulerElection
from services.scheduler.shell.gateway_lookup import GatewayHitLookup, PrefixLookupClient
from services.scheduler.shell.service import SchedulerService

# the seam to run a scheduler: what tools (the launcher, the in-process cluster) may use
__all__ = ["GatewayHitLookup", "SchedulerService", "lookup_client", "serve_scheduler",
           "start_scheduler", "watch_cluster"]

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
                          ) -> tuple[SchedulerService, dict[str, Any]]:
    """The scheduler process (elected in etcd mode); its ready-line fields. In etcd mode it
    returns only once elected, so the ready line means "leader"."""
    if cfg.etcd.endpoints:
        svc, info = await _elected(stack, cfg, gateways, port,
                                   replica or f"scheduler-{os.getpid()}")
    else:
        svc, _ = await start_scheduler(stack, cfg, gateways, port=port)
        info = {"host": svc.host, "rpc_port": svc.port}
    export_source(stack, "scheduler", "scheduler", scheduler_stats(svc))
    info["metrics_port"] = await serve_metrics(stack, metrics_port, svc.host or cfg.rpc.host)
    return svc, info


async def _elected(stack: contextlib.AsyncExitStack, cfg: ServicesConfig, gateways: Gateways,
                   port: int | None, replica: str) -> tuple[SchedulerService, dict[str, Any]]:
    election = SchedulerElection(cfg.etcd, replica)
    await election.check()          # etcd unreachable at start: exit 1 naming it
    svc, hit_lookup = await start_scheduler(stack, cfg, gateways, port=port, epoch=0,
                                            node_id=replica)
    stack.push_async_callback(election.resign)     # a clean stop hands over at once
    svc.epoch = await election.win(svc.host, svc.port)
    await watch_cluster(stack, cfg, svc, hit_lookup, gateways)   # the leader watches nodes
    keeper = asyncio.create_task(_lead_until_lost(election, svc), name="scheduler-lease")
    stack.callback(keeper.cancel)
    return svc, {"host": svc.host, "rpc_port": svc.port, "epoch": svc.epoch, "replica": replica}


async def _lead_until_lost(election: SchedulerElection, svc: SchedulerService) -> None:
    """Keep the leader lease (serving only while etcd confirms it); when it is lost, step down
    (the process ends, exit status 1)."""
    reason = await election.keep(svc.lease_unconfirmed, svc.lease_confirmed)
    log.error("scheduler_stepped_down", epoch=svc.epoch, reason=reason)
    await svc.stop()


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
