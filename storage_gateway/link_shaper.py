"""Storage-link emulation: a token bucket (bytes/s, burst) per node and direction in use —
one shared by reads and writes (``[gateway] link_duplex = "half"``), or one each (``"full"``).

On one machine each node's SNIC is emulated by its gateway's bucket (docs/storage.md). The bucket
keeps *debt*: a reservation subtracts its bytes at once, the balance may go negative, and the
caller sleeps exactly until the balance would be back at zero (monotonic clock, one timer per
chunk, no polling). Late wake-ups do not lose rate — the clock keeps refilling while a task
oversleeps — so the long-run rate is exact up to the initial burst. Large transfers are
charged ``chunk_bytes`` at a time, one chunk crossing at a time: the next chunk goes to the
waiter with the lowest order key (``acquire(n, key)``), ties in the order they asked. Equal keys
(``[gateway] read_order = "shared"``) interleave concurrent readers chunk by chunk; the
request's arrival order as key (``"arrival"``, the default) lets the earliest request's
chunks cross first, like a link serving its queue in order (storage_gateway/priority_gate.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common.rate import TokenBucket
from storage_gateway.priority_gate import PriorityGate


class LinkShaper:
    """Async front of a TokenBucket; ``rate_bytes_per_s`` 0 = unlimited (every call is free)."""

    def __init__(self, rate_bytes_per_s: float = 0.0, burst_bytes: int = 4 << 20,
                 chunk_bytes: int = 1 << 20, clock: Callable[[], float] = time.monotonic):
        self.enabled = rate_bytes_per_s > 0
        self.chunk_bytes = max(1, int(chunk_bytes))
        self._bucket = TokenBucket(rate_bytes_per_s, burst_bytes, clock) if self.enabled else None
        self._crossing = PriorityGate(1)      # the chunk on the link now
        self.bytes_charged = 0
        self.wait_s = 0.0
        self.waits = 0

    @property
    def rate(self) -> float:
        return self._bucket.rate if self._bucket else 0.0

    async def acquire(self, nbytes: int, key: int = 0) -> None:
        """Wait until ``nbytes`` may cross the link (chunk by chunk); lower ``key`` goes first."""
        self.bytes_charged += nbytes
        if self._bucket is None:
            return
        left = nbytes
        try:
            async with self._crossing.slot(key) as turn:
                while left > 0:
                    n = min(self.chunk_bytes, left)
                    delay = self._bucket.reserve(n)
                    if delay > 0:
                        self.waits += 1
                        self.wait_s += delay
                        try:
                            await asyncio.sleep(delay)
                        except asyncio.CancelledError:
                            self._bucket.refund(n)
                            raise
                    left -= n
                    if left > 0:
                        await turn.yield_to_earlier()
        except asyncio.CancelledError:
            self.bytes_charged -= left
            raise

    def counters(self) -> dict[str, float]:
        return {"link_rate_bytes_per_s": self.rate, "link_bytes_charged": self.bytes_charged,
                "link_waits": self.waits, "link_wait_s": self.wait_s}
