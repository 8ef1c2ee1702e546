"""The node-attempt driver: how a PE or a DE attempt runs its sans-I/O transfer core.

Both node services run one attempt per (request, attempt) around a core that is fed events and
returns actions (``services/pe_receiver/transfer.py``, ``services/de_loader/transfer.py``). The
asyncio side of that is the same for both, and lives here once:

* **one dispatch table**: every action type a core emits maps to one handler (the actions both
  cores share — :class:`~services.node.actions.Report`, ``Log``, ``Count`` — are handled here,
  the attempt registers its own); an action without a handler is a bug, never skipped.
  :meth:`AttemptDriver.feed` runs an event's actions synchronously; :meth:`feed_async` also
  awaits the handlers that do I/O (posting a receive, waiting for the engine) in order.
* **one task owner**: the attempt's sub-tasks live in one :class:`~services.node.subtasks.SubTasks`
  (spawned, guarded, sends drained, all stopped together on release);
* **one wake-up**: every event fed wakes every waiter, which re-checks the core
  (:meth:`until`); no per-condition events to keep in step with the core's flags;
* **one deadline**: a timer at the attempt's deadline feeds the core's deadline event.

Reports go to the scheduler in order through :class:`~services.node.reports.OrderedReports`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from common.errors import DualpathError, InternalError
from services.node.actions import Count, Log, Report
from services.node.errors import copy_error
from services.node.io import NodeIO
from services.node.reports import OrderedReports
from services.node.subtasks import SubTasks

log = structlog.get_logger(__name__)

Handler = Callable[[Any], Any]       # an action → a result, or a coroutine (feed_async only)


class AttemptDriver:
    """Runs one attempt's core (see the module docstring).

    ``error()`` is the attempt's failure (the core's); ``ending()`` whether it is failing or
    releasing (waiters stop waiting then; default: failed). ``on_deadline`` runs once at
    ``deadline_at`` unless :meth:`cancel_deadline` came first; ``on_stale(stage)`` when the
    scheduler answers a report as no longer current.
    """

    def __init__(self, io: NodeIO, key: tuple[str, int], deadline_at: float, *,
                 handlers: Mapping[type, Handler], error: Callable[[], DualpathError | None],
                 on_deadline: Callable[[], object], on_stale: Callable[[str], object],
                 ending: Callable[[], bool] | None = None) -> None:
        shared: dict[type, Handler] = {Report: self._report, Log: self._log, Count: self._count}
        both = shared.keys() & handlers.keys()
        if both:
            raise InternalError(f"actions handled twice: {sorted(t.__name__ for t in both)}")
        self._table = {**shared, **handlers}
        self._error = error
        self._ending = ending or (lambda: error() is not None)
        self._counters = io.counters
        self.deadline_at = deadline_at
        self.tasks = SubTasks(error)
        self._reports = OrderedReports(io.report, key[0], key[1], on_stale)
        self._pulse = asyncio.Event()
        self._timer = asyncio.get_running_loop().call_at(deadline_at, on_deadline)

    @property
    def remaining(self) -> float:
        """Seconds to the deadline (0 once passed)."""
        return max(0.0, self.deadline_at - asyncio.get_running_loop().time())

    # ------------------------------------------------------------------ events → actions
    def feed(self, event: Callable[..., Any], *args: Any) -> Any:
        """Feed one event to the core and run its actions; returns what the event returned.

        Waiters wake afterwards (even if the event raised: they re-check the core)."""
        try:
            out = event(*args)
            for act in out if isinstance(out, list) else ():
                res = self._table[type(act)](act)
                if inspect.iscoroutine(res):
                    res.close()
                    raise InternalError(f"{type(act).__name__} runs I/O: feed it with "
                                        f"feed_async")
            return out
        finally:
            self.wake()

    async def feed_async(self, event: Callable[..., Any], *args: Any) -> list[Any]:
        """Feed one event; run its actions in order, awaiting those that do I/O. Returns each
        action's handler result (e.g. the slots a posted receive fills)."""
        try:
            out = event(*args)
        finally:
            self.wake()
        results = []
        try:
            for act in out:
                res = self._table[type(act)](act)
                results.append(await res if inspect.iscoroutine(res) else res)
        finally:
            self.wake()
        return results

    def _report(self, act: Report) -> None:
        self._reports.send(act.stage, **act.fields)

    def _log(self, act: Log) -> None:
        getattr(log, act.level)(act.event, **act.fields)

    def _count(self, act: Count) -> None:
        self._counters[act.counter] += 1

    # ------------------------------------------------------------------ waiting
    def wake(self) -> None:
        """The core's state may have moved: every waiter re-checks."""
        self._pulse.set()
        self._pulse = asyncio.Event()

    async def until(self, cond: Callable[[], bool], *, or_failure: bool = True) -> None:
        """Wait until ``cond()`` holds. With ``or_failure`` the wait also ends when the attempt
        is ending, raising (a copy of) its error if it failed."""
        while not cond():
            if or_failure and self._ending():
                err = self._error()
                if err is not None:
                    raise copy_error(err)
                return
            await self._pulse.wait()

    def cancel_deadline(self) -> None:
        self._timer.cancel()

    async def flush_reports(self, timeout_s: float) -> None:
        """Deliver what is queued for the scheduler (bounded), then stop the report task."""
        await self._reports.flush(timeout_s)
