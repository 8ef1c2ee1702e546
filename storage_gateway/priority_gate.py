"""A bounded set of slots handed out lowest order key first: who the link and the I/O serve next.

The gateway's reads share two scarce things: the storage link (the emulated SNIC's token
bucket, one chunk crossing at a time) and its I/O jobs in flight. Handed out in the order
the askers asked (equal keys: ``[gateway] read_order = "shared"``), every request admitted
at once progresses together and they all end together (processor sharing). Handed out by the
*request's* arrival order (``"arrival"``, the default), the earliest request takes what it
can use and ends first, the next one after it: the same bytes per second, but the first hit is
complete after one hit's read instead of after all of them (docs/storage.md, "Read order").

Waiters with equal keys enter in the order they asked. A waiter cancelled while waiting
leaves no slot taken; one cancelled right after its slot was granted gives it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator


class PriorityGate:
    """At most ``capacity`` holders; a freed slot goes to the waiter with the lowest key."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._held = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def held(self) -> int:
        return self._held

    @property
    def n_waiting(self) -> int:
        return sum(not fut.done() for _, _, fut in self._waiting)

    @contextlib.asynccontextmanager
    async def slot(self, key: int) -> AsyncIterator[Turn]:
        """Hold one slot for the body; ``key``: lower is served first. The body may hand the
        slot on between two pieces of its work with ``await turn.yield_to_earlier()``."""
        turn = Turn(self, key)
        await self.acquire(key)
        turn.held = True
        try:
            yield turn
        finally:
            if turn.held:
                self.release()

    def first_waiting_key(self) -> int | None:
        """The lowest key of a live waiter (None: nobody waits)."""
        while self._waiting and self._waiting[0][2].done():
            heapq.heappop(self._waiting)           # cancelled waiters leave no trace
        return self._waiting[0][0] if self._waiting else None

    async def acquire(self, key: int) -> None:
        if self._held < self.capacity and not self._waiting:
            self._held += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (key, next(self._seq), fut))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()        # granted, then cancelled before it ran: give it back
            else:
                fut.cancel()          # skipped when its turn comes
            raise

    def release(self) -> None:
        self._held -= 1
        while self._waiting and self._held < self.capacity:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)
                self._held += 1


class Turn:
    """A holder's slot in a ``PriorityGate`` (from ``slot()``)."""

    def __init__(self, gate: PriorityGate, key: int):
        self.gate = gate
        self.key = key
        self.held = False

    async def yield_to_earlier(self) -> None:
        """Between two pieces of work: if a waiter's key is not above ours (it arrived
        earlier, or has the same key and asked first), let it go first and queue again.
        Equal keys thereby take turns (round robin); a lower key keeps its slot."""
        first = self.gate.first_waiting_key()
        if first is None or first > self.key:
            return
        self.held = False
        self.gate.release()
        await self.gate.acquire(self.key)
        self.held = True
