"""Which of a node's engines are inside a collective, and the node's KV cap while any is.

An engine tells its node when its own collectives run (TP reduce-scatter / all-gather, EP
all-to-all): ``collective_begin()`` / ``collective_end()`` on its port, in-process or over the
engine socket (``CollectiveBegin`` / ``CollectiveEnd``). While any engine of the node is
inside one, the node holds its egress gate — the KV arbiter's
:meth:`~services.node.arbiter.EgressArbiter.high_priority` — so KV is capped at the
arbiter's ``kv_share`` of the link and the collective keeps the rest (paper §5,
docs/qos.md "Collectives tell the arbiter").

A hold never outlives its engine: an engine that detaches (exit, kill -9, a replacing
attach) or whose port closes ends its collectives, and a begin not ended within
``max_hold_s`` of the engine's latest begin is ended by the node (``collectives_expired``),
so a hung engine cannot keep KV capped forever.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)

DEFAULT_MAX_HOLD_S = 2.0


class PriorityGate(Protocol):
    """What caps KV while a higher-priority flow runs (the node's egress arbiter)."""

    def high_priority(self) -> contextlib.AbstractContextManager[Any]: ...


@dataclass(eq=False)
class _Hold:
    stack: contextlib.ExitStack
    depth: int = 0
    timer: asyncio.TimerHandle | None = field(default=None)


class Collectives:
    """The node's engines inside a collective; ``gate`` is held while any is (None: none)."""

    def __init__(self, gate: PriorityGate | None,
                 max_hold_s: float = DEFAULT_MAX_HOLD_S) -> None:
        self._gate = gate
        self.max_hold_s = max_hold_s
        self._holds: dict[str, _Hold] = {}
        self.counters: collections.Counter[str] = collections.Counter()

    @property
    def active(self) -> list[str]:
        """The engines inside a collective now."""
        return sorted(self._holds)

    def begin(self, engine_id: str) -> None:
        """``engine_id`` entered a collective (nested begins need as many ends)."""
        hold = self._holds.get(engine_id)
        if hold is None:
            hold = self._holds[engine_id] = _Hold(contextlib.ExitStack())
            if self._gate is not None:
                hold.stack.enter_context(self._gate.high_priority())
        hold.depth += 1
        if hold.timer is not None:
            hold.timer.cancel()
        hold.timer = asyncio.get_running_loop().call_later(self.max_hold_s, self._expire,
                                                           engine_id, hold)
        self.counters["collectives_begun"] += 1

    def end(self, engine_id: str) -> None:
        """``engine_id`` left a collective; an end with nothing open (its hold expired, or
        it was ended on detach) is counted, not an error."""
        hold = self._holds.get(engine_id)
        if hold is None:
            self.counters["collective_ends_unmatched"] += 1
            return
        hold.depth -= 1
        self.counters["collectives_ended"] += 1
        if hold.depth == 0:
            self._release(engine_id, hold)

    def end_all(self, engine_id: str, reason: str) -> int:
        """End every collective ``engine_id`` holds (it detached, its port closed)."""
        hold = self._holds.get(engine_id)
        if hold is None:
            return 0
        self.counters["collectives_ended_on_detach"] += hold.depth
        log.info("engine_collectives_ended", engine=engine_id, open=hold.depth, reason=reason)
        self._release(engine_id, hold)
        return hold.depth

    def _expire(self, engine_id: str, hold: _Hold) -> None:
        if self._holds.get(engine_id) is not hold:
            return
        self.counters["collectives_expired"] += hold.depth
        log.warning("engine_collective_expired", engine=engine_id, open=hold.depth,
                    max_hold_s=self.max_hold_s,
                    hint="the engine began a collective and never ended it: KV uncapped again")
        self._release(engine_id, hold)

    def _release(self, engine_id: str, hold: _Hold) -> None:
        del self._holds[engine_id]
        if hold.timer is not None:
            hold.timer.cancel()
        hold.stack.close()

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out["collectives_engines_active"] = float(len(self._holds))
        return out
