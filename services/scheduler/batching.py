"""Intra-engine batching for prefill engines (paper §6 "intra-engine scheduling", digest §5.6).

Under DP attention every GPU of an EP group runs its own requests' attention, then all of them
meet in the MoE/EP phase; unequal attention times leave bubbles. So each PE fills a forward batch
in FIFO order while the predicted attention time stays within a **compute quota** (300 ms by
default, the paper's value for DualPath and Oracle). The request that would cross the quota is
cut: a binary search finds the largest chunk ``bsz'`` of its new tokens that still fits, that
chunk runs now (chunked prefill) and the rest — now with ``bsz'`` more cached tokens — heads the
queue for the next batch.

Time comes from a cost function ``(cached, new) -> seconds`` that must be additive over requests
and non-decreasing in ``new``; ``cost_model.ModelCost.attention_s`` is the default choice. A batch
always takes at least one token of its head request, so a head whose single token costs more than
the whole quota still makes progress (its batch then exceeds the quota; nothing else joins it).

Pure and deterministic: no clocks, no I/O. The engine emulator (and a real engine) calls
``add`` when a request arrives and ``next_batch`` when the GPU is free; the simulator does the
same at simulated times.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import msgspec

from common.errors import AlreadyExists, InvalidArgument

Cost = Callable[[int, int], float]

DEFAULT_QUOTA_S = 0.300


def max_chunk(cost: Cost, cached: int, new: int, budget: float) -> int:
    """Largest ``k`` in ``[0, new]`` with ``cost(cached, k) <= budget`` (binary search)."""
    if budget < 0 or new <= 0:
        return 0
    if cost(cached, new) <= budget:
        return new
    lo, hi = 0, new                 # cost(cached, lo) <= budget < cost(cached, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(cached, mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def plan_batch(queue: Sequence[tuple[int, int]], cost: Cost, quota_s: float = DEFAULT_QUOTA_S,
               max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Chunks ``(index, tokens)`` of one forward batch over FIFO ``(cached, new)`` pairs.

    Whole requests while they fit the quota (and ``max_tokens``, if set); the first that does not
    fit contributes its largest fitting chunk and ends the batch.
    """
    used = 0.0
    tokens = 0
    out: list[tuple[int, int]] = []
    for i, (cached, new) in enumerate(queue):
        room = new if max_tokens is None else min(new, max_tokens - tokens)
        if room == new:
            t = cost(cached, new)
            if used + t <= quota_s:
                out.append((i, new))
                used += t
                tokens += new
                continue
        k = max_chunk(cost, cached, room, quota_s - used)
        if k == 0 and not out:
            k = 1                   # progress guarantee: the head always advances
        if k > 0:
            out.append((i, k))
        break
    return out


class BatchItem(msgspec.Struct, frozen=True):
    """``new`` tokens of a request prefilled in this batch over ``cached`` existing ones."""

    request_id: str
    cached: int
    new: int
    last: bool          # this chunk finishes the request's prefill


class ForwardBatch(msgspec.Struct, frozen=True):
    items: tuple[BatchItem, ...]
    predicted_s: float  # sum of the cost function over the items
    tokens: int


class _Work:
    __slots__ = ("request_id", "cached", "remaining")

    def __init__(self, request_id: str, cached: int, remaining: int) -> None:
        self.request_id = request_id
        self.cached = cached
        self.remaining = remaining


class PrefillBatcher:
    """One prefill engine's FIFO of requests to prefill, cut into quota-sized forward batches."""

    def __init__(self, cost: Cost, quota_s: float = DEFAULT_QUOTA_S,
                 max_batch_tokens: int | None = None) -> None:
        if quota_s <= 0:
            raise InvalidArgument(f"compute quota must be positive, got {quota_s}")
        if max_batch_tokens is not None and max_batch_tokens <= 0:
            raise InvalidArgument(f"max_batch_tokens must be positive, got {max_batch_tokens}")
        self.cost = cost
        self.quota_s = quota_s
        self.max_batch_tokens = max_batch_tokens
        self._queue: deque[_Work] = deque()
        self._ids: dict[str, _Work] = {}
        self._pending_tokens = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def pending_tokens(self) -> int:
        """New tokens still to prefill over all queued requests."""
        return self._pending_tokens

    def add(self, request_id: str, cached: int, new: int) -> None:
        """Queue a request: ``cached`` tokens of KV already present (hit), ``new`` to compute."""
        if request_id in self._ids:
            raise AlreadyExists(f"request {request_id!r} is already queued on this engine")
        if cached < 0 or new <= 0:
            raise InvalidArgument(f"request {request_id!r}: need cached >= 0 and new > 0, "
                                  f"got {cached=}, {new=}")
        w = _Work(request_id, cached, new)
        self._queue.append(w)
        self._ids[request_id] = w
        self._pending_tokens += new

    def cancel(self, request_id: str) -> bool:
        w = self._ids.pop(request_id, None)
        if w is None:
            return False
        self._queue.remove(w)
        self._pending_tokens -= w.remaining
        return True

    def next_batch(self) -> ForwardBatch | None:
        """The next forward batch (and the queue advanced past it), or None when idle."""
        if not self._queue:
            return None
        view = _HeadView(self._queue)
        plan = plan_batch(view, self.cost, self.quota_s, self.max_batch_tokens)
        items = []
        predicted = 0.0
        tokens = 0
        for i, k in plan:
            w = self._queue[i]
            predicted += self.cost(w.cached, k)
            last = k == w.remaining
            items.append(BatchItem(w.request_id, w.cached, k, last))
            tokens += k
        self._advance(plan)
        return ForwardBatch(tuple(items), predicted, tokens)

    def _advance(self, plan: list[tuple[int, int]]) -> None:
        """Apply a plan: finished requests leave the head, the cut one keeps its remainder."""
        for _, k in plan:           # plan indices are 0, 1, 2, … of the head in order
            w = self._queue[0]
            w.cached += k
            w.remaining -= k
            self._pending_tokens -= k
            if w.remaining == 0:
                self._queue.popleft()
                del self._ids[w.request_id]
            else:
                break               # only the last item can be cut


class _HeadView(Sequence[tuple[int, int]]):
    """The queue as ``(cached, new)`` pairs without copying it (``plan_batch`` reads the head)."""

    __slots__ = ("_q",)

    def __init__(self, q: deque[_Work]) -> None:
        self._q = q

    def __len__(self) -> int:
        return len(self._q)

    def __getitem__(self, i):  # type: ignore[override]
        w = self._q[i]
        return w.cached, w.remaining

    def __iter__(self):
        for w in self._q:
            yield w.cached, w.remaining
