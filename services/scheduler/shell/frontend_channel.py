"""The scheduler service's frontend channel: submit (a stream of events), cancel, disconnects.

A submission is checked and registered without an await (so its id is taken at once), then its
hit is looked up (``hit_lookup``; a failed or slow lookup takes the hit as 0, loudly) and it
goes into the core's queues; from then on the node channel moves it and this stream only relays
its events. A frontend whose connection drops may resubmit the same request (same id and
content) within ``reattach_grace_s`` and gets its stream back (docs/frontend-api.md,
"Resubmitting"); one that closes its stream cancels the request.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

from common.errors import AlreadyExists, DualpathError, ErrorCode, NotFound, Overloaded
from common.kv import KVSpec
from common.protocol import (CancelRequest, CancelRequestReply, RequestEvent, RequestFailed,
                             RequestFinished, RequestQueued, SubmitRequest)
from common.rpc import CallContext, ServerConnection

from ..core.records import Request
from ..core.scheduler import Scheduler
from ..service_config import SchedulerServiceConfig
from .gate import Gate
from .hit_lookup import HitLookup
from .lifecycle import RequestLifecycle
from .longpoll import WorkSignal
from .recovery import KeptResults
from .request_state import (SUPERSEDED, RequestState, Status, Submission, check_submit,
                            usable_hit_blocks)
from .stored_prefix import PromisedPrefixes
from .table import RequestTable, loop_now

CALL_MARGIN_S = 0.05     # a request's deadline fires this much before its stream's call deadline
# A hit lookup that ends this long past its budget did not lose to a slow index: this process
# stood still at the deadline (the lease loop's reasoning, ``SchedulerService._lease_loop``)
LOOKUP_STALL_S = 1.0


class FrontendChannel:
    """Handlers of the frontend channel (``common.protocol.FrontendRequest``)."""

    def __init__(self, core: Scheduler, table: RequestTable, lifecycle: RequestLifecycle, *,
                 settings: SchedulerServiceConfig, kv: KVSpec, gate: Gate, hits: HitLookup,
                 promised: PromisedPrefixes, kept: KeptResults, counters: dict[str, int],
                 work: WorkSignal, log: Any) -> None:
        self.core, self.table, self.lifecycle = core, table, lifecycle
        self.settings, self.kv, self.gate = settings, kv, gate
        self.hits, self.promised, self.kept = hits, promised, kept
        self.counters, self.work, self.log = counters, work, log

    async def on_submit(self, msg: SubmitRequest, ctx: CallContext
                        ) -> AsyncIterator[RequestEvent]:
        rs, queue = self._admit(msg, ctx)
        try:
            if queue is None:               # a new request (not a resubmission of a live one)
                queue = rs.events
                kept = self.kept.take(rs.request_id, loop_now())
                if kept is not None:
                    self.lifecycle.finish_kept(rs, kept, "its frontend resubmitted it")
                else:
                    await self._enqueue(rs)
            while True:
                event = await queue.get()
                if event is SUPERSEDED:     # a resubmission took the stream over: this one ends
                    yield rs.failed_event(ErrorCode.ALREADY_EXISTS, "a resubmission of this "
                                          "request took its event stream over", False)
                    return
                yield event
                if isinstance(event, (RequestFinished, RequestFailed)):
                    return
        finally:
            if not rs.terminal and rs.events is queue:
                if ctx.conn.closed:         # the connection dropped: wait for a resubmission
                    self.detach(rs)
                else:                       # the frontend left (cancel, call deadline)
                    self.lifecycle.end(rs, Status.CANCELLED, rs.failed_event(
                        ErrorCode.CANCELLED, "the frontend closed the submit stream", False))

    async def on_cancel(self, msg: CancelRequest, ctx: CallContext) -> CancelRequestReply:
        rs = self.table.get(msg.request_id)
        if rs is None:
            state = self.table.recent(msg.request_id)
            if state is None:
                raise NotFound(f"request {msg.request_id[:80]!r} is not known (never submitted, "
                               f"or it ended long ago)")
            return CancelRequestReply(msg.request_id, False, state)
        self.lifecycle.end(rs, Status.CANCELLED, rs.failed_event(
            ErrorCode.CANCELLED, "cancelled by CancelRequest", False))
        return CancelRequestReply(msg.request_id, True, Status.CANCELLED.value)

    def on_disconnect(self, conn: ServerConnection) -> None:
        gone = [rs for rs in self.table if rs.conn_id == conn.conn_id]
        for rs in gone:                 # normally their streams' ``finally`` did this already
            self.detach(rs)
        if gone:
            self.log.info("frontend_disconnected", conn_id=conn.conn_id, detached=len(gone),
                          grace_s=self.settings.reattach_grace_s)

    def detach(self, rs: RequestState) -> None:
        """The frontend's connection dropped: cancel after ``reattach_grace_s`` unless it
        resubmits the request (``_reattach``) before then."""
        grace = self.settings.reattach_grace_s
        if grace <= 0 or self.gate.closing:
            self.lifecycle.end(rs, Status.CANCELLED, rs.failed_event(
                ErrorCode.CANCELLED, "the frontend disconnected", False))
            return
        if self.table.detach(rs, grace, self._detach_expired):
            self.counters["detached"] += 1

    # ------------------------------------------------------------------ admission
    def _admit(self, msg: SubmitRequest,
               ctx: CallContext) -> tuple[RequestState, asyncio.Queue | None]:
        """Checks that need no await; the request is registered (its id taken) on return.

        A resubmission of a live request (same id and content) returns it with the event queue
        it now streams to; a new request returns None for the queue.
        """
        s = self.settings
        self.gate.check_open()
        self.gate.check_leading()
        try:
            sub = check_submit(msg, s, self.kv.block_tokens)
            live = self.table.get(sub.request_id)
            if live is not None:
                return live, self._reattach(live, sub, ctx)
        except DualpathError:
            self.counters["rejected_invalid"] += 1
            raise
        waiting, active = self.table.waiting(), len(self.table)
        if waiting >= s.max_queued_requests or active >= s.max_active_requests:
            self.counters["rejected_overload"] += 1
            raise Overloaded(f"{waiting} requests wait for placement and {active} are "
                             f"live (limits scheduler_service.max_queued_requests="
                             f"{s.max_queued_requests}, max_active_requests="
                             f"{s.max_active_requests}); retry later",
                             retry_after_s=s.overload_retry_after_s)
        return self._register(sub, ctx), None

    def _reattach(self, rs: RequestState, sub: Submission, ctx: CallContext) -> asyncio.Queue:
        """A frontend resubmitted a live request (after reconnecting): it gets the stream."""
        if not rs.same_request(sub):
            raise AlreadyExists(f"request {sub.request_id!r} is already queued or running with "
                                f"other content; request ids must be unique among live requests")
        self.counters["resubmits"] += 1
        self.log.info("request_resubmitted", request_id=rs.request_id,
                      state=self.table.status(rs).value, attempt=rs.attempt,
                      old_conn=rs.conn_id, conn=ctx.conn_id)
        queue = self.table.reattach(rs, ctx.conn_id)
        # an event at once tells the frontend the request is held again (its wait is bounded)
        queue.put_nowait(RequestQueued(rs.request_id, 0, rs.hit_tokens,
                                       hit_lookup_failed=rs.hit_lookup_failed))
        return queue

    def _detach_expired(self, rs: RequestState) -> None:
        self.lifecycle.end(rs, Status.CANCELLED, rs.failed_event(
            ErrorCode.CANCELLED, f"the frontend disconnected and did not resubmit within "
            f"scheduler_service.reattach_grace_s={self.settings.reattach_grace_s}s", False))

    def _register(self, sub: Submission, ctx: CallContext) -> RequestState:
        now = loop_now()
        budget = min(sub.deadline_s if sub.deadline_s is not None else math.inf,
                     ctx.remaining() - CALL_MARGIN_S)
        deadline = now + max(budget, 0.0) if math.isfinite(budget) else None
        self.counters["submitted"] += 1
        return self.table.add(sub, ctx.conn_id, now, deadline, self._on_deadline)

    def _on_deadline(self, rs: RequestState) -> None:
        self.counters["deadline_exceeded"] += 1
        self.lifecycle.end(rs, Status.FAILED, rs.failed_event(
            ErrorCode.DEADLINE_EXCEEDED, f"request {rs.request_id!r} ran past its deadline "
            f"({rs.sub.deadline_s}s) while {self.table.status(rs).value}", True))

    # ------------------------------------------------------------------ into the core
    async def _enqueue(self, rs: RequestState) -> None:
        """Hit length, then into the core's queues; announces RequestQueued."""
        sub, bt = rs.sub, self.kv.block_tokens
        if sub.hit_tokens is not None:
            hit = sub.hit_tokens
        elif sub.keys:
            blocks = await self._lookup(rs)
            rs.hit_lookup_failed = blocks is None
            hit = usable_hit_blocks(blocks or 0, len(sub.keys), sub.prompt_tokens, bt) * bt
            if blocks is not None:
                self._check_shortfall(rs, hit // bt)
        else:
            hit = 0
        if rs.terminal:             # cancelled or expired during the lookup
            return
        rs.hit_tokens = hit
        req = Request.sized(sub.request_id, sub.session_id, hit, sub.prompt_tokens - hit,
                            sub.gen_tokens, self.kv.bytes_per_token)
        try:
            self.core.submit(req)
        except DualpathError as e:
            self.counters["rejected_invalid"] += 1
            self.lifecycle.end(rs, Status.FAILED, rs.failed_event(e.code, e.message, e.retryable))
            raise
        rs.hbm_bytes = req.hbm_bytes
        held = self.core.held(sub.request_id)
        if held is not None:                # the core's first attempt number (this epoch's)
            rs.attempt = held[1]
        self.work.kick()                    # queued: held fetches place it now
        q = self.core.queue_lengths()
        position = q["global"] + q["private"] + q["pe"] - 1
        rs.events.put_nowait(RequestQueued(sub.request_id, position, hit,
                                           hit_lookup_failed=rs.hit_lookup_failed,
                                           hit_shortfall_tokens=rs.hit_shortfall_tokens))

    def _check_shortfall(self, rs: RequestState, found_blocks: int) -> None:
        """Count and log a hit shorter than what the session's last turn stored."""
        sub, bt = rs.sub, self.kv.block_tokens
        short = self.promised.shortfall(sub.session_id, sub.keys, found_blocks,
                                        (sub.prompt_tokens - 1) // bt)
        if not short:
            return
        rs.hit_shortfall_tokens = short * bt
        self.counters["hit_shortfalls"] += 1
        self.counters["hit_shortfall_tokens"] += short * bt
        self.log.warning("hit_shorter_than_stored", request_id=sub.request_id,
                         session_id=sub.session_id, found_blocks=found_blocks,
                         missing_blocks=short, missing_tokens=short * bt)

    async def _lookup(self, rs: RequestState) -> int | None:
        """Stored leading blocks; None when the lookup failed (the caller takes hit 0).

        A lookup that failed only well past its budget (``LOOKUP_STALL_S``) ran out while this
        process stood still — a GC pause, a stopped VM, or in an in-process cluster a service
        holding the shared loop (CI saw 28 s). The gateways' answers may sit unread in its
        sockets, and a timer that fell due in the stall runs before the reply it raced; taking
        hit 0 then recomputes a whole stored prompt. So it is asked once more with a fresh
        budget, counted (``hit_lookup_stall_retries``) and logged; a lookup that was merely
        slow fails at its budget as before."""
        sub, budget = rs.sub, self.settings.hit_lookup_timeout_s
        started = loop_now()
        got = await self._ask(sub, budget)
        overrun = loop_now() - started - budget
        if isinstance(got, Exception) and overrun > LOOKUP_STALL_S and not rs.terminal:
            self.counters["hit_lookup_stall_retries"] += 1
            self.log.warning("hit_lookup_retried_after_stall", request_id=sub.request_id,
                             session_id=sub.session_id, overrun_s=round(overrun, 3),
                             error=repr(got))
            got = await self._ask(sub, budget)
        if isinstance(got, Exception):  # no hit is always correct, only slower — never silent
            self._lookup_failed(sub, got)
            return None
        return got

    async def _ask(self, sub: Submission, budget_s: float) -> int | Exception:
        """One lookup within ``budget_s``: the stored blocks, or why it failed."""
        try:
            async with asyncio.timeout(budget_s):
                return await self.hits.lookup(sub.session_id, sub.keys)
        except Exception as e:      # noqa: BLE001 -- the caller decides: retry or hit 0
            return e
        finally:                    # a retrying lookup (GatewayHitLookup) counts its retries
            self.counters["hit_lookup_retries"] = getattr(self.hits, "retries", 0)

    def _lookup_failed(self, sub: Submission, e: Exception) -> None:
        """Count (``dualpath_hit_lookup_failures_total``) and log why the hit is taken as 0."""
        self.counters["hit_lookup_failures"] += 1
        # a slow or unreachable index is expected; anything else is a bug: keep its traceback
        if isinstance(e, DualpathError):
            code, reason = e.code, e.message
        elif isinstance(e, TimeoutError):
            code = ErrorCode.DEADLINE_EXCEEDED
            reason = (f"no answer within scheduler_service.hit_lookup_timeout_s="
                      f"{self.settings.hit_lookup_timeout_s}s")
        else:
            code, reason = "", repr(e)
        self.log.warning("hit_lookup_failed", request_id=sub.request_id,
                         session_id=sub.session_id, keys=len(sub.keys), code=code,
                         reason=reason, hit_tokens=0, exc_info=e if not code else False)
