"""One engine's FIFO of requests on the node: what both in-process ports are built on.

The node's attempt puts a request here once the engine may take it; the engine takes the
next one (``try_next`` / ``_next``) or, behind a P/D router, the one it was sent
(``take(request_id)``, docs/engine-api.md "Claim by request id"). A request dropped while
queued is never handed out: the queue releases it for the engine. The roles differ only in
what "dropped" and "release" mean (the hooks below).

The port is also how an in-process engine tells its node that its collectives run
(``collective_begin`` / ``collective_end``): the node's :class:`~.collectives.Collectives`,
handed in by the node service, caps KV egress meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, Protocol, TypeVar

from common.errors import Cancelled

from .collectives import Collectives


class _Info(Protocol):
    @property
    def attempt(self) -> int: ...


class _Request(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def info(self) -> _Info: ...


R = TypeVar("R", bound=_Request)


class RequestQueue(Generic[R]):
    """Requests handed to engine ``engine_id``, FIFO, with claim by id and arrival waits."""

    _role = "engine"          # named in the closed-port error

    def __init__(self, engine_id: str, collectives: Collectives | None = None) -> None:
        self.engine_id = engine_id
        self.collectives = collectives if collectives is not None else Collectives(None)
        self._queue: deque[R] = deque()
        self._ready = asyncio.Event()
        self._arrived = asyncio.Event()      # replaced on every arrival: claim waiters
        self.closed = False

    # hooks: what a role's requests need
    def _live(self, item: R) -> bool:
        """False for a request that was dropped while queued."""
        raise NotImplementedError

    def _release(self, item: R) -> None:
        """A dropped request the engine never started: release it for the engine."""
        raise NotImplementedError

    def _taken_back(self, item: R) -> None:
        """``item`` left the queue without reaching the engine (discard)."""

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, item: R) -> None:
        """Node side: the request is ready for this engine."""
        self._queue.append(item)
        self._ready.set()
        self._note_arrival()

    def discard(self, item: R) -> bool:
        """Take a request back before the engine got it (True: the engine never saw it)."""
        try:
            self._queue.remove(item)
        except ValueError:
            return False
        self._taken_back(item)
        return True

    def attempts_of(self, request_id: str) -> list[int]:
        """The attempts of ``request_id`` queued here and live."""
        return [item.info.attempt for item in self._queue
                if item.request_id == request_id and self._live(item)]

    def take(self, request_id: str, attempt: int | None = None) -> R | None:
        """Remove and return the queued live request ``request_id`` (its attempt ``attempt``
        when given; None: not queued here, yet or any more)."""
        for item in self._queue:
            if item.request_id == request_id and self._live(item) and (
                    attempt is None or item.info.attempt == attempt):
                self._queue.remove(item)
                return item
        return None

    def try_next(self) -> R | None:
        """The next live request without waiting (dropped ones are released on the way)."""
        while self._queue:
            item = self._queue.popleft()
            if self._live(item):
                return item
            self._release(item)
        self._ready.clear()
        return None

    async def _next(self) -> R:
        """Wait for the next live request (Cancelled once the queue is closed)."""
        while True:
            if self.closed:
                raise Cancelled(f"{self._role} port of {self.engine_id} is closed")
            item = self.try_next()
            if item is not None:
                return item
            await self._ready.wait()

    async def wait_arrival(self, timeout_s: float) -> None:
        """Return after the next arrival (or the queue's close), or after ``timeout_s``."""
        event = self._arrived
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass

    async def collective_begin(self) -> None:
        """This engine enters a collective: the node caps KV egress until the end."""
        self.collectives.begin(self.engine_id)

    async def collective_end(self) -> None:
        """This engine left the collective it began."""
        self.collectives.end(self.engine_id)

    def close(self) -> None:
        self.closed = True
        self.collectives.end_all(self.engine_id, f"{self._role} port closed")
        self._ready.set()
        self._note_arrival()

    def _note_arrival(self) -> None:
        self._arrived.set()
        self._arrived = asyncio.Event()


def release_soon(coro) -> None:
    """Run a release (an attempt's fail) in the background; the attempt logs its failures."""
    asyncio.get_running_loop().create_task(coro).add_done_callback(_quiet)


def _quiet(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
