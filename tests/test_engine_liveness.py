"""Engines that stop or hang without dying (docs/engine-api.md, "A silent engine", "A stuck
engine"). The node's watch (``services.engine_api.liveness``): an engine not heard from for
``silence_s`` is handed over once; one heard regularly never is; a stall of the node's own
loop is not taken for the engines' silence. End to end, over the engine socket: an engine
process SIGSTOPped holding a request, and an engine whose step does not end."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import pytest

from common.errors import OutOfService
from common.protocol import RequestFinished
from services.engine_api.liveness import HEARTBEAT_MAX_S, SilenceWatch, StepClock, heartbeat_interval
from services.engine_api.remote import EngineClient
from services.scheduler.client.client import SchedulerClient
from tests.helpers import poll, until
from tests.test_datapath import BT, no_leaks, tokens
from tests.test_engine_ipc import engine_proc, finished, holding, sockets
from tools.cluster.emulated import attach_remote_engines
from tools.cluster.inprocess import local_datapath
from tools.engine_sim.kv_pattern import fill_tokens


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


@pytest.mark.reliability
async def test_a_stopped_engine_is_detached_and_its_request_finishes_on_a_new_one(
        tmp_path, reliability):
    """SIGSTOP mid-request: the process lives and its socket stays open, but it says nothing.
    After ``engine_silence_s`` the node detaches it (its request fails retryable, re-plans
    once, naming the silence) and closes its connection; a new engine under the same id
    finishes the request."""
    ov = sockets(tmp_path)
    ov["pe_receiver"].update(engine_silence_s=3.0, engine_release_timeout_s=3.0)
    async with local_datapath(tmp_path, engines=False, overrides=ov) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched, \
            contextlib.AsyncExitStack() as stack:
        pe, spec = c.pe["p0"], c.spec
        await attach_remote_engines(stack, c.de["d0"], c.cfg)
        holder, run = await holding(stack, sched, tmp_path / "p0.sock", spec, "s1")
        first = c.scheduler.core.attempt_base
        holder.send_signal(signal.SIGSTOP)
        await until(lambda: pe.engine_api.counters["detaches"] == 1
                    and not pe.engine_api.sessions, timeout=20.0,
                    what="the stopped engine detached")
        stats = pe.engine_api.stats()
        assert stats["engines_silent"] == 1 and stats["requests_failed_on_detach"] == 1
        # the stopped process may run again and write into the pages it was handed: they
        # stay held (not reused) until engine_release_timeout_s, then are freed
        assert any(a.info.attempt == first for a in pe.attempts.values())
        assert pe.pool.used_pages > 0
        await until(lambda: not any(a.info.attempt == first for a in pe.attempts.values()),
                    what="the first attempt released after engine_release_timeout_s")
        restarted = await engine_proc("prefill", tmp_path / "p0.sock", "p0.e0", spec,
                                      tmp_path / "pe.npz")
        ev = await asyncio.wait_for(run, 60)
        await finished(restarted)
        assert isinstance(ev, RequestFinished) and ev.attempt == first + 1, ev
        gone = ev.attempts[0]
        assert (gone.hop, gone.code) == ("engine", "PEER_FAILED") and "silent for" in \
            gone.message, gone
        assert pe.engine_api.stats()["engines_silent"] == 1    # the new engine kept talking
        await no_leaks(c)
    reliability.record("fault", "SIGSTOP an engine process holding a prefill request",
                       "detached after engine_silence_s (3 s), re-planned once, finished by "
                       "a new engine under the same id", lost=0, leaked_pages=0)


@pytest.mark.reliability
async def test_a_stuck_engine_leaves_service_and_returns_once_its_step_ends(
        tmp_path, reliability):
    """The engine's process runs and beats, but its step does not end (a hung kernel): past
    ``engine_stuck_s`` the node fails what it held (re-planned once, naming the stuck step)
    and reports it not attached, so nothing is placed on it and its own calls for work are
    refused; once a beat shows the step ended it is attached again under a new attachment
    number, gets the re-planned request and finishes it."""
    ov = sockets(tmp_path)      # no silence watch: the stuck check alone sets the beat
    ov["pe_receiver"].update(engine_stuck_s=1.0, engine_release_timeout_s=2.0,
                             engine_silence_s=0.0)
    async with local_datapath(tmp_path, engines=False, overrides=ov) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched, \
            contextlib.AsyncExitStack() as stack:
        spec, api = c.spec, c.pe["p0"].engine_api
        await attach_remote_engines(stack, c.de["d0"], c.cfg)
        steps = StepClock()
        eng = await EngineClient.connect(str(tmp_path / "p0.sock"), engine_id="p0.e0",
                                         role="prefill", kv_spec=spec, steps=steps)
        stack.push_async_callback(eng.close)
        toks = tokens(2 * BT + 30, 3)
        run = asyncio.ensure_future(sched.run("st1", "sst", len(toks), 3, token_ids=toks,
                                              deadline_s=60))
        stack.callback(run.cancel)
        held = await eng.next_prefill(30.0)
        assert held is not None and held.request_id == "st1"
        first = held.info.attempt
        steps.began()                                   # the step that does not end
        await until(lambda: api.counters["engines_stuck"] == 1 and "p0.e0" not in api.sessions,
                    timeout=20.0, what="the stuck engine out of service")
        assert api.counters["requests_failed_on_detach"] == 1
        await until(lambda: api.stats()["engine_steps"] == 1, what="its beats count its step")
        await until(lambda: "p0.e0" not in {r.engine_id for r in
                                            c.scheduler.core.engine_reports()},
                    what="the scheduler took the stuck engine out of placement")
        with pytest.raises(OutOfService, match="out of service"):
            await eng.next_prefill(0.0)
        steps.ended()                                   # the step ended: back in service
        await until(lambda: "p0.e0" in api.sessions, timeout=20.0, what="attached again")
        assert api.attach_counts["p0.e0"] == 2 and api.counters["engines_unstuck"] == 1
        h = await eng.next_prefill(30.0)
        assert h is not None and (h.request_id, h.info.attempt) == ("st1", first + 1)
        info = h.info
        for layer in range(spec.num_layers):
            await h.layer(layer, 10.0)
            fill_tokens(h.output(layer), spec, info.block_keys, info.tail_key, layer,
                        h.hit_tokens, info.prompt_tokens)
            await h.put_layer(layer)
        await h.finish(11)
        ev = await asyncio.wait_for(run, 60)
        assert isinstance(ev, RequestFinished) and ev.attempt == first + 1, ev
        gone = ev.attempts[0]
        assert (gone.hop, gone.code) == ("engine", "PEER_FAILED") and "stuck" in \
            gone.message, gone
        await no_leaks(c)
    reliability.record("fault", "an engine whose step never ends (process alive, beating)",
                       "out of service after engine_stuck_s (1 s): request re-planned once, "
                       "engine back under a new attachment once its step ended, finished",
                       lost=0, leaked_pages=0)
