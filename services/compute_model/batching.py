"""Intra-engine batching for prefill engines (paper §6 "intra-engine scheduling").

Under DP attention every GPU of an EP group runs its own requests' attention, then all of them
meet in the MoE/EP phase; unequal attention times leave bubbles. So each PE fills a forward batch
in FIFO order while the predicted attention time stays within a **compute quota** (300 ms by
default, the paper's value for DualPath and Oracle). The request that would cross the quota is
cut: a bracketing search (binary, sped up by interpolation) finds the largest chunk ``bsz'`` of
its new tokens that still fits, that chunk runs now (chunked prefill) and the rest — now with
``bsz'`` more cached tokens — heads the queue for the next batch.

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
from collections.abc import Callable, Iterable, Sequence

import msgspec

from common.errors import AlreadyExists, InvalidArgument

Cost = Callable[[int, int], float]

DEFAULT_QUOTA_S = 0.300


def max_chunk(cost: Cost, cached: int, new: int, budget: float) -> int:
    """Largest ``k`` in ``[0, new]`` with ``cost(cached, k) <= budget``.

    A bracketing search: ``lo`` only ever moves to a ``k`` that fits and ``hi`` to one that does
    not, so for a non-decreasing cost the answer is exactly a binary search's. The guesses come
    from the Illinois variant of regula falsi (interpolation that halves the stale end's value,
    so convex costs — attention grows ~quadratically in ``k`` — still converge fast), and every
    third step falls back to bisection if the bracket has not halved, which keeps the worst case
    logarithmic. Typically 4–7 cost calls instead of ~14 for an 8K-token request.
    """
    if budget < 0 or new <= 0:
        return 0
    fhi = cost(cached, new) - budget
    if fhi <= 0:
        return new
    lo, hi, flo = 0, new, -budget   # f(lo) <= 0 < f(hi), f = cost - budget (f(0) assumed)
    last = 0                        # -1: lo moved last, +1: hi moved last
    steps = 0
    width = new
    while hi - lo > 1:
        steps += 1
        bisect = False
        if steps % 3 == 0:
            bisect = hi - lo > width // 2
            width = hi - lo
        if bisect:
            g = (lo + hi) // 2
        else:
            g = lo + int(-flo * (hi - lo) / (fhi - flo))
            g = lo + 1 if g <= lo else (hi - 1 if g >= hi else g)
        f = cost(cached, g) - budget
        if f <= 0:
            lo, flo = g, f
            if last < 0:
                fhi *= 0.5
            last = -1
        else:
            hi, fhi = g, f
            if last > 0:
                flo *= 0.5
            last = 1
    return lo


def plan_batch(queue: Sequence[tuple[int, int]], cost: Cost, quota_s: float = DEFAULT_QUOTA_S,
               max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Chunks ``(index, tokens)`` of one forward batch over FIFO ``(cached, new)`` pairs.

    Whole requests while they fit the quota (and ``max_tokens``, if set); the first that does not
    fit contributes its largest fitting chunk and ends the batch.
    """
    return [(i, k) for i, k, _ in _plan(queue, cost, quota_s, max_tokens)]


def _plan(queue: Iterable[tuple[int, int]], cost: Cost, quota_s: float,
          max_tokens: int | None) -> list[tuple[int, int, float]]:
    """``plan_batch`` with each chunk's cost, so the batcher does not evaluate it again."""
    used = 0.0
    tokens = 0
    out: list[tuple[int, int, float]] = []
    for i, (cached, new) in enumerate(queue):
        room = new if max_tokens is None else min(new, max_tokens - tokens)
        if room == new:
            t = cost(cached, new)
            if used + t <= quota_s:
                out.append((i, new, t))
                used += t
                tokens += new
                continue
        k = max_chunk(cost, cached, room, quota_s - used)
        if k == 0 and not out:
            k = 1                   # progress guarantee: the head always advances
        if k > 0:
            out.append((i, k, cost(cached, k)))
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
        queue = self._queue
        plan = _plan(((w.cached, w.remaining) for w in queue), self.cost, self.quota_s,
                     self.max_batch_tokens)
        items = []
        predicted = 0.0
        tokens = 0
        for i, k, t in plan:
            w = queue[i]
            predicted += t
            items.append(BatchItem(w.request_id, w.cached, k, k == w.remaining))
            tokens += k
        self._advance(plan)
        return ForwardBatch(tuple(items), predicted, tokens)

    def _advance(self, plan: list[tuple[int, int, float]]) -> None:
        """Apply a plan: finished requests leave the head, the cut one keeps its remainder."""
        for _, k, _ in plan:           # plan indices are 0, 1, 2, … of the head in order
            w = self._queue[0]
            w.cached += k
            w.remaining -= k
            self._pending_tokens -= k
            if w.remaining == 0:
                self._queue.popleft()
                del self._ids[w.request_id]
            else:
                break               # only the last item can be cut


def vllm_budget(cost: Cost, ref_cached: int, quota_s: float = DEFAULT_QUOTA_S,
                max_tokens: int = 1 << 20) -> dict[str, int]:
    """The paper's compute quota as vLLM's token budget (docs/vllm.md "The 300 ms quota").

    vLLM's scheduler cuts steps by tokens, not time: ``max_num_batched_tokens`` bounds a step
    and ``long_prefill_token_threshold`` one request's chunk of it (chunked prefill). A token
    count is a time only at a given context, so the budget is the quota's chunk at the
    reference context — the largest ``n`` new tokens over ``ref_cached`` cached ones whose
    predicted cost fits ``quota_s`` (``max_chunk``, the batcher's own cut), at least 1.
    A whole step of such chunks matches the quota; shorter contexts fit more than the quota's
    worth of tokens in time, never longer ones."""
    if ref_cached < 0:
        raise InvalidArgument(f"reference context must be >= 0, got {ref_cached}")
    n = max(1, max_chunk(cost, ref_cached, max_tokens, quota_s))
    return {"max_num_batched_tokens": n, "long_prefill_token_threshold": n}
