"""The connector's metrics on vLLM's own stats path (docs/vllm.md "Metrics"). Runs
tests/vllm_checks/connector_metrics_check.py in the vLLM venv (vLLM's types, no model, a few
seconds): counter deltas from two steps are summed the way vLLM aggregates them, rebuilt by
``build_kv_connector_stats`` and exported by ``build_prom_metrics`` as the
``dualpath_engine_*`` families of ``common.metrics``; hit tokens split by source for vLLM's
``prompt_tokens_cached_by_source``."""

from __future__ import annotations

import pytest

from tests.vllm_env import run_check, skip_or_fail
from tools.vllm_engines import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_light]


def test_connector_counters_reach_vllm_metrics_as_dualpath_families():
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} missing")
    out = run_check(VLLM_PYTHON, "connector_metrics", timeout=300,
                    script="connector_metrics_check.py")
    assert out == {
        "load_gbps": 2.0,                                    # 6 GB in 3 s
        "families": {
            "dualpath_engine_load_bytes_total": 6_000_000_001.0,
            "dualpath_engine_load_seconds_total": 3.0,
            "dualpath_engine_load_errors_total": 1.0,
            "dualpath_engine_recompute_fallbacks_total": 1.0,
            "dualpath_engine_claim_waits_total": 1.0,
            "dualpath_engine_hit_tokens_total{source=pe}": 256.0,
            "dualpath_engine_hit_tokens_total{source=de}": 64.0,
        },
        "hit_sources": {"prefill": {"disk": 96}, "decode": {"p2p": 96}},
    }
