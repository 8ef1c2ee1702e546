"""The connector's counters on vLLM's own stats path, so they show on vLLM's ``/metrics``
(docs/vllm.md "Metrics").

vLLM collects ``get_kv_connector_stats()`` from the worker after every step, ships the plain
``data`` dict to its scheduler and on to the process that serves ``/metrics``, rebuilds it there
with the connector class's ``build_kv_connector_stats`` and hands it to the
``KVConnectorPromMetrics`` that ``build_prom_metrics`` created. The counters are deltas, so
aggregating is a sum. Family names come from :data:`common.metrics.CONNECTOR_FAMILIES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from common.metrics import CONNECTOR_FAMILIES, CONNECTOR_HIT_TOKENS
from integrations.vllm.counters import HIT_PREFIX

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class DualPathStats(KVConnectorStats):
    """One interval's counter deltas (``ConnectorCounters.take``); summed across workers and
    steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0.0) + float(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval for vLLM's log line: the sums, plus the load rate in GB/s."""
        out: dict[str, int | float] = dict(self.data)
        seconds = self.data.get("load_seconds", 0.0)
        if seconds > 0:
            out["load_gbps"] = round(self.data.get("load_bytes", 0.0) / seconds / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class DualPathPromMetrics(KVConnectorPromMetrics):
    """The connector families as counters of vLLM's registry, one child per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames,  # type: ignore[arg-type]
                         per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for key, (name, doc) in CONNECTOR_FAMILIES.items()}
        name, doc = CONNECTOR_HIT_TOKENS
        self._hits = self._counter_cls(name=name, documentation=doc,
                                       labelnames=[*labelnames, "source"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if value <= 0:
                continue
            if key.startswith(HIT_PREFIX):
                self._hits.labels(*labels, key[len(HIT_PREFIX):]).inc(value)
            elif (per_engine := self._counters.get(key)) is not None:
                per_engine[engine_idx].inc(value)
