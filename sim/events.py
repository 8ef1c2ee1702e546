"""The event loop: a heap of event times, each with its callbacks in scheduling order; simulated
time only, never the wall clock.

Events at the same time run first-scheduled-first, so a run is a pure function of its inputs:
``pending[t]`` is a flat list ``[fn, arg, fn, arg, …]`` appended to in scheduling order, and
``heap`` holds each pending time once. An event scheduled for the time being processed lands in a
fresh list and runs after the current one (its time is pushed again). Keying the heap by bare
floats rather than ``(time, seq, fn, arg)`` tuples makes every heap comparison one float
comparison; at 1,152 GPUs the heap holds ~1,000 entries, mostly cold in the CPU cache, and
sifting tuples was ~7 % of the run.

Hot callers (flows, decode engines) schedule inline with ``pending.get``/``heappush`` — what
``at`` does, without the extra call — and never earlier than ``now``. Handlers that may be
superseded (a flow whose rate changed, a decode engine whose batch changed) check a stored due
time on arrival and ignore stale events, which is cheaper than deleting from the heap.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import Any, Callable


class EventLoop:
    __slots__ = ("now", "heap", "pending", "events", "stopped")

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[float] = []
        self.pending: dict[float, list] = {}
        self.events = 0
        self.stopped = False

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at simulated time ``t`` (never earlier than now)."""
        if t < self.now:
            t = self.now
        lst = self.pending.get(t)
        if lst is None:
            self.pending[t] = [fn, arg]
            heappush(self.heap, t)
        else:
            lst.append(fn)
            lst.append(arg)

    def after(self, dt: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self.at(self.now + dt, fn, arg)

    def next_time(self) -> float | None:
        """Time of the next pending event, or None when there is none."""
        return self.heap[0] if self.heap else None

    def stop(self) -> None:
        self.stopped = True

    def run(self, until: float = float("inf")) -> None:
        """Process events in time order until none is left, ``until`` or ``stop()``."""
        heap, pending = self.heap, self.pending
        pop = heappop
        n = 0
        try:
            while heap and not self.stopped:
                if heap[0] > until:
                    break
                t = pop(heap)
                lst = pending.pop(t)
                self.now = t
                if len(lst) == 2:
                    n += 1
                    lst[0](lst[1])
                    continue
                for i in range(0, len(lst), 2):
                    if self.stopped:          # keep the rest, ahead of anything added since
                        rest = lst[i:]
                        later = pending.get(t)
                        if later is None:
                            heappush(heap, t)
                        else:
                            rest += later
                        pending[t] = rest
                        break
                    n += 1
                    lst[i](lst[i + 1])
        finally:
            self.events += n
