"""The scheduler leader's view of the cluster, from etcd: it watches ``<prefix>/nodes/``.

:class:`ClusterView` is the sans-I/O part (docs/contributing.md, 'Sans-I/O cores'): it takes the
keys' puts and deletes and keeps which node services and gateways are registered, which were
refused and why. A registration is *refused* — logged (``node_refused``), counted and listed in
``ClusterStatus.refused`` — when its KV spec fingerprint or protocol version differs from the
cluster's (this scheduler's); both values are named. Refused nodes are not used (their gateway
answers no hit lookup).

:class:`DiscoveryWatch` feeds it: a snapshot (``get_prefix``), then a watch from the
snapshot's revision; every ``resync_s`` (and after any error, e.g. the member it watched
died: a dead member hangs rather than refuses) a fresh snapshot from the next member, so the
view is never staler than that. ``on_change(view, gone)`` runs after each change with the
records whose key vanished (lease ran out: the process died or lost etcd).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from common.errors import Unavailable

from .discovery import NodeRecord, nodes_prefix
from .election import EtcdEndpoints
from ..service_config import EtcdConfig

log = structlog.get_logger(__name__)

RESYNC_LEASES = 10          # a full snapshot at least every this many leases


class ClusterView:
    """Registered node services and gateways; refused ones with the reason."""

    def __init__(self, kv_fingerprint: str, protocol_version: int) -> None:
        self.kv_fingerprint = kv_fingerprint
        self.protocol_version = protocol_version
        self.members: dict[str, NodeRecord] = {}     # key → record
        self.refused: dict[str, str] = {}            # key → reason
        self.counters: Counter[str] = Counter()

    def gateways(self) -> dict[str, tuple[str, int]]:
        """node id → RPC address of every accepted gateway."""
        return {r.node_id: (r.host, r.rpc_port) for r in self.members.values()
                if r.role == "gateway"}

    def nodes(self) -> list[NodeRecord]:
        return [r for r in self.members.values() if r.role != "gateway"]

    def put(self, key: str, value: bytes) -> bool:
        """A key written; True when the view changed."""
        try:
            rec = msgspec.json.decode(value, type=NodeRecord)
        except msgspec.DecodeError as e:
            return self._refuse(key, f"unreadable registration: {e}")
        reason = self._mismatch(rec)
        if reason is not None:
            return self._refuse(key, reason)
        self.refused.pop(key, None)
        if self.members.get(key) == rec:
            return False
        if key not in self.members:
            self.counters["joined"] += 1
            log.info("node_discovered", key=key, role=rec.role, host=rec.host,
                     rpc_port=rec.rpc_port, engines=len(rec.engines))
        self.members[key] = rec
        return True

    def delete(self, key: str) -> NodeRecord | None:
        """A key gone (lease expired or revoked): the record it held, if it was accepted."""
        self.refused.pop(key, None)
        rec = self.members.pop(key, None)
        if rec is not None:
            self.counters["left"] += 1
            log.warning("node_gone_from_etcd", key=key, role=rec.role, pid=rec.pid)
        return rec

    def replace(self, items: dict[str, bytes]) -> list[NodeRecord]:
        """A full snapshot; the records that vanished since the last one."""
        gone = [rec for key in list(self.members) if key not in items
                for rec in [self.delete(key)] if rec is not None]
        for key in list(self.refused):
            if key not in items:
                self.refused.pop(key)
        for key, value in items.items():
            self.put(key, value)
        return gone

    def _mismatch(self, rec: NodeRecord) -> str | None:
        if rec.protocol_version != self.protocol_version:
            self.counters["refused_version"] += 1
            return (f"{rec.node_id}/{rec.service} speaks protocol v{rec.protocol_version}, the "
                    f"cluster v{self.protocol_version}")
        if rec.kv_fingerprint != self.kv_fingerprint:
            self.counters["refused_kv_spec"] += 1
            return (f"{rec.node_id}/{rec.service} has KV spec {rec.kv_fingerprint}, the cluster "
                    f"{self.kv_fingerprint}")
        return None

    def _refuse(self, key: str, reason: str) -> bool:
        was = self.members.pop(key, None)
        if self.refused.get(key) == reason and was is None:
            return False
        self.refused[key] = reason
        log.error("node_refused", key=key, reason=reason)
        return True


OnChange = Callable[[ClusterView, list[NodeRecord]], Any]


class DiscoveryWatch:
    """Keeps a :class:`ClusterView` in step with etcd; ``await run()`` until cancelled."""

    def __init__(self, cfg: EtcdConfig, view: ClusterView, on_change: OnChange | None = None
                 ) -> None:
        self.cfg = cfg
        self.view = view
        self.on_change = on_change
        self.prefix = nodes_prefix(cfg)
        self.etcd = EtcdEndpoints(cfg.endpoints, cfg.dial_timeout_s)
        self.resync_s = RESYNC_LEASES * cfg.lease_s
        self.synced = asyncio.Event()          # set after the first snapshot

    async def run(self) -> None:
        while True:
            try:
                revision = await self._snapshot()
                await self._follow(revision)
            except Unavailable as e:
                log.warning("discovery_etcd_unreachable", error=e.message)
            except Exception as e:                 # a broken watch stream: snapshot again
                log.warning("discovery_watch_broken", error=f"{type(e).__name__}: {e}")
                await self.etcd.failed()
            await asyncio.sleep(self.cfg.poll_s)

    async def _snapshot(self) -> int:
        got = await self.etcd.call(lambda c: c.get_prefix(self.prefix))
        items = {kv.key.decode(): kv.value for kv in got}
        gone = self.view.replace(items)
        self.synced.set()
        self._changed(gone)
        return int(got.header.revision)

    async def _follow(self, revision: int) -> None:
        """Apply watch events from ``revision + 1`` for up to ``resync_s``."""
        client = await self.etcd.client()
        watch = await client.watch_prefix(self.prefix, start_revision=revision + 1)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.resync_s):
                    async for event in watch:
                        self._apply(event)
        finally:
            with contextlib.suppress(Exception):
                await watch.cancel()

    def _apply(self, event: Any) -> None:
        key = event.kv.key.decode()
        if event.kind == "DELETE":
            rec = self.view.delete(key)
            if rec is not None:
                self._changed([rec])
        elif self.view.put(key, event.kv.value):
            self._changed([])

    def _changed(self, gone: list[NodeRecord]) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(self.view, gone)
        except Exception:                    # a broken consumer must not stop the watch
            log.exception("discovery_on_change_failed")

    async def close(self) -> None:
        await self.etcd.close()
