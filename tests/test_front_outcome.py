"""The front never holds a client to the request's deadline when its engine calls have decided
(docs/vllm.md, "The front": the scheduler's events and the front's own calls together).

Runs the front's real aiohttp app in the vLLM venv, where aiohttp lives, against a scripted
scheduler and stand-in vLLM instances on 127.0.0.1 (tests/vllm_checks/front_outcome_check.py).
Each scenario is one request with a client timeout (20 s) far below its deadline (120 s).
Before this behaviour 9 of the 14 scenarios hung (every one whose scheduler sends no
outcome) and 2 answered 503 although vLLM's whole output was in.
"""

from __future__ import annotations

import pytest

from tests.vllm_env import run_check, skip_or_fail
from tools.vllm_engines import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_light]

OUTPUT = [11, 12, 13]


@pytest.fixture(scope="module")
def outcomes() -> dict:
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} missing (the front's aiohttp lives there)")
    return run_check(VLLM_PYTHON, "outcome", script="front_outcome_check.py", timeout=400)


@pytest.mark.parametrize("scenario", ["decode_500", "decode_unreachable", "decode_error_chunk",
                                      "decode_cut_before_done",
                                      "prefill_500_while_decode_waits"])
def test_a_failed_engine_call_is_a_502_and_cancels_the_request(outcomes, scenario):
    got = outcomes[scenario]
    assert (got["status"], got["code"]) == (502, "engine_failed"), got
    assert got["cancelled"] is True, got       # no node waits for a claim that cannot come
    assert got.get("engine_calls_left_running") is None, got


def test_a_decode_left_waiting_for_kv_is_aborted_when_its_prefill_failed(outcomes):
    assert outcomes["prefill_500_while_decode_waits"]["aborted"] == ["hang:decode"]


def test_a_streamed_request_gets_the_engine_failure_as_its_error_event(outcomes):
    got = outcomes["stream_decode_500"]
    assert (got["status"], got["code"], got["token_ids"]) == (200, "engine_failed", []), got
    assert got["cancelled"] is True, got


def test_a_re_plan_after_an_engine_failure_is_still_served(outcomes):
    got = outcomes["replan_after_engine_failure"]
    assert (got["status"], got["token_ids"], got["de_engine"]) == (200, OUTPUT, "ok"), got
    assert got["cancelled"] is False, got      # it ended with the scheduler's outcome
    assert got["ttft_parts"] is None, got      # the failed attempt's breakdown is not served


def test_the_response_carries_the_schedulers_ttft_breakdown_of_the_served_attempt(outcomes):
    got = outcomes["output_then_finished"]
    assert got["ttft_parts"] == {"sched": 0.1, "alloc": 0.2, "read": 0.3, "prefill": 0.4,
                                 "total": 1.0}, got


@pytest.mark.parametrize("scenario", ["output_then_no_outcome", "stream_output_then_no_outcome",
                                      "output_then_replan", "output_then_scheduler_lost"])
def test_vllms_whole_output_is_served_when_the_outcome_does_not_come(outcomes, scenario):
    got = outcomes[scenario]
    assert (got["status"], got["code"], got["token_ids"]) == (200, None, OUTPUT), got
    assert got["cancelled"] is True, got       # the request (or its re-plan) is cancelled
    if scenario.startswith("stream"):
        assert got["done"], got


@pytest.mark.parametrize("scenario", ["output_then_finished", "output_then_failed"])
def test_vllms_whole_output_is_served_with_the_outcome(outcomes, scenario):
    got = outcomes[scenario]
    assert (got["status"], got["code"], got["token_ids"]) == (200, None, OUTPUT), got
    assert got["cancelled"] is False, got


def test_a_dualpath_failure_while_the_decode_waits_is_the_schedulers_typed_503(outcomes):
    got = outcomes["scheduler_fails_first"]
    assert (got["status"], got["code"]) == (503, "UNAVAILABLE"), got
    assert got["aborted"] == ["hang:decode"], got
