"""The scheduler service's request table: the one owner of every live request's shell state.

Why one owner: a request is touched by both channels (frontends submit, cancel and stream its
events; node services place, report and fail it) and by two timers (its deadline, and the grace
a frontend whose connection dropped has to resubmit). Keeping the live requests, their timers,
the ended ones' outcomes and the status counts in one object means a request ends in one place
(:meth:`RequestTable.end`, which records the outcome once) and its status is always derived the
same way: the core's phase plus that outcome (``request_state``). The table holds no placement
of its own and never calls into the core except to read a request's phase.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator

from common.protocol import RequestFailed, RequestFinished

from ..core.records import Phase
from ..core.scheduler import Scheduler
from .request_state import LIVE, RequestState, Status, Submission

Expiry = Callable[[RequestState], None]


def loop_now() -> float:
    """The event loop's monotonic clock: every timestamp and deadline of the shell."""
    return asyncio.get_running_loop().time()


class RequestTable:
    """Live requests by id, their deadline and detach timers, and the recently ended ones.

    ``core`` is read only for phases (:meth:`status`); ``recent`` bounds how many ended ids
    are remembered, so a late cancel or progress report gets their outcome instead of
    NOT_FOUND.
    """

    def __init__(self, core: Scheduler, recent: int) -> None:
        self._core = core
        self._live: dict[str, RequestState] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._recent_limit = recent
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._detached: dict[str, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._live.values()))

    def get(self, request_id: str) -> RequestState | None:
        return self._live.get(request_id)

    def live(self) -> dict[str, RequestState]:
        """The live requests by id (read-only use: the outboxes look entries up in it)."""
        return self._live

    def is_live(self, rs: RequestState) -> bool:
        """``rs`` is still the live request of its id (not ended, not replaced)."""
        return not rs.terminal and self._live.get(rs.request_id) is rs

    def recent(self, request_id: str) -> str | None:
        """The outcome of a request that ended lately (None: never seen, or long ago)."""
        return self._recent.get(request_id)

    # ------------------------------------------------------------------ status
    def phase(self, rs: RequestState) -> Phase | None:
        held = self._core.held(rs.request_id)
        return held[0] if held is not None else None

    def status(self, rs: RequestState) -> Status:
        """``rs``'s status: its outcome once ended, else derived from the core's phase."""
        return rs.status(None if rs.terminal else self.phase(rs))

    def status_of(self, request_id: str) -> Status | None:
        """The status of a live request; None when no live request has this id."""
        rs = self._live.get(request_id)
        return self.status(rs) if rs is not None else None

    def by_status(self, zeros: bool = False) -> dict[Status, int]:
        """Live requests per status, in the lifecycle's order (statuses with none left out
        unless ``zeros``: a gauge reads 0 rather than vanishing)."""
        counts = Counter(self.status(rs) for rs in self._live.values())
        return {s: counts[s] for s in LIVE if zeros or counts[s]}

    def waiting(self) -> int:
        """Requests waiting for placement (status ``queued``), counted without a walk: those
        the core holds in a queue plus those still in the hit lookup (not in the core yet)."""
        q = self._core.queue_lengths()
        return len(self._live) - q["total"] + q["global"] + q["private"] + q["pe"]

    # ------------------------------------------------------------------ lifecycle
    def add(self, sub: Submission, conn_id: int, now: float, deadline: float | None,
            on_deadline: Expiry) -> RequestState:
        """Register a new request; ``on_deadline(rs)`` runs at ``deadline`` (loop time)."""
        rs = RequestState(sub, conn_id, now, deadline)
        self._live[sub.request_id] = rs
        if deadline is not None:
            self._deadlines[sub.request_id] = asyncio.get_running_loop().call_at(
                deadline, self._fire, rs, on_deadline)
        return rs

    def reattach(self, rs: RequestState, conn_id: int) -> asyncio.Queue:
        """A resubmission takes ``rs``'s event stream over; a pending detach is called off."""
        self._cancel(self._detached, rs.request_id)
        return rs.attach(conn_id)

    def detach(self, rs: RequestState, grace_s: float, on_expiry: Expiry) -> bool:
        """``rs``'s frontend went away: ``on_expiry(rs)`` in ``grace_s`` unless it resubmits.
        False when a detach is already pending."""
        if rs.request_id in self._detached:
            return False
        self._detached[rs.request_id] = asyncio.get_running_loop().call_later(
            grace_s, self._fire_detached, rs, on_expiry)
        return True

    def end(self, rs: RequestState, outcome: Status,
            event: RequestFailed | RequestFinished) -> bool:
        """Record ``rs``'s outcome (once), stop its timers, push its last event, forget it.

        False when it had ended already. The caller has released whatever the core and the
        nodes hold for it (``lifecycle.RequestLifecycle.end``).
        """
        if rs.terminal:
            return False
        rs.outcome = outcome
        rid = rs.request_id
        if self._live.get(rid) is rs:
            del self._live[rid]
            self._cancel(self._deadlines, rid)
            self._cancel(self._detached, rid)
        rs.events.put_nowait(event)
        self._recent[rid] = outcome.value
        while len(self._recent) > self._recent_limit:
            self._recent.popitem(last=False)
        return True

    # ------------------------------------------------------------------ internals
    def _fire(self, rs: RequestState, fn: Expiry) -> None:
        self._fire_from(self._deadlines, rs, fn)

    def _fire_detached(self, rs: RequestState, fn: Expiry) -> None:
        self._fire_from(self._detached, rs, fn)

    def _fire_from(self, timers: dict[str, asyncio.TimerHandle], rs: RequestState,
                   fn: Expiry) -> None:
        """A timer of ``rs`` fired: forget its handle; act only if ``rs`` is still live."""
        if self.is_live(rs):
            timers.pop(rs.request_id, None)
            fn(rs)

    @staticmethod
    def _cancel(timers: dict[str, asyncio.TimerHandle], request_id: str) -> None:
        handle = timers.pop(request_id, None)
        if handle is not None:
            handle.cancel()
