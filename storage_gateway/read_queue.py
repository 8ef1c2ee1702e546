"""The node's read queue: FIFO admission, bounded concurrency, ``read_q`` in tokens (sans-I/O).

Paper §5.1: every engine reports ``read_q`` of its node — the disk-read queue length in tokens —
and the scheduler prefers nodes whose queue is short (§5.2, α) and reads each request on the
side with the shorter queue (§5.5). Here ``read_q`` = tokens of requests waiting + in flight,
with tokens = blocks × block_tokens.

The shell submits a request (gets a ticket and whether it may start now), and reports
``finish``/``cancel``; both return the tickets that start next, in FIFO order.
"""

from __future__ import annotations

from collections import deque

from common.errors import InvalidArgument, Overloaded


class ReadQueue:
    """FIFO of read requests with at most ``max_concurrent`` in flight and ``max_queued`` waiting."""

    def __init__(self, *, block_tokens: int, block_bytes: int, max_concurrent: int,
                 max_queued: int, max_keys: int, max_bytes: int, retry_after_s: float = 0.05):
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self.retry_after_s = retry_after_s
        self._waiting: deque[int] = deque()
        self._blocks: dict[int, int] = {}          # ticket → blocks, waiting or running
        self._running: set[int] = set()
        self._next = 1
        self._queued_tokens = 0
        self._inflight_tokens = 0
        self._stats = {"read_requests_admitted": 0, "read_requests_overloaded": 0,
                       "read_requests_finished": 0, "read_requests_cancelled": 0}

    def check_limits(self, n_blocks: int) -> None:
        """Raise InvalidArgument when a request of ``n_blocks`` exceeds the configured limits."""
        if n_blocks > self.max_keys:
            raise InvalidArgument(f"too many block keys: {n_blocks} > limit {self.max_keys} "
                                  "(gateway.max_keys_per_request) — split the request")
        nbytes = n_blocks * self.block_bytes
        if nbytes > self.max_bytes:
            raise InvalidArgument(f"request of {nbytes} B above limit {self.max_bytes} B "
                                  "(gateway.max_bytes_per_request) — split the request")

    def submit(self, n_blocks: int) -> tuple[int, bool]:
        """Admit a request: ``(ticket, started)``; raises Overloaded when the queue is full."""
        self.check_limits(n_blocks)
        can_start = len(self._running) < self.max_concurrent and not self._waiting
        if not can_start and len(self._waiting) >= self.max_queued:
            self._stats["read_requests_overloaded"] += 1
            raise Overloaded(f"read queue full: {len(self._waiting)} requests "
                             f"({self._queued_tokens} tokens) waiting", retry_after_s=self.retry_after_s)
        ticket, self._next = self._next, self._next + 1
        self._blocks[ticket] = n_blocks
        self._stats["read_requests_admitted"] += 1
        if can_start:
            self._run(ticket)
        else:
            self._waiting.append(ticket)
            self._queued_tokens += n_blocks * self.block_tokens
        return ticket, can_start

    def finish(self, ticket: int) -> list[int]:
        """A running request completed; returns the tickets that start now."""
        if ticket not in self._running:
            raise InvalidArgument(f"read ticket {ticket} is not running")
        self._stats["read_requests_finished"] += 1
        return self._drop(ticket)

    def cancel(self, ticket: int) -> list[int]:
        """Drop a request, waiting or running (deadline, client gone); returns tickets started."""
        if ticket not in self._blocks:
            return []
        self._stats["read_requests_cancelled"] += 1
        if ticket in self._running:
            return self._drop(ticket)
        self._waiting.remove(ticket)
        self._queued_tokens -= self._blocks.pop(ticket) * self.block_tokens
        return self._start_waiting()

    def _drop(self, ticket: int) -> list[int]:
        self._running.discard(ticket)
        self._inflight_tokens -= self._blocks.pop(ticket) * self.block_tokens
        return self._start_waiting()

    def _start_waiting(self) -> list[int]:
        started = []
        while self._waiting and len(self._running) < self.max_concurrent:
            ticket = self._waiting.popleft()
            self._queued_tokens -= self._blocks[ticket] * self.block_tokens
            self._run(ticket)
            started.append(ticket)
        return started

    def _run(self, ticket: int) -> None:
        self._running.add(ticket)
        self._inflight_tokens += self._blocks[ticket] * self.block_tokens

    def is_running(self, ticket: int) -> bool:
        return ticket in self._running

    @property
    def read_q(self) -> int:
        """Tokens queued plus in flight: what the scheduler balances on (paper §5.1)."""
        return self._queued_tokens + self._inflight_tokens

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def inflight_tokens(self) -> int:
        return self._inflight_tokens

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        return len(self._running)

    def counters(self) -> dict[str, int]:
        return {"read_q": self.read_q, "read_q_queued_tokens": self._queued_tokens,
                "read_q_inflight_tokens": self._inflight_tokens,
                "read_requests_waiting": len(self._waiting),
                "read_requests_running": len(self._running), **self._stats}
