"""The cluster of a config in one event loop, every port 0 (tests, quick local runs).

    async with start_cluster(load_cluster("configs/local-1p2d.toml"), storage_root=tmp) as c:
        async with SchedulerClient(*c.scheduler) as sched: ...

Same per-service configs as the subprocess launcher (:func:`~.config.service_config`), same
start order (gateways, scheduler with a gateway-backed hit lookup, node services with their
emulated engines). ``stub=True`` starts only the scheduler and stand-in group leaders that
finish every request at once (:class:`services.scheduler.stub_nodes.StubCluster`): the
replay client against the real scheduler without the data path.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ROLE_SERVICE, Cluster, service_config


@dataclass
class InProcessCluster:
    """Handles on the services of a running :func:`start_cluster`."""

    cluster: Cluster
    scheduler_service: Any = None
    gateways: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, Any] = field(default_factory=dict)
    engines: dict[str, Any] = field(default_factory=dict)
    stub: Any = None

    @property
    def scheduler(self) -> tuple[str, int]:
        return self.scheduler_service.host, self.scheduler_service.port

    def gateway_endpoints(self) -> dict[str, tuple[str, int]]:
        return {n: (g.cfg.rpc.host, g.rpc_port) for n, g in self.gateways.items()}

    def node_endpoints(self) -> dict[str, tuple[str, int]]:
        return {n: (s.settings.host, s.rpc_port) for n, s in self.nodes.items()}

    def leaks(self) -> dict[str, int]:
        """Pages still held in each node buffer (all zero when nothing leaked)."""
        return {n: s.pool.used_pages for n, s in self.nodes.items()}


@contextlib.asynccontextmanager
async def start_cluster(cluster: Cluster, *, storage_root: str | Path | None = None,
                        stub: bool = False) -> AsyncIterator[InProcessCluster]:
    """Start every service of ``cluster`` in this loop; stop them all on exit."""
    if storage_root is not None:
        cluster = cluster.with_overrides(cluster={"storage_root": str(storage_root)})
    c = InProcessCluster(cluster)
    async with contextlib.AsyncExitStack() as stack:
        if stub:
            await _start_stub(stack, c)
        else:
            await _start_all(stack, c)
        yield c


async def _start_stub(stack: contextlib.AsyncExitStack, c: InProcessCluster) -> None:
    from common.kv import spec_from_config
    from services.scheduler.service import SchedulerService
    from services.scheduler.stub_nodes import StubCluster
    cfg = service_config(c.cluster, "scheduler")
    c.scheduler_service = await stack.enter_async_context(SchedulerService(cfg, port=0))
    spec = c.cluster.spec
    c.stub = await stack.enter_async_context(StubCluster(
        cfg.rpc, c.scheduler_service.host, c.scheduler_service.port,
        prefill_nodes=len(spec.prefill), decode_nodes=len(spec.decode),
        engines=spec.engines_per_node, kv_fingerprint=spec_from_config(cfg.kv).fingerprint()))


async def _start_all(stack: contextlib.AsyncExitStack, c: InProcessCluster) -> None:
    from tools.engine_sim.engines import EngineHost
    from tools.cluster.node_runner import build
    from storage_gateway.service import GatewayService
    spec = c.cluster.spec
    for n in spec.nodes:
        cfg = service_config(c.cluster, "gateway", n.id)
        Path(cfg.gateway.root).mkdir(parents=True, exist_ok=True)
        c.gateways[n.id] = await stack.enter_async_context(GatewayService(cfg, n.id, rpc_port=0))
    c.scheduler_service = await _start_scheduler(stack, c)
    for n in spec.nodes:
        service = ROLE_SERVICE[n.role]
        cfg = service_config(c.cluster, service, n.id,
                             scheduler=c.scheduler, gateway_port=c.gateways[n.id].rpc_port)
        svc = await stack.enter_async_context(build(service, cfg, n.id, None))
        host = await stack.enter_async_context(EngineHost(svc, cfg.engine_sim))
        svc.extra_stats = host.counters
        c.nodes[n.id], c.engines[n.id] = svc, host


async def _start_scheduler(stack: contextlib.AsyncExitStack, c: InProcessCluster) -> Any:
    from common.kv import spec_from_config
    from services.scheduler.hit_lookup import FunctionHitLookup
    from services.scheduler.service import SchedulerService
    from storage_gateway.client import GatewayClient
    cfg = service_config(c.cluster, "scheduler")
    host, port = next(iter(c.gateway_endpoints().values()))
    client = GatewayClient.connect(cfg.rpc, host, port, None, None, spec_from_config(cfg.kv),
                                   node_id="scheduler")
    stack.push_async_callback(client.close)

    async def lookup(keys):
        return (await client.lookup_prefix(keys)).hit_blocks
    return await stack.enter_async_context(
        SchedulerService(cfg, port=0, hit_lookup=FunctionHitLookup(lookup)))
