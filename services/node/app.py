"""What the two node services' composition roots share (``services/pe_receiver/app.py``,
``services/de_loader/app.py``): start the service, attach its engines, announce it.

Engines are the caller's: a real engine attaches over the node's engine socket from its own
process, and the emulated ones live in ``tools/`` — so the root takes an :data:`EngineAttach`
hook instead of importing them, and runs it after the service starts and before the node is
registered (the stack then stops them before the service). :func:`announce_node` is the
process-only part: etcd registration, the counters exported, the ``/metrics`` endpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from common.kv import KVSpec
from common.metrics import export_stats, serve_metrics

from .base import NodeBase
from .registration import etcd_registration

if TYPE_CHECKING:
    from services.config import ServicesConfig

N = TypeVar("N", bound=NodeBase)
EngineAttach = Callable[[contextlib.AsyncExitStack, NodeBase], Awaitable[object]]


class NodeApp(Generic[N]):
    """A node service's composition root, the same for both roles: ``build`` (not started),
    ``start`` (started into a stack, engines attached: what the in-process cluster runs) and
    ``serve`` (the whole process: that, plus :func:`announce_node`)."""

    def __init__(self, service: Callable[..., N]) -> None:
        self.service = service

    def build(self, cfg: ServicesConfig, node_id: str, *, engines: int | None = None,
              spec: KVSpec | None = None) -> N:
        return self.service(cfg, node_id, engines=engines, spec=spec)

    async def start(self, stack: contextlib.AsyncExitStack, cfg: ServicesConfig, node_id: str,
                    *, engines: int | None = None, spec: KVSpec | None = None,
                    attach: EngineAttach | None = None) -> N:
        return await start_node(stack, self.build(cfg, node_id, engines=engines, spec=spec),
                                attach)

    async def serve(self, stack: contextlib.AsyncExitStack, cfg: ServicesConfig, node_id: str,
                    *, engines: int | None = None, attach: EngineAttach | None = None,
                    metrics_port: int | None = None) -> tuple[N, dict[str, Any]]:
        svc = await self.start(stack, cfg, node_id, engines=engines, attach=attach)
        return svc, await announce_node(stack, cfg, svc, metrics_port)


async def start_node(stack: contextlib.AsyncExitStack, svc: N,
                     attach: EngineAttach | None = None) -> N:
    """``svc`` started into ``stack``, then its engines (``attach``), if any."""
    await stack.enter_async_context(svc)
    if attach is not None:
        await attach(stack, svc)
    return svc


async def announce_node(stack: contextlib.AsyncExitStack, cfg: ServicesConfig, svc: NodeBase,
                        metrics_port: int | None = None) -> dict[str, Any]:
    """Register ``svc`` (etcd mode), export its stats, serve ``/metrics``; its ready-line
    fields."""
    host = svc.settings.host
    engines = list(svc.engine_ids)
    info: dict[str, Any] = {"host": host, "rpc_port": svc.rpc_port,
                            "ucx_port": svc.ucx_address[1], "engines": engines}
    register = etcd_registration(cfg)
    if register is not None:
        await register(stack, svc.node_id, svc.name, host, svc.rpc_port, svc.ucx_address[1],
                       engines)
    export_stats(stack, svc.name, svc.node_id, svc)
    info["metrics_port"] = await serve_metrics(stack, metrics_port, host or cfg.rpc.host)
    return info
