"""Results kept across a scheduler restart (sans-I/O: times are passed in).

When the scheduler dies, the attempts its nodes were running go on; an attempt that finishes
while no scheduler listens keeps its ``finished`` report on the node, and the node redelivers
it, tagged with the epoch of the scheduler that planned it, once it has registered with the
new one (``services.node.base``). The new scheduler has not seen that request yet — its
frontend resubmits it after reconnecting — so the report waits here until the resubmission
arrives (which then finishes at once, without redoing the work) or until ``keep_s`` passes.

Bounded by count (oldest out first) and by age; docs/frontend-api.md, "Scheduler restart".
"""

from __future__ import annotations

from collections import OrderedDict

from common.protocol import ReportProgress


class KeptResults:
    """``finished`` reports of attempts planned by an earlier scheduler, by request id."""

    def __init__(self, limit: int, keep_s: float) -> None:
        self.limit = limit
        self.keep_s = keep_s
        self._by_id: OrderedDict[str, tuple[ReportProgress, float]] = OrderedDict()
        self.evicted = 0            # dropped for room or age before anyone asked: work redone

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def put(self, report: ReportProgress, now: float) -> None:
        """Keep one redelivered result (a second copy of the same request replaces the first)."""
        self._expire(now)
        self._by_id.pop(report.request_id, None)
        self._by_id[report.request_id] = (report, now + self.keep_s)
        while len(self._by_id) > self.limit:
            self._by_id.popitem(last=False)
            self.evicted += 1

    def take(self, request_id: str, now: float) -> ReportProgress | None:
        """The kept result of ``request_id`` (removed), or None."""
        self._expire(now)
        entry = self._by_id.pop(request_id, None)
        return entry[0] if entry is not None else None

    def _expire(self, now: float) -> None:
        while self._by_id:
            _, (_, until) = next(iter(self._by_id.items()))
            if until > now:
                return
            self._by_id.popitem(last=False)
            self.evicted += 1
