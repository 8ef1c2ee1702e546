"""An in-process data-path cluster on loopback: gateways, scheduler, PE receivers, DE loaders
and emulated engines in one event loop (tests, demos; ``cluster up`` runs the same services
as processes).

Every node gets its own storage gateway over one shared directory (``probe_on_miss``: a
block one node wrote is found by the others, as on a distributed file system); the
scheduler's hit lookup asks a gateway (``LookupPrefix``), so hits are measured, not assumed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import build_config
from tools.config import DualpathConfig
from common.kv import KVSpec, spec_from_config
from services.de_loader.service import DELoaderService
from services.pe_receiver.service import PEReceiverService
from storage_gateway.client import GatewayClient
from storage_gateway.service import GatewayService

from .engines import EngineHost
from .kv_pattern import full_block

MiB = 1024 * 1024


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


@dataclass
class LocalDatapath:
    """Handles on every service of a running :func:`local_datapath`."""

    cfg: DualpathConfig
    spec: KVSpec
    gateways: dict[str, GatewayService] = field(default_factory=dict)
    pe: dict[str, PEReceiverService] = field(default_factory=dict)
    de: dict[str, DELoaderService] = field(default_factory=dict)
    hosts: dict[str, EngineHost] = field(default_factory=dict)
    scheduler: Any = None
    lookup_client: GatewayClient | None = None

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
        for name, svc in {**self.pe, **self.de}.items():
            svc.pool.check_invariants()
            out[name] = svc.pool.used_pages
        return out

    def engine_counters(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for host in self.hosts.values():
            for k, v in host.counters().items():
                total[k] = total.get(k, 0.0) + v
        return total


def _cfg(data: dict[str, Any], cls=DualpathConfig, **sections: dict[str, Any]):
    merged = {k: dict(v) for k, v in data.items()}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    return build_config(merged, cls, "local cluster", environ={})


@contextlib.asynccontextmanager
async def local_datapath(root: Path, *, prefill: Sequence[str] = ("p0",),
                         decode: Sequence[str] = ("d0",), scheduler: bool = True,
                         engines: bool = True, overrides: dict[str, Any] | None = None
                         ) -> AsyncIterator[LocalDatapath]:
    """Start the cluster; stop everything (engines, nodes, scheduler, gateways) on exit."""
    data = base_config(root, overrides)
    cfg = _cfg(data)
    spec = spec_from_config(cfg.kv)
    c = LocalDatapath(cfg, spec)
    async with contextlib.AsyncExitStack() as stack:
        for node in (*prefill, *decode):
            gw = GatewayService(_cfg(data), f"{node}", spec=spec)
            await stack.enter_async_context(gw)
            c.gateways[node] = gw
        sched_port = 0
        if scheduler:
            c.scheduler = await _start_scheduler(stack, c, data, spec)
            sched_port = c.scheduler.port
        for role, nodes, cls, store in (("de_loader", decode, DELoaderService, c.de),
                                        ("pe_receiver", prefill, PEReceiverService, c.pe)):
            for node in nodes:
                node_cfg = _cfg(data, **{role: {"scheduler_port": sched_port,
                                                "gateway_port": c.gateways[node].rpc_port}})
                svc = cls(node_cfg, node, spec=spec)
                await stack.enter_async_context(svc)
                store[node] = svc
        if engines:
            for name, svc in {**c.de, **c.pe}.items():
                c.hosts[name] = await stack.enter_async_context(EngineHost(svc, cfg.engine_sim))
                svc.extra_stats = c.hosts[name].counters
        yield c


async def _start_scheduler(stack: contextlib.AsyncExitStack, c: LocalDatapath,
                           data: dict[str, Any], spec: KVSpec):
    from services.scheduler.hit_lookup import FunctionHitLookup
    from services.scheduler.service import SchedulerService

    gw = next(iter(c.gateways.values()))
    client = GatewayClient.connect(c.cfg.rpc, "127.0.0.1", gw.rpc_port, None, None, spec,
                                   node_id="scheduler")  # lookups only: no transport
    stack.push_async_callback(client.close)
    c.lookup_client = client

    async def lookup(keys):
        return (await client.lookup_prefix(keys)).hit_blocks

    sched = SchedulerService(_cfg(data), host="127.0.0.1", port=0,
                             hit_lookup=FunctionHitLookup(lookup))
    await stack.enter_async_context(sched)
    return sched
