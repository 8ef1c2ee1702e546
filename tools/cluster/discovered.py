"""etcd discovery wired into the processes (issue 16, item 1): who registers, who watches.

* ``register_node`` — a node service or gateway puts its :class:`NodeRecord` under a lease
  for the life of the process (``services.scheduler.etcd.discovery``).
* ``watch_cluster`` — the elected scheduler watches the registrations
  (``services.scheduler.etcd.discovery_watch``): its hit lookup asks the registered gateways (the
  static ``--lookup-gateway`` / cluster-file ones only while none is registered), a node
  service whose key vanished is dropped at once, refusals show in ``ClusterStatus.discovery``.

Static TOML mode (no ``[etcd] endpoints``) calls neither. docs/cluster.md ("etcd").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import structlog

from common.kv import spec_from_config
from common.protocol.base import PROTOCOL_VERSION
from services.scheduler.etcd.discovery import NodeRecord, make_record, registered
from services.scheduler.etcd.discovery_watch import ClusterView, DiscoveryWatch

from .inprocess import lookup_client

log = structlog.get_logger(__name__)


async def register_node(stack: contextlib.AsyncExitStack, cfg: Any, node_id: str,
                        service: str, host: str, rpc_port: int, ucx_port: int | None,
                        engines: list[str]) -> Any:
    """Register this process in etcd until the stack closes; AlreadyExists for a twin id."""
    record = make_record(node_id, service, host, rpc_port, ucx_port, engines,
                         spec_from_config(cfg.kv).fingerprint(), PROTOCOL_VERSION)
    return await stack.enter_async_context(registered(cfg.etcd, record))


class _Follower:
    """Applies the view to one scheduler: gateways for the hit lookup, vanished nodes."""

    def __init__(self, cfg: Any, svc: Any, hit_lookup: Any,
                 static: Mapping[str, tuple[str, int]]) -> None:
        self.cfg, self.svc, self.hit_lookup = cfg, svc, hit_lookup
        self.static = dict(static)
        self.addrs: dict[str, tuple[str, int]] = dict(static)
        self.clients: dict[str, Any] = hit_lookup.clients
        self._closing: set[asyncio.Task] = set()

    def __call__(self, view: ClusterView, gone: list[NodeRecord]) -> None:
        for rec in gone:
            if rec.role != "gateway":
                self.svc.node_gone(rec.node_id, rec.service, rec.rpc_port)
        self._gateways(view.gateways() or self.static)

    def _gateways(self, want: dict[str, tuple[str, int]]) -> None:
        if want == self.addrs:
            return
        clients = {name: (self.clients[name] if self.addrs.get(name) == addr
                          else lookup_client(self.cfg, *addr)) for name, addr in want.items()}
        for old in self.hit_lookup.replace(clients):
            task = asyncio.create_task(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.addrs, self.clients = dict(want), clients
        log.info("hit_lookup_gateways", gateways=sorted(want))


async def watch_cluster(stack: contextlib.AsyncExitStack, cfg: Any, svc: Any, hit_lookup: Any,
                        static: Mapping[str, tuple[str, int]]) -> DiscoveryWatch:
    """Start the leader's watch (a task, cancelled with the stack); its first snapshot read."""
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
