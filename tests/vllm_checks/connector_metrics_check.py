"""The connector's counters through vLLM's stats path to Prometheus (vLLM venv, no model).

Run by tests/test_vllm_connector_metrics.py: worker deltas → ``get_kv_connector_stats`` →
the plain dict vLLM ships → ``build_kv_connector_stats`` → aggregate → the
``KVConnectorPromMetrics`` of ``build_prom_metrics`` → the exposition text; plus the
per-source split vLLM's ``prompt_tokens_cached_by_source`` gets. Prints ``RESULT {...}``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from integrations.vllm.connector import DualPathConnector
from integrations.vllm.counters import ConnectorCounters


def main() -> None:
    out: dict = {}
    # two workers' steps, as vLLM hands them over: deltas, summed
    counters = ConnectorCounters()
    counters.loaded(4_000_000_000, 2.0)
    counters.add("load_errors")
    counters.add("recompute_fallbacks")
    with counters.claim_wait():
        pass
    counters.hit("pe", 256)
    counters.hit("de", 0)                      # nothing to count: no series
    worker = NS(_worker=NS(counters=counters))
    first = DualPathConnector.get_kv_connector_stats(worker)   # type: ignore[arg-type]
    assert first is not None and DualPathConnector.get_kv_connector_stats(worker) is None
    counters.loaded(2_000_000_000, 1.0)
    counters.hit("de", 64)
    second = DualPathConnector.get_kv_connector_stats(worker)  # type: ignore[arg-type]
    assert second is not None
    shipped = first.aggregate(second).to_dict()                # what the scheduler sends on
    stats = DualPathConnector.build_kv_connector_stats(dict(shipped))
    assert stats is not None and not stats.is_empty()
    reduced = stats.reduce()
    out["load_gbps"] = reduced["load_gbps"]

    prom = DualPathConnector.build_prom_metrics(
        NS(kv_transfer_config=None), {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"], {0: ["m", "0"]})
    assert prom is not None
    prom.observe(shipped, 0)
    prom.observe({"load_bytes": 1.0, "unknown_key": 5.0}, 0)   # unknown keys are ignored
    samples: dict[str, float] = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            if s.name.startswith("dualpath_engine_") and s.name.endswith("_total"):
                source = s.labels.get("source")
                samples[s.name + (f"{{source={source}}}" if source else "")] = s.value
    assert all(s.labels.get("engine") == "0" for fam in text_string_to_metric_families(
        generate_latest(REGISTRY).decode()) for s in fam.samples
        if s.name.startswith("dualpath_engine_"))
    samples.pop("dualpath_engine_claim_wait_seconds_total")    # a duration: only its presence
    out["families"] = samples

    # vLLM's per-source hit split: prefill read storage (disk), decode received it (p2p)
    split = {role: {k.value: v for k, v in DualPathConnector.get_external_cache_hit_sources(
        NS(_decode=decode), None, 96).items()}  # type: ignore[arg-type]
        for role, decode in (("prefill", False), ("decode", True))}
    assert DualPathConnector.get_external_cache_hit_sources(
        NS(_decode=False), None, 0) == {}  # type: ignore[arg-type]
    out["hit_sources"] = split
    print("RESULT " + json.dumps(out, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
