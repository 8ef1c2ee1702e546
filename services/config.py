"""Config root of a service process: the gateway's root plus every service's own sections.

Assembled here, above ``common`` and ``storage_gateway``, so no section module needs to import
the root (the old cycle through ``common.config``). The services type their constructors
against this class only under ``TYPE_CHECKING``: at run time they read the sections they need,
and a ``tools.config.DualpathConfig`` (which extends this) is accepted everywhere.
"""

from __future__ import annotations

import msgspec

from services.node.arbiter import ArbiterConfig
from services.node.config import DELoaderConfig, PEReceiverConfig
from services.scheduler.core.config import SchedulerConfig
from services.scheduler.service_config import EtcdConfig, SchedulerServiceConfig
from storage_gateway.config import GatewayNodeConfig


class ServicesConfig(GatewayNodeConfig):
    """Every section a dualpath service reads: shared, gateway, scheduler, node services."""

    # scheduler: placement constants (α, β, Z, policy) and the live service (port, leases, bounds)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    scheduler_service: SchedulerServiceConfig = msgspec.field(
        default_factory=SchedulerServiceConfig)
    # data path: PE receiver / DE loader per node, KV egress arbiter
    pe_receiver: PEReceiverConfig = msgspec.field(default_factory=PEReceiverConfig)
    de_loader: DELoaderConfig = msgspec.field(default_factory=DELoaderConfig)
    arbiter: ArbiterConfig = msgspec.field(default_factory=ArbiterConfig)
    # scheduler election and discovery (empty endpoints: the static scheduler address)
    etcd: EtcdConfig = msgspec.field(default_factory=EtcdConfig)
