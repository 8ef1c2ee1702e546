"""The node's watch for silent engines (``services.engine_api.liveness``): an engine not heard
from for ``silence_s`` is handed over once; one heard regularly never is; a stall of the
node's own loop is not taken for the engines' silence. The end-to-end case (an engine process
SIGSTOPped holding a request) is in tests/test_engine_ipc.py."""

from __future__ import annotations

import asyncio
import time

from services.engine_api.liveness import HEARTBEAT_MAX_S, SilenceWatch, StepClock, heartbeat_interval
from tests.helpers import poll, until


def test_the_heartbeat_spans_several_beats_per_silence():
    assert heartbeat_interval(0.0) == 0.0                     # off
    assert heartbeat_interval(0.5) == 0.1
    assert heartbeat_interval(15.0) == HEARTBEAT_MAX_S == 1.0


async def watched(silence_s: float) -> tuple[SilenceWatch[str], list[tuple[str, float]]]:
    silent: list[tuple[str, float]] = []

    async def on_silent(key: str, silent_s: float) -> None:
        silent.append((key, silent_s))

    watch: SilenceWatch[str] = SilenceWatch(silence_s, on_silent, name="n0")
    watch.start()
    return watch, silent


async def test_a_silent_engine_is_handed_over_once_and_a_talking_one_never():
    watch, silent = await watched(0.3)
    watch.heard("quiet")
    watch.heard("talking")

    async def talk() -> None:
        while True:
            watch.heard("talking")
            await asyncio.sleep(0.05)

    talker = asyncio.ensure_future(talk())
    try:
        await until(lambda: silent, timeout=5.0, what="the quiet engine reported")
        assert "quiet" not in watch._heard       # forgotten: reported once
        assert "talking" in watch._heard
    finally:
        talker.cancel()
        await watch.stop()
    assert [k for k, _ in silent] == ["quiet"] and silent[0][1] > 0.3
    assert watch.counters["engines_silent"] == 1


async def test_a_stall_of_the_nodes_own_loop_is_not_the_engines_silence():
    watch, silent = await watched(0.3)
    try:
        watch.heard("e0")
        await asyncio.sleep(0.1)                 # the watch is ticking
        time.sleep(0.6)                          # the node's loop stands still past silence_s
        await until(lambda: watch.counters["silence_watch_credits"] >= 1, timeout=5.0,
                    what="the late tick credited")
        assert silent == []                      # its heartbeats would be waiting unread
        await until(lambda: silent, timeout=5.0, what="silent after the credit runs out")
    finally:
        await watch.stop()
    assert [k for k, _ in silent] == ["e0"]


async def test_a_watch_with_no_silence_never_runs():
    watch, silent = await watched(0.0)
    watch.heard("e0")
    assert not watch.enabled and watch.heartbeat_s == 0.0 and watch._task is None
    await watch.stop()


def test_the_step_clock_says_how_long_the_current_step_has_run():
    clock = StepClock()
    assert clock.busy_s() == 0.0                 # not in a step
    clock.began()
    t = time.monotonic()
    assert poll(lambda: clock.busy_s() >= 0.01, 5.0)
    assert 0.01 <= clock.busy_s() <= time.monotonic() - t + 0.01
    clock.ended()
    assert clock.busy_s() == 0.0 and clock.count == 1
