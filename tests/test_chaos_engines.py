"""Chaos with engines in their own processes (``[cluster] remote_engines``,
docs/engine-api.md "Cross-process"): kill -9 an engine process mid-request, and kill -9 a node
service its engines are attached to, while a byte-verified replay runs.

Same judgement as tests/test_chaos.py (nothing lost, no page leaked, the victim back and
carrying transfers). An engine process killed: the node fails what it held as retryable, the
scheduler re-plans, the restarted process re-attaches. A node killed: its engine processes
notice, re-attach to the restarted node, and carry its next transfers.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import wait_until
from tests.test_chaos import _check
from tools.cluster.chaos import ChaosHarness, Fault

pytestmark = [pytest.mark.slow, pytest.mark.reliability, pytest.mark.chaos,
              pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def harness():
    with ChaosHarness(remote_engines=True) as h:
        yield h


def test_killed_prefill_engine_process_is_restarted_and_nothing_is_lost(harness, reliability):
    fault = Fault("pe-engine-sigkill", "engine_sim:p0", "kill", None, after_s=0.7)
    result = asyncio.run(harness.run_case(fault))
    _check(result, reliability, "kill -9 a prefill engine process mid-request (remote engines)")
    st = asyncio.run(harness.stats("pe_receiver:p0"))
    assert st["engine_api_detaches"] >= 2 and st["engine_api_engines_attached"] == 2, st


def test_killed_node_service_gets_its_engine_processes_back(harness, reliability):
    fault = Fault("pe-handoff-kill-remote", "pe_receiver:p0", "kill", "pe.handoff.send", at=3)
    result = asyncio.run(harness.run_case(fault))
    _check(result, reliability, "kill -9 PE receiver with engines in their own processes")
    # the same engine processes re-attach by themselves, each after its own connect retry:
    # polled until both are back (ci110 read it once, while the second was still retrying)
    last: dict = {}

    def both_back() -> bool:
        last.update(asyncio.run(harness.stats("pe_receiver:p0")) or {})
        return last.get("engine_api_engines_attached") == 2

    wait_until(both_back, 10.0, lambda: f"both engine processes re-attached: {last}",
               interval=0.1)
