"""The connector's asynchronous loads as a state machine, with a fake KV source (docs/vllm.md
"Asynchronous loads"). Runs tests/vllm_checks/async_load_check.py in the vLLM venv (vLLM's
own types, no model, a few seconds): a request is held back (``None``) while its claim waits
and gets the claimed hit after; a decode hit loads off the step and a failed load is reported
in ``failed_recving`` and recomputed; a request not opened (refused layout, claim NotFound)
or given up while its claim waits is abandoned on its node, never left to its deadline. Each
scenario's connector counters (docs/vllm.md "Metrics") are checked too."""

from __future__ import annotations

import pytest

from tests.vllm_env import run_check, skip_or_fail
from tools.vllm_engines import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_light]

# the connector's counters per scenario (claim wait seconds checked in the script): every claim
# waits once; the claimed hit counts by read side; a request not opened, or whose load failed,
# is a recompute fallback; one given up by vLLM is neither a hit nor a fallback
COUNTED = {
    "prefill": {"claim_waits": 1.0, "hit_tokens:de": 128.0},
    "decode": {"claim_waits": 2.0, "hit_tokens:pe": 598.0, "load_errors": 1.0,
               "recompute_fallbacks": 1.0},
    "not_opened": {"claim_waits": 2.0, "recompute_fallbacks": 2.0},
    "given_up": {"claim_waits": 1.0},
}


def test_claims_wait_outside_the_batch_and_failures_reach_the_node():
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} missing")
    out = run_check(VLLM_PYTHON, "async_load", timeout=300, script="async_load_check.py")
    assert out == {"prefill_hit_from_claim": 128, "decode_async": "ok",
                   "abandoned": ["n1", "n2"], "given_up": "ok", "given_up_after_claim": "ok",
                   "counted": COUNTED}
