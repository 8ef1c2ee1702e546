"""Node and gateway discovery through etcd (issue 16, item 1): registration under leases.

With ``[etcd] endpoints`` set, every node service (PE receiver, DE loader) and every storage
gateway puts one key, ``<prefix>/nodes/<node_id>/<service>``, under an etcd lease of
``etcd.lease_s`` seconds; the value is a JSON :class:`NodeRecord` (node id, service, role,
engines, RPC and UCX addresses, KV spec fingerprint, protocol version, pid, a per-process
instance id). The key lives exactly as long as the process keeps its lease alive: kill -9 →
gone after one lease; a clean stop revokes it at once.

The scheduler leader watches the prefix (:mod:`services.scheduler.etcd.discovery_watch`). The RPC
registration (``RegisterNode``) stays the session that carries work; etcd is discovery and
liveness only. Static TOML mode (no endpoints) does none of this.

Two processes with one node id and service: the first one's ``create_revision == 0``
transaction wins; the second waits one lease (a restarted node's predecessor, killed -9, may
still hold the key) and is then refused with :class:`~common.errors.AlreadyExists` naming the
holder. etcd lost while running: the node keeps serving what it holds and puts its key again
(a fresh lease) once etcd answers. Keys and timings: docs/cluster.md ("etcd").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from typing import Any

import msgspec
import structlog

from common.errors import AlreadyExists, Unavailable

from .election import EtcdEndpoints, put_if_absent, retried_at_start
from ..service_config import EtcdConfig

log = structlog.get_logger(__name__)

ROLE_OF_SERVICE = {"pe_receiver": "prefill", "de_loader": "decode",
                   "storage_gateway": "gateway", "gateway": "gateway"}


class NodeRecord(msgspec.Struct, frozen=True):
    """The value of ``<prefix>/nodes/<node_id>/<service>`` (JSON)."""

    node_id: str
    service: str                   # pe_receiver | de_loader | storage_gateway
    role: str                      # prefill | decode | gateway
    host: str
    rpc_port: int
    ucx_port: int | None
    engines: list[str]
    kv_fingerprint: str
    protocol_version: int
    pid: int
    instance: str                  # this process (uuid4): tells a restart from a twin
    started: float


def nodes_prefix(cfg: EtcdConfig) -> bytes:
    return f"{cfg.prefix.rstrip('/')}/nodes/".encode()


def node_key(cfg: EtcdConfig, node_id: str, service: str) -> bytes:
    return nodes_prefix(cfg) + f"{node_id}/{service}".encode()


def make_record(node_id: str, service: str, host: str, rpc_port: int, ucx_port: int | None,
                engines: list[str], kv_fingerprint: str, protocol_version: int) -> NodeRecord:
    return NodeRecord(node_id, service, ROLE_OF_SERVICE.get(service, service), host, rpc_port,
                      ucx_port, list(engines), kv_fingerprint, protocol_version, os.getpid(),
                      uuid.uuid4().hex, time.time())


class EtcdRegistrar:
    """Keeps one process's key alive: ``await register()`` at start, then ``run()`` forever.

    ``register`` raises AlreadyExists when another live process holds the key after one
    lease, Unavailable when etcd goes unanswered for ``start_timeout_s`` (the service does not
    start: the endpoint is named). ``run`` renews every third of the lease and, when the
    lease is gone (etcd lost for longer than it), puts the key again under a fresh lease as
    soon as etcd answers."""

    def __init__(self, cfg: EtcdConfig, record: NodeRecord) -> None:
        self.cfg = cfg
        self.record = record
        self.key = node_key(cfg, record.node_id, record.service)
        self.value = msgspec.json.encode(record)
        self.etcd = EtcdEndpoints(cfg.endpoints, cfg.dial_timeout_s)
        self._lease: Any = None
        self.registrations = 0          # puts of the key (1 + re-registrations after a loss)

    async def register(self) -> None:
        deadline: float | None = None       # one lease after the holder was first seen
        while True:
            holder = await retried_at_start(self._put_if_vacant, self.cfg,
                                            f"registration of {self.key.decode()}")
            if holder is None:
                return
            if deadline is None:
                deadline = time.monotonic() + self.cfg.lease_s + 1.0
            if time.monotonic() >= deadline:
                raise AlreadyExists(
                    f"node id {self.record.node_id!r} ({self.record.service}) is already "
                    f"registered in etcd by pid {holder.pid} at {holder.host}:{holder.rpc_port} "
                    f"(instance {holder.instance[:8]}); give this process another --node id")
            await asyncio.sleep(self.cfg.poll_s)

    async def _put_if_vacant(self) -> NodeRecord | None:
        """Put the key under a fresh lease if nobody holds it: None; else the holder."""
        lease = await put_if_absent(self.etcd, self.key, self.value, self.cfg.lease_s)
        if lease is not None:
            self._lease = lease
            self.registrations += 1
            log.info("node_registered_in_etcd", key=self.key.decode(),
                     lease_s=self.cfg.lease_s, registrations=self.registrations)
            return None
        got = await self.etcd.call(lambda c: c.get(self.key))
        if got is None:
            return await self._put_if_vacant()     # it vanished between the two calls
        holder = msgspec.json.decode(got.value, type=NodeRecord)
        if holder.instance == self.record.instance:
            return None                             # ours, from before a renewal hiccup
        return holder

    async def run(self) -> None:
        """Renew; after a loss, register again (nodes keep serving meanwhile)."""
        while True:
            await asyncio.sleep(self.cfg.lease_s / 3)
            try:
                if await self._renewed():
                    continue
                log.warning("node_etcd_lease_lost", key=self.key.decode())
                if await self._put_if_vacant() is not None:
                    log.error("node_id_taken_in_etcd", key=self.key.decode())
            except Unavailable as e:
                log.warning("node_etcd_unreachable", key=self.key.decode(), error=e.message)

    async def _renewed(self) -> bool:
        lease = self._lease
        if lease is None:
            return False
        reply = await self.etcd.call(lambda c: c.refresh_lease(lease.id), self.cfg.lease_s / 4)
        if reply is not None and reply.TTL > 0:
            return True
        self._lease = None
        return False

    async def close(self) -> None:
        """A clean stop: revoke the lease, so the key goes at once (the watcher sees it)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(Unavailable):
                await self.etcd.call(lambda c: c.revoke_lease(lease.id))
        await self.etcd.close()


@contextlib.asynccontextmanager
async def registered(cfg: EtcdConfig, record: NodeRecord):
    """Register ``record`` for the block's lifetime (renewed and re-put in a task)."""
    reg = EtcdRegistrar(cfg, record)
    await reg.register()
    task = asyncio.create_task(reg.run(), name=f"etcd-register-{record.node_id}")
    try:
        yield reg
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await reg.close()
