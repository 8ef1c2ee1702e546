"""The PE queue: requests bound to a DE and waiting for a PE, in arrival order — the FIFO
queue Algorithm 1 walks from its head (paper §6; ``Scheduler.on_pe_group_fetch``)."""

from __future__ import annotations

import heapq

from .state import Pending


class PEQueue:
    """A heap of ``(arrival seq, ticket, request)`` with lazy removal.

    A request is in the queue while ``Pending.ticket`` equals its entry's ticket; it leaves by
    :meth:`remove` (ticket -1) and its stale entry is skipped when it reaches the top, so a
    cancel or a placement past the head costs O(1). ``waiting`` counts the live entries and
    ``tokens`` their Σ PE load (the fair share's queued term, ``policy.pe_share_limit``).
    """

    __slots__ = ("_heap", "_tickets", "waiting", "tokens")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Pending]] = []
        self._tickets = 0
        self.waiting = 0
        self.tokens = 0

    def push(self, p: Pending) -> None:
        self._tickets = t = self._tickets + 1
        p.ticket = t
        heapq.heappush(self._heap, (p.seq, t, p))
        self.waiting += 1
        self.tokens += p.pe_tokens

    def head(self) -> Pending | None:
        """The earliest live request (stale entries above it dropped), or None."""
        heap = self._heap
        while heap:
            _, ticket, p = heap[0]
            if p.ticket == ticket:
                return p
            heapq.heappop(heap)
        return None

    def remove(self, p: Pending) -> bool:
        """Take ``p`` out (its entry goes stale); False if it was not queued."""
        if p.ticket < 0:
            return False
        p.ticket = -1
        self.waiting -= 1
        self.tokens -= p.pe_tokens
        return True

    def after_head(self, n: int) -> list[Pending]:
        """Live requests behind the head, in arrival order, among the first ``n + 1`` entries."""
        return [p for _, ticket, p in heapq.nsmallest(n + 1, self._heap)
                if p.ticket == ticket][1:]

    def live(self) -> list[Pending]:
        """The queued requests in arrival order."""
        return [p for _, ticket, p in sorted(self._heap) if p.ticket == ticket]

    def ids(self) -> list[str]:
        return [p.request.request_id for p in self.live()]
