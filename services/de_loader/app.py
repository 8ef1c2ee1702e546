"""The DE loader's composition root: a typed config in, a running, announced service out.

:func:`start` is the service of one node with its engines attached (the caller's
``attach``: engines are not this package's); what the in-process cluster runs.
:func:`serve` is the whole process: that, plus etcd registration, exported stats and the
``/metrics`` endpoint (``services.node.app``, shared with the other node service).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from common.kv import KVSpec
from services.node.app import EngineAttach, announce_node, start_node

from .service import DELoaderService

if TYPE_CHECKING:
    from services.config import ServicesConfig


def build(cfg: ServicesConfig, node_id: str, *, engines: int | None = None,
          spec: KVSpec | None = None) -> DELoaderService:
    """The DE loader of ``node_id``, not yet started."""
    return DELoaderService(cfg, node_id, engines=engines, spec=spec)


async def start(stack: contextlib.AsyncExitStack, cfg: ServicesConfig, node_id: str, *,
                engines: int | None = None, spec: KVSpec | None = None,
                attach: EngineAttach | None = None) -> DELoaderService:
    """The DE loader started into ``stack``, its engines attached by ``attach``."""
    return await start_node(stack, build(cfg, node_id, engines=engines, spec=spec), attach)


async def serve(stack: contextlib.AsyncExitStack, cfg: ServicesConfig, node_id: str, *,
                engines: int | None = None, attach: EngineAttach | None = None,
                metrics_port: int | None = None) -> tuple[DELoaderService, dict[str, Any]]:
    """The DE loader process: started, registered, exported; its ready-line fields."""
    svc = await start(stack, cfg, node_id, engines=engines, attach=attach)
    return svc, await announce_node(stack, cfg, svc, metrics_port)
