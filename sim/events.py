"""The event loop: a heap of ``(time, seq, fn, arg)``; simulated time only, never the wall clock.

``seq`` breaks ties in scheduling order, so equal-time events run first-scheduled-first and a run
is a pure function of its inputs. Hot callers (flows, decode engines) push onto ``heap`` directly
with ``next(seq)`` — the same entry ``at`` makes, without the extra call — and never earlier
than ``now``. Handlers that may be superseded (a flow whose rate changed, a
decode engine whose batch changed) check a stored due time on arrival and ignore stale events,
which is cheaper than deleting from the heap.
"""

from __future__ import annotations

from heapq import heappop, heappush
from itertools import count
from typing import Any, Callable


class EventLoop:
    __slots__ = ("now", "heap", "seq", "events", "stopped")

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self.seq = count()
        self.events = 0
        self.stopped = False

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at simulated time ``t`` (never earlier than now)."""
        heappush(self.heap, (t if t > self.now else self.now, next(self.seq), fn, arg))

    def after(self, dt: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self.at(self.now + dt, fn, arg)

    def stop(self) -> None:
        self.stopped = True

    def run(self, until: float = float("inf")) -> None:
        """Process events in time order until the heap is empty, ``until`` or ``stop()``."""
        heap = self.heap
        pop = heappop
        n = 0
        try:
            if until == float("inf"):
                while heap and not self.stopped:
                    t, _, fn, arg = pop(heap)
                    self.now = t
                    fn(arg)
                    n += 1
            else:
                while heap and not self.stopped:
                    if heap[0][0] > until:
                        break
                    t, _, fn, arg = pop(heap)
                    self.now = t
                    fn(arg)
                    n += 1
        finally:
            self.events += n
