"""Which attached engines have gone silent: a stopped or frozen engine process is detached.

An engine attached over the node's socket holds requests and pages. A process that dies closes
its socket and the node detaches it at once; a process that stops without dying (SIGSTOP, a
frozen cgroup, a host thrashing its memory) keeps the socket open, so without this its requests
waited for their deadline and the scheduler kept placing on it. The engine's client sends
``EngineAlive`` every ``heartbeat_s`` from its own event loop (a thread of the engine process
in vLLM), and any call counts too; an engine the node has not heard from for ``silence_s`` is
handed to ``on_silent`` (the server detaches it: requests fail retryable and re-plan).

An engine whose process runs but whose step does not end (a hung GPU kernel, a deadlocked
collective, while its client's thread still beats) is seen another way: the engine marks its
steps on a :class:`StepClock`, each beat carries how long the current step has run
(``EngineAlive.busy_s``), and the server takes an engine past ``engine_stuck_s`` out of
service until a beat shows it out of that step (docs/engine-api.md, "A stuck engine").

The node's own loop may stand still too (a loaded host): heartbeats then wait unread in the
socket, and judging silence right after would detach every engine. A tick that comes late by
more than a heartbeat credits every engine with having been heard now (the scheduler extends
node leases the same way after its own stall).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

K = TypeVar("K")

HEARTBEAT_MAX_S = 1.0      # an engine's heartbeat interval: silence_s / 5, at most this


class StepClock:
    """When the engine's current step began (None: not in a step). The engine's own thread
    marks its steps; its client's heartbeat, on another thread, reads ``busy_s()`` (a float
    or None stored in one attribute: atomic under the GIL, no lock on the step's path)."""

    def __init__(self) -> None:
        self._began: float | None = None
        self.count = 0                  # steps begun (only the engine's thread writes it)

    def began(self) -> None:
        self._began = time.monotonic()
        self.count += 1

    def ended(self) -> None:
        self._began = None

    def busy_s(self) -> float:
        """How long the current step has run; 0 when the engine is not in a step."""
        began = self._began
        return 0.0 if began is None else max(time.monotonic() - began, 0.0)


def heartbeat_interval(silence_s: float) -> float:
    """How often an engine must speak so that ``silence_s`` spans several beats (0: off)."""
    return min(HEARTBEAT_MAX_S, silence_s / 5) if silence_s > 0 else 0.0


class SilenceWatch(Generic[K]):
    """Tracks when each engine was last heard; ``on_silent(key, silent_s)`` once one is past
    ``silence_s`` (then it is forgotten: heard again, it is watched again)."""

    def __init__(self, silence_s: float, on_silent: Callable[[K, float], Awaitable[None]], *,
                 name: str = "") -> None:
        self.silence_s = silence_s
        self.heartbeat_s = heartbeat_interval(silence_s)
        self._on_silent = on_silent
        self._name = name
        self._heard: dict[K, float] = {}
        self._task: asyncio.Task[None] | None = None
        self.counters = {"engines_silent": 0, "silence_watch_credits": 0}

    @property
    def enabled(self) -> bool:
        return self.silence_s > 0

    def heard(self, key: K) -> None:
        if self.enabled:
            self._heard[key] = asyncio.get_running_loop().time()

    def forget(self, key: K) -> None:
        self._heard.pop(key, None)

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"silence-watch-{self._name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        tick = self.heartbeat_s
        due = loop.time() + tick
        while True:
            await asyncio.sleep(max(due - loop.time(), 0.0))
            now = loop.time()
            late = now - due
            due = now + tick
            if late > tick:                 # this loop stood still: nobody could be heard
                self.counters["silence_watch_credits"] += 1
                for key in self._heard:
                    self._heard[key] = now
                continue
            for key in [k for k, t in self._heard.items() if now - t > self.silence_s]:
                silent_s = now - self._heard.pop(key)
                self.counters["engines_silent"] += 1
                try:
                    await self._on_silent(key, silent_s)
                except Exception:           # one engine's detach must not stop the watch
                    log.exception("engine_silent_detach_failed", node=self._name)
