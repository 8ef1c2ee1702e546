"""Emulated engines attached to a node service: the one place serving a node loads the emulator.

Both the in-process cluster and ``dualpath serve pe_receiver|de_loader`` (without
``--no-engines`` or an engine socket) attach them through here, as the ``attach`` hook of
the node's composition root (``services.node.app.EngineAttach``); the stack stops them
before the service.
"""

from __future__ import annotations

import contextlib
from typing import Any

from services.node.base import NodeBase
from tools.config import DualpathConfig
from tools.config import EngineSimConfig
from tools.engine_sim.engines import EngineHost


async def attach_engines(stack: contextlib.AsyncExitStack, svc: NodeBase,
                         engine_cfg: EngineSimConfig) -> EngineHost:
    """Start ``svc``'s emulated engines (stopped before it: the stack unwinds in reverse)."""
    host = await stack.enter_async_context(EngineHost(svc, engine_cfg))
    svc.extra_stats = host.counters
    return host


async def attach_remote_engines(stack: contextlib.AsyncExitStack, svc: NodeBase,
                                cfg: DualpathConfig) -> Any:
    """``svc``'s emulated engines attached over its engine socket (``[cluster]
    remote_engines``): in this loop, but every request crosses the engine channel and every
    KV byte the node's shared-memory arena, as with an engine process."""
    from tools.engine_sim.remote_host import RemoteEngineHost
    host = RemoteEngineHost(svc.settings.engine_socket, svc.engine_ids, svc.role, svc.spec,
                            cfg.engine_sim)
    await stack.enter_async_context(host)
    svc.extra_stats = host.counters
    return host
