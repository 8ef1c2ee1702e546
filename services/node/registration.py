"""etcd registration of a serving process: its :class:`NodeRecord` under a lease.

Every node service (PE receiver, DE loader) and every storage gateway registers this way in
etcd mode (``[etcd] endpoints`` set): one key for the life of the process, a twin id refused
with ``AlreadyExists`` (``services.scheduler.etcd.discovery``). Static TOML mode registers nothing:
:func:`etcd_registration` is None there. The gateway's composition root sits below the
services layer, so it is handed this object as its ``storage_gateway.app.Registrar``.
docs/cluster.md ("etcd").
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from common.kv import spec_from_config
from common.protocol.base import PROTOCOL_VERSION
from services.scheduler.etcd.discovery import make_record, registered

if TYPE_CHECKING:
    from services.config import ServicesConfig
    from services.scheduler.service_config import EtcdConfig


class EtcdRegistration:
    """Registers processes of one config: the etcd endpoints and the KV spec they serve."""

    def __init__(self, etcd: EtcdConfig, kv_fingerprint: str) -> None:
        self.etcd, self.kv_fingerprint = etcd, kv_fingerprint

    async def __call__(self, stack: contextlib.AsyncExitStack, node_id: str, service: str,
                       host: str, rpc_port: int, ucx_port: int | None,
                       engines: list[str]) -> None:
        """Register until ``stack`` closes; AlreadyExists for a live twin id."""
        record = make_record(node_id, service, host, rpc_port, ucx_port, engines,
                             self.kv_fingerprint, PROTOCOL_VERSION)
        await stack.enter_async_context(registered(self.etcd, record))


def etcd_registration(cfg: ServicesConfig) -> EtcdRegistration | None:
    """The registration ``cfg`` asks for: None in static mode (no etcd endpoints)."""
    if not cfg.etcd.endpoints:
        return None
    return EtcdRegistration(cfg.etcd, spec_from_config(cfg.kv).fingerprint())
