"""What one attempt may touch on its node: the narrow I/O object a node service hands each
:class:`~services.pe_receiver.attempt.PrefillAttempt` / :class:`~services.de_loader.attempt.DecodeAttempt`.

An attempt gets the node's transport, its buffer's regions, the egress arbiter, the gateway
clients (the one hit read, write-backs), the node's counters and settings, the report channel
to the scheduler and a way to say it ended — not the service. So an attempt can be built and
read without the service, and nothing in it can reach the service's registration, its RPC
server or another attempt (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass
from typing import Any

from common.kv import KVSpec
from common.transport import PageTransport
from services.engine_api.kv_region import RegionPool
from services.node.arbiter import EgressArbiter
from services.node.config import NodeServiceConfig
from services.node.gateway import NodeGateways

# report(request_id, attempt, stage, **fields) -> False when the attempt is no longer current
ReportFn = Callable[..., Awaitable[bool]]


@dataclass(frozen=True, eq=False)
class NodeIO:
    """One node's I/O as its attempts see it (built by the node service once it started)."""

    spec: KVSpec
    settings: NodeServiceConfig
    transport: PageTransport
    regions: RegionPool
    arbiter: EgressArbiter
    gateways: NodeGateways
    counters: MutableMapping[str, int]
    report: ReportFn
    # run an attempt's main task (its run or its release) under the node's supervisor
    supervise: Callable[[Coroutine[Any, Any, Any], str], Any]
    # the attempt (request id, attempt) ended: the node forgets it (if it is still the one held)
    ended: Callable[[tuple[str, int], object], None]

    @property
    def ucx_address(self) -> tuple[str, int]:
        return self.transport.address

