"""The storage gateway's composition root: a typed config in, a running, announced gateway out.

:func:`start_gateway` is the service alone (its block directory made, started into the
caller's exit stack): what the in-process cluster runs. :func:`serve_gateway` is the whole
process: the service, its etcd registration (when one is given), its counters exported
(:func:`common.metrics.export_stats`) and its ``/metrics`` endpoint; the exit stack stops
them in reverse order (endpoint, source, registration, service).

etcd registration lives in the services layer, above this package (the layers contract), so
the caller hands one in as a :class:`Registrar` (``services.node.registration``). Ports and
keys: docs/cluster.md.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

from common.kv import KVSpec
from common.metrics import export_stats, serve_metrics

from .config import GatewayNodeConfig
from .service import SERVICE_NAME, GatewayService


class Registrar(Protocol):
    """Announces one serving process (etcd discovery) until ``stack`` closes."""

    async def __call__(self, stack: contextlib.AsyncExitStack, node_id: str, service: str,
                       host: str, rpc_port: int, ucx_port: int | None,
                       engines: list[str]) -> None: ...


async def start_gateway(stack: contextlib.AsyncExitStack, cfg: GatewayNodeConfig,
                        node_id: str, *, port: int = 0, spec: KVSpec | None = None
                        ) -> GatewayService:
    """The gateway of ``node_id`` started into ``stack`` (its block directory created)."""
    Path(cfg.gateway.root).mkdir(parents=True, exist_ok=True)
    svc = GatewayService(cfg, node_id, spec=spec, rpc_port=port)
    await stack.enter_async_context(svc)
    return svc


async def serve_gateway(stack: contextlib.AsyncExitStack, cfg: GatewayNodeConfig,
                        node_id: str, *, port: int = 0, register: Registrar | None = None,
                        metrics_port: int | None = None
                        ) -> tuple[GatewayService, dict[str, Any]]:
    """The gateway process: started, registered, exported; its ready-line fields."""
    svc = await start_gateway(stack, cfg, node_id, port=port)
    host = cfg.rpc.host
    info: dict[str, Any] = {"host": host, "rpc_port": svc.rpc_port,
                            "ucx_port": svc.ucx_address[1]}
    if register is not None:
        await register(stack, node_id, SERVICE_NAME, host, svc.rpc_port, svc.ucx_address[1], [])
    export_stats(stack, SERVICE_NAME, node_id, svc)
    info["metrics_port"] = await serve_metrics(stack, metrics_port, host)
    return svc, info
