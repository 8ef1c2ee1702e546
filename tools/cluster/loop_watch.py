"""Who held the loop: a watchdog thread for clusters that share one event loop.

An in-process cluster (:mod:`tools.cluster.inprocess`) runs every service in the caller's
loop, so one synchronous stretch anywhere — a copy, a checksum, a blocking call — stops all
of them at once: heartbeats, transfers, the scheduler's sweeps. The scheduler no longer holds
such a stall against its nodes (``SchedulerService._lease_loop``), but the stall itself is a
defect worth finding. :class:`LoopStallWatch` ticks in the loop every ``tick_s``; a thread
checks the last tick and, when the loop has not run for ``threshold_s``, logs
``event_loop_blocked`` once per stall with the loop thread's stack at that moment (the code
holding it) and, when the loop runs again, ``event_loop_resumed`` with the stall's length.
``stalls`` keeps every stall's length for a test or tool to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Iterator

import structlog

log = structlog.get_logger("loop_watch")


class LoopStallWatch:
    """Report the stack of a loop thread that stopped running callbacks (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, threshold_s: float = 1.0,
                 tick_s: float = 0.1) -> None:
        self.loop, self.threshold_s, self.tick_s = loop, threshold_s, tick_s
        self.stalls: list[float] = []            # seconds, one per stall past the threshold
        self._last = time.monotonic()
        self._blocked_since: float | None = None
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._handle: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._watch, name="loop-stall-watch",
                                        daemon=True)

    def start(self) -> None:
        """Start from the loop's own thread (its stack is the one reported)."""
        self._loop_thread = threading.get_ident()
        self._tick()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        self._thread.join(timeout=5 * self.tick_s + 1.0)

    def _tick(self) -> None:
        now = time.monotonic()
        since = self._blocked_since
        if since is not None:                     # the watcher saw this stall: close it
            self._blocked_since = None
            self.stalls.append(now - since)
            log.warning("event_loop_resumed", stalled_s=round(self.stalls[-1], 3))
        self._last = now
        self._handle = self.loop.call_later(self.tick_s, self._tick)

    def _watch(self) -> None:
        while not self._stop.wait(self.tick_s):
            idle = time.monotonic() - self._last
            if idle < self.threshold_s or self._blocked_since is not None:
                continue
            self._blocked_since = self._last          # the stall began at the last tick
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            log.warning("event_loop_blocked", blocked_s=round(idle, 3), stack=stack)


@contextlib.contextmanager
def watching(threshold_s: float = 1.0) -> Iterator[LoopStallWatch]:
    """Watch the running loop for the ``with`` block (call from inside the loop)."""
    watch = LoopStallWatch(asyncio.get_running_loop(), threshold_s=threshold_s)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()
