"""Progress reports of node services (``ReportProgress``): each stage is one transition.

Nodes report every stage of an attempt (``common.protocol.Stage``) — buffers allocated, hit
read, prefill done, first and second token, finished, failed. Each stage stamps the attempt
(the stamps the TTFT breakdown and the derived status read), tells the core what it frees
(``read_done``, ``prefill_done``, ``complete``), or ends or re-plans the request. A report of an
attempt that is no longer current is stale and answered so (the node drops it); a ``finished``
report an earlier scheduler planned is kept for the frontend's resubmission (``recovery``).
"""

from __future__ import annotations

from collections.abc import Callable

from common.errors import ErrorCode, InvalidArgument
from common.protocol import ReportProgress, ReportProgressReply
from common.rpc import CallContext

from ..core.scheduler import Scheduler
from .gate import Gate
from .lifecycle import RequestLifecycle
from .longpoll import WorkSignal
from .recovery import KeptResults
from .request_state import RequestState, Status
from .table import RequestTable, loop_now

StageHandler = Callable[[RequestState, ReportProgress, float], None]
# (node id, engine id, ended attachment number, why): NodeChannel.engine_detached
EngineDetachedHook = Callable[[str, str, int, str], None]


class ProgressReports:
    """The ``ReportProgress`` handler of the node channel and its stage transitions."""

    def __init__(self, core: Scheduler, table: RequestTable, lifecycle: RequestLifecycle, *,
                 gate: Gate, kept: KeptResults, counters: dict[str, int], work: WorkSignal,
                 engine_detached: EngineDetachedHook = lambda node, eid, no, why: None
                 ) -> None:
        self.core, self.table, self.lifecycle = core, table, lifecycle
        self.gate, self.kept, self.counters, self.work = gate, kept, counters, work
        self.engine_detached = engine_detached
        self._stages: dict[str, StageHandler] = {
            "allocated": self._allocated, "read_done": self._read_done,
            "prefill_done": self._prefill_done, "first_token": self._first,
            "second_token": self._second, "finished": self._finished, "failed": self._failed}

    async def on_progress(self, msg: ReportProgress, ctx: CallContext) -> ReportProgressReply:
        stage = self._stages.get(msg.stage)
        if stage is None and msg.stage != "dropped":
            raise InvalidArgument(f"unknown stage {msg.stage[:40]!r}; one of "
                                  f"{[*self._stages, 'dropped']}")
        for name in ("tokens", "read_bytes", "pe_read_bytes", "de_read_bytes",
                     "engine_attaches"):
            if getattr(msg, name) < 0:
                raise InvalidArgument(f"{name}={getattr(msg, name)} must be >= 0")
        self.gate.check_leading()
        if msg.scheduler_epoch not in (0, self.gate.epoch):
            return self._earlier_report(msg)
        rs = self.table.get(msg.request_id)
        if rs is not None and msg.stage in ("failed", "dropped"):
            # what the attempt read counts whether or not the attempt is still current
            rs.count_read(msg.attempt, msg.read_bytes, msg.pe_read_bytes, msg.de_read_bytes)
        if rs is not None and msg.stage == "failed" and msg.detached_engine \
                and rs.attempt != msg.attempt:
            rs.node_account(msg.attempt, msg.hop or "engine", _code(msg.code), msg.message)
        if msg.stage == "dropped":          # a read count only: nothing moves
            self.counters["dropped_reports"] += 1
            return ReportProgressReply(False, self._status(msg.request_id))
        if rs is None or rs.attempt != msg.attempt or self.core.held(rs.request_id) is None:
            self.counters["stale_reports"] += 1
            return ReportProgressReply(False, self._status(msg.request_id))
        if rs.assignment is None and msg.stage != "failed":
            raise InvalidArgument(f"stage {msg.stage!r} for request {rs.request_id!r} attempt "
                                  f"{rs.attempt}, which has not been placed yet")
        if msg.stage == "failed" and msg.retryable and msg.detached_engine \
                and self._took_out_engine(rs, msg):
            # the engine's removal re-planned the request (or failed it past max_replans)
            return ReportProgressReply(False, self.table.status(rs).value)
        stage(rs, msg, loop_now())
        self.work.kick()                    # capacity may have freed up (finished, failed)
        status = self.table.status(rs)
        live = rs.attempt == msg.attempt and (not rs.terminal or status is Status.FINISHED)
        return ReportProgressReply(live, status.value)

    def _took_out_engine(self, rs: RequestState, msg: ReportProgress) -> bool:
        """A failure naming the engine whose process detached: when it is the engine of this
        attempt, that engine leaves placement first; True when that ended the attempt (its
        request re-planned with the engine's other requests)."""
        a = rs.assignment
        if msg.detached_engine not in ((a.pe_engine if a else None), rs.de_engine):
            return False
        self.lifecycle.close_attempt(rs, "failed", msg.hop or "engine", _code(msg.code),
                                     msg.message)
        self.engine_detached(msg.node_id, msg.detached_engine, msg.engine_attaches,
                             msg.message)
        self.work.kick()
        return rs.attempt != msg.attempt or self.core.held(rs.request_id) is None

    def _status(self, request_id: str) -> str:
        """A live request's status, an ended one's outcome, else ``unknown``."""
        status = self.table.status_of(request_id)
        if status is not None:
            return status.value
        return self.table.recent(request_id) or "unknown"

    def _earlier_report(self, msg: ReportProgress) -> ReportProgressReply:
        """A report of an attempt an earlier scheduler planned (redelivered after a restart).

        Only a ``finished`` one is of use: it ends the live request it belongs to (whatever
        attempt this scheduler runs for it is revoked) or waits in ``kept`` for the frontend's
        resubmission. Anything else is stale: the node drops the attempt.
        """
        rs = self.table.get(msg.request_id)
        if msg.stage != "finished" or msg.scheduler_epoch > self.gate.epoch:
            self.counters["stale_reports"] += 1
            return ReportProgressReply(False, self.table.status(rs).value if rs is not None
                                       else "unknown")
        if rs is not None and not rs.terminal:
            self.lifecycle.finish_kept(rs, msg, "redelivered by its node")
            return ReportProgressReply(True, Status.FINISHED.value)
        if rs is None and self.table.recent(msg.request_id) is None:
            self.kept.put(msg, loop_now())
            self.counters["results_kept"] += 1
            return ReportProgressReply(True, "kept")
        return ReportProgressReply(False, self.table.recent(msg.request_id) or "unknown")

    # ------------------------------------------------------------------ stages
    # Each stamps the attempt once (a repeated report changes nothing); the status follows.
    def _allocated(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        if rs.t_allocated is None:
            rs.t_allocated = now

    def _read_done(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        self.core.read_done(rs.request_id)
        if rs.t_read is None:
            rs.t_read = now

    def _prefill_done(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        self.core.prefill_done(rs.request_id)
        self._first(rs, msg, now)

    def _first(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        if rs.t_first is None:
            rs.events.put_nowait(rs.first_token_event(now))

    def _second(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        self._first(rs, msg, now)
        if rs.t_second is None:
            rs.t_second = now

    def _finished(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        self.core.complete(rs.request_id)
        self._first(rs, msg, now)
        self.lifecycle.stored(rs, msg.output_token_ids)
        self.counters["finished"] += 1
        self.lifecycle.end(rs, Status.FINISHED,
                           rs.finished_event(msg.tokens, now, msg.output_token_ids))

    def _failed(self, rs: RequestState, msg: ReportProgress, now: float) -> None:
        code = _code(msg.code)
        where = (msg.hop[:80] or "node") + (f" on {msg.node_id[:80]}" if msg.node_id else "")
        reason = f"{where} failed attempt {rs.attempt}: {code}: {msg.message[:500]}"
        self.lifecycle.close_attempt(rs, "failed", msg.hop or "node", code, msg.message)
        if not msg.retryable:
            self.lifecycle.end(rs, Status.FAILED, rs.failed_event(code, reason, False))
            return
        res = self.core.fail(rs.request_id)
        self.lifecycle.after_replan(list(res.requeued), list(res.failed), reason, code)


def _code(code: str) -> str:
    """A node's error code as a record keeps it (one it made up: INTERNAL)."""
    return code if code in ErrorCode.__members__ else ErrorCode.INTERNAL.value
