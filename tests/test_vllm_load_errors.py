"""A prefill session that ends mid-forward reports every hit row it will not load
(tests/vllm_checks/load_errors_check.py, in the vLLM venv, no model, a few seconds).

A save that failed at layer 0 (the DE it forwards to died) drops the session; the later
layers' hit rows then never arrive, yet vLLM counts them computed and has them in its prefix
cache. They must reach ``get_block_ids_with_load_errors`` — vLLM then evicts them (prefill
policy ``"fail"``, docs/vllm.md "A failed load") — or the re-planned attempt takes the
half-written blocks as a local hit (an output different from plain vLLM: ci21)."""

from __future__ import annotations

import pytest

from tests.vllm_env import run_check, skip_or_fail
from tools.vllm_engines import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_light]


def test_a_session_ended_mid_forward_reports_the_rows_it_will_not_load():
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} missing")
    out = run_check(VLLM_PYTHON, "load_errors", timeout=300, script="load_errors_check.py")
    assert out == {
        # layer 0 loaded, its save failed: layers 1-2 never load; the loaded blocks reported
        "save_failed": {"load_errors": [3, 5], "loaded": [0], "failed": "save of layer 0 failed"},
        # layer 1's hit never arrived: reported the same way, nothing more loaded
        "load_failed": {"load_errors": [3, 5], "loaded": [0],
                        "failed": "load failed at layer 1"},
        "ok": {"load_errors": [], "loaded": [0, 1, 2], "failed": ""},
    }
