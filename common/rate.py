"""A token bucket with debt: the sans-I/O rate limiter behind the storage-link shaper and the
KV egress arbiter.

A reservation subtracts its bytes at once and the balance may go negative; the caller sleeps
exactly until the balance is back at zero, so late wake-ups lose no rate (the clock keeps
refilling) and the long-run rate is exact up to the initial burst. The clock is injected, so
tests drive it by hand instead of measuring wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """The sans-I/O bucket: ``reserve(n)`` returns how long the caller must wait."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int,
                 clock: Callable[[], float] = time.monotonic):
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()

    def _refill(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        return now

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` (going into debt if needed); seconds until they are covered."""
        self._refill()
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    def refund(self, nbytes: int) -> None:
        """Give back a reservation whose bytes never moved (the waiter was cancelled)."""
        self._refill()
        self._tokens = min(self.burst, self._tokens + nbytes)

    @property
    def balance(self) -> float:
        self._refill()
        return self._tokens
