"""The in-process cluster's loop watchdog names the code that held the shared loop."""

from __future__ import annotations

import time

from structlog.testing import capture_logs

from tests.helpers import until
from tools.cluster.loop_watch import watching


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)                 # the synchronous stretch under test


async def test_a_blocked_loop_is_reported_once_with_the_blocking_stack():
    with capture_logs() as logs, watching(threshold_s=0.3) as watch:
        hold_the_loop(1.2)
        await until(lambda: watch.stalls, what="the stall closed by the next tick")
        hold_the_loop(0.05)             # under the threshold: not a stall
        await until(lambda: sum(e["event"] == "event_loop_resumed" for e in logs) == 1,
                    what="the resume logged")
    blocked = [e for e in logs if e["event"] == "event_loop_blocked"]
    assert len(blocked) == 1 and "hold_the_loop" in blocked[0]["stack"]
    assert len(watch.stalls) == 1 and 1.0 <= watch.stalls[0] < 3.0
