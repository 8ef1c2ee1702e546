"""The in-process cluster's loop watchdog names the code that held the shared loop."""

from __future__ import annotations

import ctypes
import os
import time

from structlog.testing import capture_logs

from tests.helpers import until
from tools.cluster.loop_watch import LOOP_STALLS_FILE, watching


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
    # what the kernel said: the loop thread slept in it (nanosleep), using no CPU meanwhile
    resumed = next(e for e in logs if e["event"] == "event_loop_resumed")
    assert resumed["state"] == "S" and "sleep" in resumed["wchan"], resumed
    assert 0 <= resumed["cpu_s"] < 0.5 and resumed["runqueue_s"] >= 0, resumed
    assert "sleep" in resumed.get("kernel_stack", "nanosleep"), resumed   # root only
    assert blocked[0]["kernel"]["state"] == "S", blocked[0]


def spin_the_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def test_a_loop_that_computes_is_told_from_one_that_sleeps():
    """A stall spent computing: the loop thread's CPU and run-queue seconds over the
    measured window add up to (nearly) all of it, where a sleeping loop thread's stay near 0
    (the test above)."""
    with capture_logs() as logs, watching(threshold_s=0.3) as watch:
        spin_the_loop(1.2)
        await until(lambda: any(e["event"] == "event_loop_resumed" for e in logs),
                    what="the resume logged")
    resumed = next(e for e in logs if e["event"] == "event_loop_resumed")
    # a spinning thread is on a CPU or waiting for one for all of the measured window, but
    # for the moments the watcher holds the GIL
    assert resumed["measured_s"] <= watch.stalls[0], (resumed, watch.stalls)
    assert resumed["cpu_s"] + resumed["runqueue_s"] >= 0.8 * resumed["measured_s"], resumed
    assert resumed["state"] == "R", resumed          # sampled while it spun
    # what the machine's CPUs did meanwhile: all of them, every second of the window, once
    # (USER_HZ ticks); the spinning thread kept one busy, or waited for another's work or
    # for the hypervisor
    host, cpus = resumed["host_cpu_s"], resumed["host_cpus"]
    assert set(host) == {"busy", "idle", "iowait", "steal"} and cpus >= 1, resumed
    assert 0.5 <= sum(host.values()) / (cpus * resumed["measured_s"]) <= 1.5, resumed
    assert host["busy"] + host["steal"] >= 0.5 * resumed["measured_s"], resumed
    # and who used them: this process (the spinning loop thread) among the top users
    assert any(line.split()[1] == str(os.getpid()) for line in resumed["top_cpu"]), resumed


def hold_the_loop_and_the_gil(seconds: float) -> None:
    """A C call that keeps the GIL while it blocks (``PyDLL``: ctypes does not release it):
    the Python watcher thread cannot run until it returns."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


async def test_a_loop_stuck_in_a_c_call_holding_the_gil_gets_every_stack_dumped(tmp_path):
    """What CI once saw (a 40-s stall reported only at its end, with the stack of wherever
    the loop was by then): the C watchdog writes the stacks during the stall, GIL or not."""
    dump = tmp_path / LOOP_STALLS_FILE
    with capture_logs() as logs, watching(threshold_s=0.3, dump_to=dump,
                                          dump_after_s=0.3) as watch:
        hold_the_loop_and_the_gil(3.0)
        await until(lambda: watch.stalls, what="the stall closed by the next tick")
    text = dump.read_text()
    assert "hold_the_loop_and_the_gil" in text and "the loop stood still" in text, text
    assert "test_a_loop_stuck_in_a_c_call" in text         # the caller's frame too
    # the Python watcher saw the stall only once the C call had returned
    assert len(watch.stalls) == 1 and watch.stalls[0] >= 2.5
    events = sorted(e["event"] for e in logs if e["event"].startswith("event_loop"))
    assert events == ["event_loop_blocked", "event_loop_resumed"], events
