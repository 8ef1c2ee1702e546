"""Counters of every gateway and node service, sampled while a replay runs.

Each sample is one ``GetStats`` call per service (the same counters ``/metrics`` exports):
the storage link's bytes per node (``link_bytes_charged``: reads and write-backs through the
node's emulated SNIC; ``link_write_bytes_charged``: a full-duplex link's write direction apart),
bytes read / written, KV bytes each node service sent, buffer pages.
The series give storage-link utilisation per node over time and the SNIC max/avg ratio.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Union

import structlog

from common.config import RpcConfig
from common.protocol import ErrorReply, GetStats, GetStatsReply, Pong
from common.rpc import RpcClient

KEEP = ("link_bytes_charged", "link_write_bytes_charged", "bytes_read", "bytes_written",
        "transport_bytes_received", "tx_bytes_sent", "arbiter_kv_bytes",
        "pe_buffer_pages_free", "de_buffer_pages_free", "pe_buffer_pages_total",
        "de_buffer_pages_total", "link_rate_bytes_per_s")

_StatsReply = Union[GetStatsReply, Pong, ErrorReply]

log = structlog.get_logger(__name__)


FINAL_SAMPLE_S = 15.0     # how long the closing sample waits for a service that missed it


@dataclass(frozen=True)
class Target:
    """One service to sample: ``service`` is ``storage_gateway``, ``pe_receiver`` or ``de_loader``."""

    node: str
    service: str
    role: str
    host: str
    port: int


@dataclass
class Sampler:
    """Samples ``targets`` every ``interval_s`` between :meth:`start` and :meth:`stop`."""

    targets: list[Target]
    interval_s: float = 0.25
    rpc: RpcConfig = field(default_factory=RpcConfig)
    t0: float = field(default_factory=time.monotonic)
    samples: list[dict[str, Any]] = field(default_factory=list)
    first: dict[str, dict[str, float]] = field(default_factory=dict)
    last: dict[str, dict[str, float]] = field(default_factory=dict)
    missed: dict[str, int] = field(default_factory=dict)     # samples lost per service

    def __post_init__(self) -> None:
        self._clients = {self._key(t): RpcClient(self.rpc, t.host, t.port, role="monitor",
                                                 node_id="replay", reply_type=_StatsReply)
                         for t in self.targets}
        self._task: asyncio.Task | None = None

    @staticmethod
    def _key(t: Target) -> str:
        return f"{t.service}:{t.node}"

    async def start(self) -> None:
        self.t0 = time.monotonic()
        self.first = await self._poll()
        self.last = dict(self.first)
        self._record(0.0, self.first)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="replay-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        snap = await self._poll()
        # The closing sample decides every byte check: a service that was cut off mid-run
        # (a partition, issue #17) gets a few more tries before its last value stands.
        deadline = time.monotonic() + FINAL_SAMPLE_S
        while set(self._clients) - set(snap) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            snap = {**await self._poll(), **snap}
        self._record(time.monotonic() - self.t0, snap)
        self.last.update(snap)
        for c in self._clients.values():
            await c.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            snap = await self._poll()
            self._record(time.monotonic() - self.t0, snap)
            self.last.update(snap)

    async def _poll(self) -> dict[str, dict[str, float]]:
        async def one(key: str, client: RpcClient) -> tuple[str, dict[str, float] | None]:
            try:
                reply = await client.call(GetStats(), timeout=2.0)
                return key, dict(reply.counters)
            except Exception as e:     # a sample may be missing; the series tolerates gaps
                self.missed[key] = self.missed.get(key, 0) + 1
                log.debug("telemetry_sample_missed", service=key, error=repr(e))
                return key, None
        got = await asyncio.gather(*(one(k, c) for k, c in self._clients.items()))
        return {k: v for k, v in got if v is not None}

    def _record(self, t: float, snap: dict[str, dict[str, float]]) -> None:
        for key, counters in snap.items():
            self.samples.append({"t": round(t, 4), "key": key,
                                 **{k: counters[k] for k in KEEP if k in counters}})

    def delta(self, key: str, name: str) -> float:
        """Growth of counter ``name`` of service ``key`` over the run."""
        return self.last.get(key, {}).get(name, 0.0) - self.first.get(key, {}).get(name, 0.0)
