"""The one in-process cluster: gateways, scheduler, PE receivers, DE loaders and emulated
engines in one event loop, every port 0 (tests, demos, ``replay --inprocess``).

    async with start_cluster(load_cluster("configs/local-1p2d.toml"), storage_root=tmp) as c:
        async with SchedulerClient(*c.scheduler_address) as sched: ...

    async with local_datapath(tmp, prefill=("p0",), decode=("d0",), scheduler=False) as c:
        await c.store_blocks(keys)          # a small ad-hoc cluster for data-path tests

Both start the services through their composition roots (``storage_gateway.app``,
``services.scheduler.app``, ``services.pe_receiver.app``, ``services.de_loader.app``: what
``dualpath serve`` runs too, less the process-only etcd registration and metrics) and hand
back one :class:`InProcessCluster`; the emulated engines are attached here. :func:`start_cluster` renders each
service's config from a cluster file (:func:`~.config.service_config`, like the subprocess
launcher); ``stub=True`` starts only the scheduler and stand-in group leaders that finish
every request at once (:class:`tools.cluster.stub_nodes.StubCluster`).
:func:`local_datapath` gives every service one small config (:func:`base_config`) and may
leave out the scheduler, the engines, or a whole role.

Every node gets its own storage gateway over one shared directory (``probe_on_miss``: a
block one node wrote is found by the others, as on a distributed file system); the
scheduler's hit lookup asks any of them (``LookupPrefix``, in turn, the next one when one
fails: :class:`~services.scheduler.shell.gateway_lookup.GatewayHitLookup`), so hits are measured,
not assumed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import build_config
from common.kv import KVSpec, spec_from_config
from services.de_loader import app as de_app
from services.de_loader.service import DELoaderService
from services.pe_receiver import app as pe_app
from services.pe_receiver.service import PEReceiverService
from services.scheduler.app import GatewayHitLookup, SchedulerService, start_scheduler
from storage_gateway.app import start_gateway
from storage_gateway.service import GatewayService
from tools.config import DualpathConfig
from tools.engine_sim.kv_pattern import full_block

from .config import ROLE_SERVICE, Cluster, service_config
from .emulated import attach_engines, attach_remote_engines
from .loop_watch import LOOP_STALLS_FILE, LoopStallWatch, watching

if TYPE_CHECKING:
    from tools.cluster.stub_nodes import StubCluster

MiB = 1024 * 1024
NODE_APPS = {"pe_receiver": pe_app, "de_loader": de_app}     # node service → its root


@dataclass
class InProcessCluster:
    """Handles on every service of a running :func:`start_cluster` / :func:`local_datapath`."""

    cfg: Any                      # the shared config (DualpathConfig or the cluster file's)
    spec: KVSpec
    cluster: Cluster | None = None
    gateways: dict[str, GatewayService] = field(default_factory=dict)
    pe: dict[str, PEReceiverService] = field(default_factory=dict)
    de: dict[str, DELoaderService] = field(default_factory=dict)
    engines: dict[str, Any] = field(default_factory=dict)      # EngineHost / RemoteEngineHost
    scheduler: SchedulerService | None = None      # None: started without one
    hit_lookup: GatewayHitLookup | None = None     # the scheduler's (None: no gateway known)
    stub: StubCluster | None = None                # when started with stub=True
    loop_watch: LoopStallWatch | None = None       # reports stalls of the shared loop

    @property
    def nodes(self) -> dict[str, PEReceiverService | DELoaderService]:
        """Every node service (PE receivers and DE loaders) by node id."""
        return {**self.pe, **self.de}

    @property
    def scheduler_address(self) -> tuple[str, int]:
        return self.scheduler.host, self.scheduler.port

    def gateway_endpoints(self) -> dict[str, tuple[str, int]]:
        return {n: (g.cfg.rpc.host, g.rpc_port) for n, g in self.gateways.items()}

    def node_endpoints(self) -> dict[str, tuple[str, int]]:
        return {n: (s.settings.host, s.rpc_port) for n, s in self.nodes.items()}

    async def store_blocks(self, keys: Sequence[str], node: str | None = None) -> None:
        """Put Full Blocks with the emulator's pattern into storage (what a past turn wrote)."""
        gw = self.gateways[node or next(iter(self.gateways))]
        await gw.store.write_blocks(list(keys), [full_block(self.spec, k) for k in keys])

    async def stored_prefix(self, keys: Sequence[str]) -> int:
        """Leading blocks of ``keys`` in storage (any gateway: the directory is shared)."""
        gw = next(iter(self.gateways.values()))
        return await gw.store.lookup_prefix(list(keys))

    def leaks(self) -> dict[str, int]:
        """Pages still held per node buffer (all zero when nothing leaked)."""
        out = {}
        for name, svc in self.nodes.items():
            svc.pool.check_invariants()
            out[name] = svc.pool.used_pages
        return out

    def engine_counters(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for host in self.engines.values():
            for k, v in host.counters().items():
                total[k] = total.get(k, 0.0) + v
        return total

    def add_node(self, svc: PEReceiverService | DELoaderService) -> None:
        (self.pe if isinstance(svc, PEReceiverService) else self.de)[svc.node_id] = svc


# --------------------------------------------------------------------------- shared starters

def node_service(kind: str, cfg: DualpathConfig, node_id: str, *, engines: int | None = None,
                 spec: KVSpec | None = None) -> PEReceiverService | DELoaderService:
    """The PE receiver or DE loader (``kind``) of one node, not yet started."""
    return NODE_APPS[kind].build(cfg, node_id, engines=engines, spec=spec)


# --------------------------------------------------------------------------- from a cluster file

@contextlib.asynccontextmanager
async def start_cluster(cluster: Cluster, *, storage_root: str | Path | None = None,
                        stub: bool = False) -> AsyncIterator[InProcessCluster]:
    """Start every service of ``cluster`` in this loop; stop them all on exit."""
    if storage_root is not None:
        cluster = cluster.with_overrides(cluster={"storage_root": str(storage_root)})
    c = InProcessCluster(cluster.cfg, spec_from_config(cluster.cfg.kv), cluster)
    async with contextlib.AsyncExitStack() as stack:
        c.loop_watch = stack.enter_context(watching())
        if stub:
            await _start_stub(stack, c, cluster)
        else:
            await _start_all(stack, c, cluster)
        yield c


async def _start_stub(stack: contextlib.AsyncExitStack, c: InProcessCluster,
                      cluster: Cluster) -> None:
    from tools.cluster.stub_nodes import StubCluster
    cfg = service_config(cluster, "scheduler")
    c.scheduler, _ = await start_scheduler(stack, cfg, None)
    spec = cluster.spec
    c.stub = await stack.enter_async_context(StubCluster(
        cfg.rpc, *c.scheduler_address, prefill_nodes=len(spec.prefill),
        decode_nodes=len(spec.decode), engines=spec.engines_per_node,
        kv_fingerprint=c.spec.fingerprint()))


async def _start_all(stack: contextlib.AsyncExitStack, c: InProcessCluster,
                     cluster: Cluster) -> None:
    for n in cluster.spec.nodes:
        c.gateways[n.id] = await start_gateway(stack, service_config(cluster, "gateway", n.id),
                                               n.id)
    c.scheduler, c.hit_lookup = await start_scheduler(
        stack, service_config(cluster, "scheduler"), c.gateway_endpoints())
    for n in cluster.spec.nodes:
        service = ROLE_SERVICE[n.role]
        cfg = service_config(cluster, service, n.id, scheduler=c.scheduler_address,
                             gateway_port=c.gateways[n.id].rpc_port)
        svc = await NODE_APPS[service].start(stack, cfg, n.id)
        c.add_node(svc)
        if cluster.spec.remote_engines:
            c.engines[n.id] = await attach_remote_engines(stack, svc, cfg)
        else:
            c.engines[n.id] = await attach_engines(stack, svc, cfg.engine_sim)


# --------------------------------------------------------------------------- ad hoc, small

def base_config(root: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A small-footprint config dict (test-small KV, 16 MiB buffers, fast emulated engines)."""
    data: dict[str, Any] = {
        "kv": {"preset": "test-small"},
        "transport": {"staging_bytes": 16 * MiB},
        "gateway": {"root": str(root / "storage"), "io_threads": 2, "probe_on_miss": True},
        "gateway_service": {"staging_bytes": 16 * MiB, "max_batch_bytes": 4 * MiB},
        "pe_receiver": {"buffer_bytes": 16 * MiB, "engines": 1},
        "de_loader": {"buffer_bytes": 16 * MiB, "engines": 1},
        "engine_sim": {"time_scale": 0.01},
        "scheduler": {"model": "test-small", "policy": "dpl"},
        "scheduler_service": {"fetch_interval_s": 0.01, "heartbeat_s": 0.5, "lease_s": 3.0},
    }
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    return data


def _cfg(data: dict[str, Any], **sections: dict[str, Any]) -> DualpathConfig:
    merged = {k: dict(v) for k, v in data.items()}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    return build_config(merged, DualpathConfig, "local cluster", environ={})


@contextlib.asynccontextmanager
async def local_datapath(root: Path, *, prefill: Sequence[str] = ("p0",),
                         decode: Sequence[str] = ("d0",), scheduler: bool = True,
                         engines: bool = True, overrides: dict[str, Any] | None = None,
                         node_overrides: dict[str, dict[str, Any]] | None = None
                         ) -> AsyncIterator[InProcessCluster]:
    """Start the cluster; stop everything (engines, nodes, scheduler, gateways) on exit.

    ``node_overrides`` (node id → values of its role's section) sets what differs between
    the nodes of one role: two decode nodes each with their own ``engine_socket`` for a vLLM
    instance (tests/test_vllm_front.py's 1P2D)."""
    data = base_config(root, overrides)
    cfg = _cfg(data)
    c = InProcessCluster(cfg, spec_from_config(cfg.kv))
    async with contextlib.AsyncExitStack() as stack:
        # a stall of the shared loop past 10 s writes every thread's stack to this file
        # (tools/cluster/loop_watch.py: even one inside a C call holding the GIL)
        c.loop_watch = stack.enter_context(watching(dump_to=Path(root) / LOOP_STALLS_FILE))
        for node in (*prefill, *decode):
            c.gateways[node] = await start_gateway(stack, _cfg(data), node, spec=c.spec)
        sched_port = 0
        if scheduler:
            endpoints = {n: ("127.0.0.1", g.rpc_port) for n, g in c.gateways.items()}
            c.scheduler, c.hit_lookup = await start_scheduler(
                stack, _cfg(data), endpoints, host="127.0.0.1")
            sched_port = c.scheduler.port
        for role, nodes in (("de_loader", decode), ("pe_receiver", prefill)):
            for node in nodes:
                node_cfg = _cfg(data, **{role: {"scheduler_port": sched_port,
                                                "gateway_port": c.gateways[node].rpc_port,
                                                **(node_overrides or {}).get(node, {})}})
                c.add_node(await NODE_APPS[role].start(stack, node_cfg, node, spec=c.spec))
        if engines:
            for name, svc in {**c.de, **c.pe}.items():
                c.engines[name] = await attach_engines(stack, svc, cfg.engine_sim)
        yield c
