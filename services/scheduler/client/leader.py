"""Finding the elected scheduler leader, for the scheduler's clients (frontends, node services).

With ``[etcd] endpoints`` set, scheduler replicas elect a leader and publish its address under
``<prefix>/scheduler/leader`` (:mod:`services.scheduler.etcd.election`); a client resolves it
before each connection, so a leader change is followed by the next reconnect.
"""

from __future__ import annotations

import json

from common.errors import Unavailable

from ..etcd.election import EtcdEndpoints, leader_key
from ..service_config import EtcdConfig


class LeaderResolver:
    """``await resolver()`` → the current leader's (host, port), read from etcd."""

    def __init__(self, cfg: EtcdConfig) -> None:
        self.etcd = EtcdEndpoints(cfg.endpoints, cfg.dial_timeout_s)
        self.key = leader_key(cfg)

    async def __call__(self) -> tuple[str, int]:
        got = await self.etcd.call(lambda c: c.get(self.key))
        if got is None:
            raise Unavailable(f"no scheduler leader in etcd ({self.key.decode()}): an "
                              f"election is under way, or no replica runs")
        info = json.loads(got.value)
        return str(info["host"]), int(info["port"])

    async def close(self) -> None:
        await self.etcd.close()
