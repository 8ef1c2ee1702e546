"""Software arbiter of a node's compute-network egress: KV below a share while collectives run.

On InfiniBand / RoCE the fabric does this in hardware (docs/qos.md: VL arbitration, DSCP→TC
with weighted scheduling; KV on the low-priority lane via the ``kv`` traffic class's UCX
options). Where the fabric has no QoS (TCP, loopback, a single-host emulation) this arbiter
stands in:

* an optional **link bucket** (``link_rate_bytes_per_s``) emulates the node's CNIC bandwidth:
  every KV byte the node's PE receiver / DE loader sends (and, with ``charge_h2d``, every
  H2D layer load, which the paper routes through the CNIC, §5.2) waits for it;
* while a **higher-priority flow** is active (:meth:`EgressArbiter.high_priority`: held in
  production while any engine of the node is inside a collective it announced,
  ``services.engine_api.collectives``; or the synthetic collective stream
  :func:`run_collective` in tests), KV is additionally capped at ``kv_share`` of the link
  rate, so the high-priority flow keeps at least ``1 - kv_share``.

Bytes are charged in ``chunk_bytes`` pieces before they are sent; the buckets keep debt
(``common.rate.TokenBucket``), so long-run rates are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Annotated

import msgspec

from common.config import NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, Section
from common.rate import TokenBucket

MiB = 1024 * 1024
Share = Annotated[float, msgspec.Meta(gt=0, le=1)]    # a fraction in (0, 1]


class ArbiterConfig(Section):
    """``[arbiter]``: emulated CNIC rate per node and KV's share under higher-priority load."""

    enabled: bool = False                     # cap KV at kv_share while a high-priority flow runs
    link_rate_bytes_per_s: NonNegFloat = 0.0  # emulated CNIC per node; 0 = unlimited (real fabric)
    link_burst_bytes: NonNegInt = 4 * MiB
    kv_share: Share = 0.05                    # the paper reserves ~99% for inference traffic
    chunk_bytes: PositiveInt = 1 * MiB
    charge_h2d: bool = True                   # PE-path layer loads cross the CNIC too (§5.2)
    # longest an engine's collective (CollectiveBegin without its end) holds the KV cap
    collective_max_s: PositiveFloat = 2.0

    def __post_init__(self) -> None:
        # cross-field; the per-field bounds are declared above and checked at decode
        if self.enabled and self.link_rate_bytes_per_s <= 0:
            raise ValueError("arbiter.enabled needs arbiter.link_rate_bytes_per_s (the share "
                             "is a share of the link rate)")


class EgressArbiter:
    """One node's arbiter; ``await kv(n)`` before sending KV, ``await high(n)`` for priority."""

    def __init__(self, cfg: ArbiterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        rate = cfg.link_rate_bytes_per_s
        self._link = TokenBucket(rate, cfg.link_burst_bytes, clock) if rate > 0 else None
        self._kv_cap = (TokenBucket(rate * cfg.kv_share, cfg.chunk_bytes, clock)
                        if cfg.enabled else None)
        self._high = 0
        self.counters = {"kv_bytes": 0, "high_bytes": 0, "kv_capped_waits": 0, "kv_wait_s": 0.0,
                         "high_wait_s": 0.0}

    @property
    def active(self) -> bool:
        """Whether KV is paced at all (an emulated link or the priority cap)."""
        return self._link is not None

    @property
    def high_active(self) -> bool:
        return self._high > 0

    @contextlib.contextmanager
    def high_priority(self):
        """Mark a higher-priority flow (a collective) active for the ``with`` block."""
        self._high += 1
        try:
            yield
        finally:
            self._high -= 1

    async def kv(self, nbytes: int) -> None:
        """Wait until ``nbytes`` of KV may leave (chunk by chunk; counted when granted)."""
        if self._link is None:
            self.counters["kv_bytes"] += nbytes
            return
        chunk = self.cfg.chunk_bytes
        while nbytes > 0:
            n = min(chunk, nbytes)
            if self._kv_cap is not None and self._high:
                self.counters["kv_capped_waits"] += 1
                await self._wait(self._kv_cap, n, "kv_wait_s")
            await self._wait(self._link, n, "kv_wait_s")
            self.counters["kv_bytes"] += n
            nbytes -= n

    async def high(self, nbytes: int) -> None:
        """Charge ``nbytes`` of the high-priority flow to the link (counted when granted)."""
        if self._link is None:
            self.counters["high_bytes"] += nbytes
            return
        chunk = self.cfg.chunk_bytes
        while nbytes > 0:
            n = min(chunk, nbytes)
            await self._wait(self._link, n, "high_wait_s")
            self.counters["high_bytes"] += n
            nbytes -= n

    async def _wait(self, bucket: TokenBucket, n: int, counter: str) -> None:
        delay = bucket.reserve(n)
        if delay > 0:
            self.counters[counter] += delay
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                bucket.refund(n)
                raise

    def stats(self) -> dict[str, float]:
        return {f"arbiter_{k}": float(v) for k, v in self.counters.items()} | {
            "arbiter_link_rate_bytes_per_s": float(self.cfg.link_rate_bytes_per_s),
            "arbiter_high_active": float(self._high)}


async def run_collective(arbiter: EgressArbiter, nbytes: int, chunk_bytes: int = MiB,
                         send: Callable[[int], object] | None = None) -> float:
    """A synthetic high-priority stream of ``nbytes`` (what a collective would send).

    Marks itself active, charges the link chunk by chunk and, if given, awaits
    ``send(chunk)`` for each (e.g. a real UCX message). Returns the seconds it took.
    """
    start = time.monotonic()
    with arbiter.high_priority():
        left = nbytes
        while left > 0:
            n = min(chunk_bytes, left)
            await arbiter.high(n)
            if send is not None:
                result = send(n)
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    await result
            left -= n
    return time.monotonic() - start
