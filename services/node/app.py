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
from typing import TYPE_CHECKING, Any, TypeVar

from common.metrics import export_stats, serve_metrics

from .base import NodeBase
from .registration import etcd_registration

if TYPE_CHECKING:
    from services.config import ServicesConfig

N = TypeVar("N", bound=NodeBase)
EngineAttach = Callable[[contextlib.AsyncExitStack, NodeBase], Awaitable[object]]


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
