"""The connector's own counters, kept where the work happens (the worker half) and handed to
vLLM's stats path once per step (docs/vllm.md "Metrics").

No vLLM import: the counting is plain data so it can be unit-tested without vLLM
(:mod:`integrations.vllm.stats` wraps it in vLLM's ``KVConnectorStats``). Names are the keys
of :data:`common.metrics.CONNECTOR_FAMILIES` (and ``hit_tokens:<source>`` for
:data:`common.metrics.CONNECTOR_HIT_TOKENS`), so the connector and the Prometheus families
cannot drift apart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

HIT_PREFIX = "hit_tokens:"


class ConnectorCounters:
    """Deltas since the last :meth:`take`; thread-safe (the step, the off-step pool and the
    finish pool all count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._data[name] = self._data.get(name, 0.0) + value

    def loaded(self, nbytes: int, seconds: float) -> None:
        """KV bytes copied into the paged cache and the time it took (waiting for the layer to
        arrive included: that is what a load costs vLLM)."""
        with self._lock:
            self._data["load_bytes"] = self._data.get("load_bytes", 0.0) + nbytes
            self._data["load_seconds"] = self._data.get("load_seconds", 0.0) + seconds

    @contextmanager
    def claim_wait(self) -> Iterator[None]:
        """Times one claim (the wait for the node to hand the request), failed ones too."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._data["claim_waits"] = self._data.get("claim_waits", 0.0) + 1
                self._data["claim_wait_seconds"] = (self._data.get("claim_wait_seconds", 0.0)
                                                    + time.monotonic() - t0)

    def hit(self, source: str, tokens: int) -> None:
        """Hit tokens vLLM will load, by where dualpath read them (``pe`` / ``de`` side)."""
        if tokens > 0:
            self.add(HIT_PREFIX + source, tokens)

    def take(self) -> dict[str, float]:
        """The deltas since the last call (empty when nothing happened)."""
        with self._lock:
            out, self._data = self._data, {}
            return out
