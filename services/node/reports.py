"""Ordered progress reports of one attempt, and cancelling a node's helper tasks.

A node reports each attempt's stages to the scheduler in order (``allocated`` before
``read_done`` …) from one background loop per attempt, so a slow scheduler never blocks the
data path and a report never overtakes an earlier one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from common.protocol import Stage

log = structlog.get_logger(__name__)


async def cancel_and_wait(tasks) -> None:
    """Cancel ``tasks`` (not the caller's own) and wait until every one has ended."""
    me = asyncio.current_task()
    tasks = [t for t in tasks if t is not me]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for t in tasks:
        if not t.cancelled():
            t.exception()       # retrieved: the owner reported what mattered


class OrderedReports:
    """Progress reports of one attempt, sent in order by one background task.

    ``report(request_id, attempt, stage, **fields)`` sends one (the node's channel to the
    scheduler; False: the attempt is no longer current, and ``on_stale(stage)`` runs).
    ``flush()`` waits (bounded) until everything queued was sent, then stops.
    """

    def __init__(self, report: Callable[..., Awaitable[bool]], request_id: str, attempt: int,
                 on_stale: Callable[[str], object]) -> None:
        self._report, self._rid, self._attempt, self._on_stale = \
            report, request_id, attempt, on_stale
        # bounded: an attempt reports each of the 8 stages at most once
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=16)
        self._task: asyncio.Task | None = None

    def send(self, stage: Stage, **kw: Any) -> None:
        self._queue.put_nowait((stage, kw))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            stage, kw = await self._queue.get()
            try:
                if not await self._report(self._rid, self._attempt, stage, **kw) \
                        and stage not in ("failed", "finished", "dropped"):
                    self._on_stale(stage)
            finally:
                self._queue.task_done()

    async def flush(self, timeout_s: float) -> None:
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            log.warning("reports_not_delivered", request_id=self._rid, attempt=self._attempt)
        await cancel_and_wait([self._task])


async def both(a: Any, b: Any) -> tuple[Any, Any]:
    """Run two coroutines concurrently; the first failure cancels the other and is raised."""
    ta, tb = asyncio.ensure_future(a), asyncio.ensure_future(b)
    try:
        await asyncio.wait({ta, tb}, return_when=asyncio.FIRST_EXCEPTION)
        for t in (ta, tb):
            exc = t.exception() if t.done() and not t.cancelled() else None
            if exc is not None:
                raise exc
        return await ta, await tb
    finally:
        await cancel_and_wait([t for t in (ta, tb) if not t.done()])

