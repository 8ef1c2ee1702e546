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

That watcher is a Python thread: it needs the GIL, so a loop thread stuck *inside a C call
that holds the GIL* (a blocking call in an extension) stops it too, and it can only report
the stall afterwards, with the stack of wherever the loop thread is by then (seen in CI: a
40-s stall reported at its end). So the watch also re-arms ``faulthandler``'s C watchdog on
every tick (``dump_to``): a loop that has not ticked for ``dump_after_s`` gets every
thread's Python stack written to that file *during* the stall, without the GIL. The C
watchdog is one per process: the last watch started owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import structlog

log = structlog.get_logger("loop_watch")

# where an in-process cluster's stall dumps go, in its root (tools/cluster/inprocess.py); a
# failed real-engine test's report carries its tail (tests/log_digest.py)
LOOP_STALLS_FILE = "loop-stalls.log"


class LoopStallWatch:
    """Report the stack of a loop thread that stopped running callbacks (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, threshold_s: float = 1.0,
                 tick_s: float = 0.1, dump_to: Path | None = None,
                 dump_after_s: float = 10.0) -> None:
        self.loop, self.threshold_s, self.tick_s = loop, threshold_s, tick_s
        self.dump_to, self.dump_after_s = dump_to, dump_after_s
        self._dump_file: IO[str] | None = None
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
        if self.dump_to is not None:
            self._dump_file = open(self.dump_to, "a")     # noqa: SIM115 -- closed in stop()
        self._tick()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._dump_file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._dump_file.close()
            self._dump_file = None
        self._thread.join(timeout=5 * self.tick_s + 1.0)

    def _tick(self) -> None:
        now = time.monotonic()
        since = self._blocked_since
        if since is not None:                     # the watcher saw this stall: close it
            self._blocked_since = None
            self.stalls.append(now - since)
            log.warning("event_loop_resumed", stalled_s=round(self.stalls[-1], 3))
        self._last = now
        if self._dump_file is not None:        # the loop ran: push the C watchdog back
            faulthandler.dump_traceback_later(self.dump_after_s, file=self._dump_file)
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
def watching(threshold_s: float = 1.0, dump_to: Path | None = None,
             dump_after_s: float = 10.0) -> Iterator[LoopStallWatch]:
    """Watch the running loop for the ``with`` block (call from inside the loop);
    ``dump_to``: where every thread's stack goes when the loop stalls ``dump_after_s``."""
    watch = LoopStallWatch(asyncio.get_running_loop(), threshold_s=threshold_s,
                           dump_to=dump_to, dump_after_s=dump_after_s)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()
