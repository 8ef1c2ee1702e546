"""The in-process cluster's loop watchdog names the code that held the shared loop."""

from __future__ import annotations

import ctypes
import time

from structlog.testing import capture_logs

from tests.helpers import until
from tools.cluster.loop_watch import (LOOP_STALLS_FILE, TOP_CPU_USERS, top_cpu_users,
                                      watching)
from tools.host_sampler import TICKS_PER_S


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


READING_S = 0.02                        # the watcher's /proc readings at each end
TICK_S = 1 / TICKS_PER_S                # /proc/stat's clock tick


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
    # (the window runs from the watcher's first reading, which a loaded host can delay to
    # just before the resume: CI once had the readings 0.77 s after the detection, within
    # one clock tick of the resume; READING_S allows for the readings themselves)
    window = resumed["measured_s"]
    assert window <= watch.stalls[0], (resumed, watch.stalls)
    assert resumed["cpu_s"] + resumed["runqueue_s"] >= 0.8 * window - READING_S, resumed
    assert resumed["state"] == "R", resumed          # sampled while it spun
    # what the machine's CPUs did meanwhile, over the span its own counters measure (their
    # sum over the CPUs: elapsed seconds; a tick per CPU at each end): inside the stall, and
    # at least half of it busy or stolen, since the loop thread spun or waited for a CPU
    # the whole time
    host, cpus = resumed["host_cpu_s"], resumed["host_cpus"]   # read with cpu_s, at once
    assert set(host) == {"busy", "idle", "iowait", "steal"} and cpus >= 1, resumed
    ticks = 2 * cpus * TICK_S
    span = sum(host.values()) / cpus
    assert 0 <= span <= watch.stalls[0] + ticks, resumed
    assert host["busy"] + host["steal"] >= 0.5 * span - ticks, resumed
    # and who used them, most first, no more CPU seconds than the CPUs had (this process is
    # among them unless a loaded host kept its loop thread off the CPUs the whole span)
    # (top_cpu only where the watcher's process scan, a few hundred files, ended before the
    # resume: under load it may not)
    used = [float(line.split()[0]) for line in resumed.get("top_cpu", [])]
    assert used == sorted(used, reverse=True) and len(used) <= TOP_CPU_USERS, resumed
    assert sum(used) <= cpus * watch.stalls[0] + ticks, resumed


def test_the_top_cpu_users_are_the_largest_differences_of_two_snapshots():
    before = {1: ("init", 100, 0), 7: ("idle", 50, 0), 8: ("spin", 0, 0), 9: ("gone", 5, 0)}
    after = {1: ("init", 101, 0), 7: ("idle", 50, 0), 8: ("spin", 90, 3), 10: ("new", 40, 0),
             **{20 + i: (f"w{i}", 10 + i, 0) for i in range(6)}}
    before.update({20 + i: (f"w{i}", 10, 0) for i in range(6)})
    got = top_cpu_users(before, after, n=3)
    # differences in clock ticks: spin 90, w5 5, w4 4 (a process born or gone meanwhile has
    # no difference, one that used nothing is left out)
    assert [line.split()[:2] for line in got] == [
        [f"{90 / TICKS_PER_S:.2f}", "8"], [f"{5 / TICKS_PER_S:.2f}", "25"],
        [f"{4 / TICKS_PER_S:.2f}", "24"]], got
    assert top_cpu_users(before, before) == []


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
