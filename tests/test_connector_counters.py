"""The vLLM connector's counters without vLLM (docs/vllm.md "Metrics"): deltas taken once,
thread-safe, named after the ``dualpath_engine_*`` families of ``common.metrics``, and every
connector family the operations dashboard queries is one of them. The path through vLLM's
stats to its ``/metrics`` is tests/test_vllm_connector_metrics.py."""

from __future__ import annotations

import re
import threading

from common.metrics import CONNECTOR_FAMILIES, CONNECTOR_HIT_TOKENS
from integrations.vllm.counters import HIT_PREFIX, ConnectorCounters
from tools.cluster.observability import dashboard_queries, load_dashboard


def test_counters_are_deltas_taken_once():
    c = ConnectorCounters()
    assert c.take() == {}
    c.loaded(1000, 0.5)
    c.loaded(3000, 1.5)
    c.add("load_errors")
    c.add("recompute_fallbacks", 2)
    c.hit("pe", 64)
    c.hit("de", 32)
    c.hit("de", 0)                         # an empty hit is no series
    with c.claim_wait():
        pass
    got = c.take()
    assert got.pop("claim_wait_seconds") >= 0.0
    assert got == {"load_bytes": 4000.0, "load_seconds": 2.0, "load_errors": 1.0,
                   "recompute_fallbacks": 2.0, "claim_waits": 1.0,
                   HIT_PREFIX + "pe": 64.0, HIT_PREFIX + "de": 32.0}
    assert c.take() == {}


def test_a_failed_claim_still_counts_its_wait():
    c = ConnectorCounters()
    try:
        with c.claim_wait():
            raise TimeoutError("not handed within the claim's time")
    except TimeoutError:
        pass
    assert c.take()["claim_waits"] == 1.0


def test_counting_from_many_threads_loses_nothing():
    c = ConnectorCounters()

    def count() -> None:
        for _ in range(1000):
            c.add("claim_waits")
            c.hit("pe", 1)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.take() == {"claim_waits": 8000.0, HIT_PREFIX + "pe": 8000.0}


def test_every_counter_has_a_family_and_the_dashboard_queries_only_those():
    c = ConnectorCounters()
    c.loaded(1, 1.0)
    c.add("load_errors")
    c.add("recompute_fallbacks")
    with c.claim_wait():
        pass
    keys = set(c.take())
    assert keys == set(CONNECTOR_FAMILIES)
    families = {name for name, _ in CONNECTOR_FAMILIES.values()} | {CONNECTOR_HIT_TOKENS[0]}
    assert all(name.startswith("dualpath_engine_") for name in families)
    queried = {m.removesuffix("_total") for _, expr in dashboard_queries(load_dashboard())
               for m in re.findall(r"dualpath_engine_\w+", expr)}
    assert queried == families, queried ^ families
