"""Hit length of a request: how many leading blocks of its prompt storage already holds.

The scheduler asks this when a frontend gives block keys (or token ids) but no ``hit_tokens``,
so a frontend never needs to know what is stored (paper §6.5: the hit is the prompt's stored
prefix). The implementations of :class:`HitLookup`:

* :class:`SessionPrefixIndex` (the default): remembers, per session, the block keys of its last
  finished turn; the next turn hits their common prefix. That is the paper's evaluation rule
  (hits only within a trajectory) and needs no storage round trip. It is an estimate: a block
  evicted since is found missing at read time and recomputed (never wrong bytes).
* :class:`~services.scheduler.shell.gateway_lookup.GatewayHitLookup`: asks the storage gateways of
  the shared store (``LookupPrefix``), one per lookup in turn, retried on the next when one
  fails; hits are what storage holds (``dualpath serve scheduler`` and the in-process cluster
  use it whenever a gateway is known).
* :class:`FunctionHitLookup`: wraps any callable ``keys -> hit blocks`` (sync or async).
* :class:`NoHits`: everything is recomputed.

A lookup that raises (or outlasts ``scheduler_service.hit_lookup_timeout_s``) never fails the
request: the scheduler takes the hit as 0 and says so (``hit_lookup_failures``, the
``hit_lookup_failed`` log event and flag on ``RequestQueued`` and the final event).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class HitLookup(Protocol):
    """What the scheduler service needs from a storage index."""

    async def lookup(self, session_id: str, keys: Sequence[str]) -> int:
        """Number of leading blocks of ``keys`` that are stored (0..len(keys))."""
        ...

    def finished(self, session_id: str, keys: Sequence[str]) -> None:
        """A request of ``session_id`` with prompt blocks ``keys`` finished (they are stored)."""
        ...


class NoHits:
    """Every request recomputes its whole prompt."""

    async def lookup(self, session_id: str, keys: Sequence[str]) -> int:
        return 0

    def finished(self, session_id: str, keys: Sequence[str]) -> None:
        pass


class FunctionHitLookup:
    """Adapts ``fn(keys) -> int`` or ``async fn(keys) -> int`` (e.g. a gateway's LookupPrefix)."""

    def __init__(self, fn: Callable[[Sequence[str]], int | Awaitable[int]]) -> None:
        self._fn = fn

    async def lookup(self, session_id: str, keys: Sequence[str]) -> int:
        result = self._fn(keys)
        if inspect.isawaitable(result):
            result = await result
        return int(result)

    def finished(self, session_id: str, keys: Sequence[str]) -> None:
        pass


class SessionPrefixIndex:
    """Per-session memory of the last finished turn's prompt keys, LRU-bounded."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self._max = max_sessions
        self._sessions: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    async def lookup(self, session_id: str, keys: Sequence[str]) -> int:
        stored = self._sessions.get(session_id)
        if stored is None:
            return 0
        self._sessions.move_to_end(session_id)
        return common_prefix(stored, keys)

    def finished(self, session_id: str, keys: Sequence[str]) -> None:
        # Keys chain over the whole prefix, so the longer of old and new covers both.
        old = self._sessions.get(session_id, ())
        if len(keys) >= len(old) or common_prefix(old, keys) < len(keys):
            self._sessions[session_id] = tuple(keys)
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self._max:
            self._sessions.popitem(last=False)


def common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the common leading run of two key lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
