"""The sub-tasks of one attempt on a node: spawned, guarded, counted and stopped together.

An attempt's handlers start sub-tasks (reads, receive watchers, write-backs) and create
resources (pages, posted receives); its release must stop the first and wait for the second
to unwind before it frees anything (docs/datapath.md, failures).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any

from common.errors import DualpathError
from services.node.errors import copy_error
from services.node.reports import cancel_and_wait

SEND_DRAIN_S = 2.0      # sends in flight may end first: one cancelled mid-way aborts the endpoint


class SubTasks:
    """``error()`` is the attempt's failure: a guarded wait cancelled by it raises a copy."""

    def __init__(self, error: Callable[[], DualpathError | None]) -> None:
        self._error = error
        self.tasks: set[asyncio.Task[Any]] = set()
        self.sending: set[asyncio.Task[Any]] = set()     # layer sends to the peer in flight
        self._busy = 0                    # handler calls that may still create resources
        self._idle = asyncio.Event()
        self._idle.set()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, sending: bool = False) -> asyncio.Task[Any]:
        """Start a sub-task; ``sending``: a send to the peer, which :meth:`stop` lets end."""
        task = asyncio.get_running_loop().create_task(coro)
        owner = self.sending if sending else self.tasks
        owner.add(task)
        task.add_done_callback(owner.discard)
        return task

    async def guard(self, coro: Coroutine[Any, Any, Any],
                    undo: Callable[[Any], object] | None = None) -> Any:
        """Run ``coro`` as a sub-task :meth:`stop` can cancel; its cancellation by a failure
        reaches the caller as the attempt's typed error (an RPC handler then replies it).

        ``undo(result)`` gives back what ``coro`` acquired when the caller itself is
        cancelled after ``coro`` finished but before the caller resumed — asyncio then raises
        ``CancelledError`` in the caller and the result would be lost (pages allocated for a
        ``PrepareDecode`` whose call was cancelled in that instant: the PE died, or gave up).
        """
        task = self.spawn(coro)
        try:
            return await task
        except asyncio.CancelledError:
            if undo is not None and task.done() and not task.cancelled() \
                    and task.exception() is None:
                undo(task.result())
            me, err = asyncio.current_task(), self._error()
            if (me is not None and me.cancelling()) or err is None:
                raise
            raise copy_error(err) from None

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """A handler creating resources (pages, receives): :meth:`stop` waits for it to end."""
        self._busy += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._busy -= 1
            if not self._busy:
                self._idle.set()

    async def send_all(self, coros: Iterable[Coroutine[Any, Any, Any]]) -> None:
        """Run the sends at once as one task; the first failure cancels the rest."""
        task = asyncio.get_running_loop().create_task(_all(coros))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)
        await self.guard(_shielded(task))

    async def stop(self, drain_s: float = SEND_DRAIN_S) -> None:
        """Let the sends end (up to ``drain_s``), cancel every sub-task, wait for the handlers."""
        if self.sending:
            await asyncio.wait(list(self.sending), timeout=drain_s)
        await cancel_and_wait(list(self.tasks) + list(self.sending))
        while self._busy:                     # handlers notice the failure and unwind
            await self._idle.wait()
        await cancel_and_wait(list(self.tasks))


async def _shielded(task: asyncio.Task[Any]) -> None:
    """Wait for ``task`` without cancelling it when the waiter is cancelled."""
    await asyncio.shield(task)


async def _all(coros: Iterable[Coroutine[Any, Any, Any]]) -> None:
    """Await every coroutine concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        await cancel_and_wait([t for t in tasks if not t.done()])
