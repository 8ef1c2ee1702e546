"""Claim by request id on an engine port's queue (the cross-process API's ``ClaimRequest``).

Both ports (``PrefillPort``, ``DecodePort``) keep a FIFO ``_queue`` of requests handed to one
engine; an engine behind a P/D router does not take the next one but the one it was sent
(docs/engine-api.md "Claim by request id"). This mixin finds and removes it, and lets a
claim wait for the next arrival without spinning.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class ClaimableQueue:
    """``take(request_id)`` and ``wait_arrival(timeout_s)`` over a port's ``_queue``."""

    _queue: deque[Any]

    def __init__(self) -> None:
        self._arrived = asyncio.Event()      # replaced on every arrival: claim waiters

    def _live(self, item: Any) -> bool:
        """False for a request that was dropped while queued (the port releases it)."""
        raise NotImplementedError

    def _note_arrival(self) -> None:
        self._arrived.set()
        self._arrived = asyncio.Event()

    def take(self, request_id: str) -> Any:
        """Remove and return the queued live request ``request_id`` (None: not queued here,
        yet or any more)."""
        for item in self._queue:
            if item.request_id == request_id and self._live(item):
                self._queue.remove(item)
                return item
        return None

    async def wait_arrival(self, timeout_s: float) -> None:
        """Return after the next arrival (or the port's close), or after ``timeout_s``."""
        event = self._arrived
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass
