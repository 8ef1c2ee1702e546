"""The transitions both channels share: how a request ends, is re-planned, or finishes.

A request ends for many reasons — finished, failed on a node, over its deadline, cancelled by
its frontend, given up after ``max_replans``, the scheduler stopping — and every one must do
the same things in the same order: close the attempt's record, release the core, revoke the
work sent to nodes, count, and push the last event. :meth:`RequestLifecycle.end` is that one
way out; the table records the outcome. A re-plan (a node's retryable failure, a lease expiry)
mirrors the core's decision: the core has already requeued or given up, and the shell revokes
the old attempt and copies the core's attempt count (:meth:`RequestLifecycle.after_replan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from common.errors import DualpathError
from common.kv import ROOT_KEY, block_keys_from_tokens
from common.metrics import observe_failed_attempt, observe_request
from common.protocol import ReportProgress, RequestFailed, RequestFinished

from ..core.records import Phase
from ..core.scheduler import Scheduler
from .dispatch import Outboxes
from .hit_lookup import HitLookup
from .longpoll import WorkSignal
from .request_state import RequestState, Status, Submission
from .stored_prefix import PromisedPrefixes
from .table import RequestTable, loop_now


class RequestLifecycle:
    """Ends, re-plans and finishes requests over the core, the table and the outboxes."""

    def __init__(self, core: Scheduler, table: RequestTable, outboxes: Outboxes, *,
                 hits: HitLookup, promised: PromisedPrefixes, block_tokens: int,
                 counters: dict[str, int], work: WorkSignal, log: Any) -> None:
        self.core, self.table, self.outboxes = core, table, outboxes
        self.hits, self.promised, self.block_tokens = hits, promised, block_tokens
        self.counters, self.work, self.log = counters, work, log

    def end(self, rs: RequestState, outcome: Status,
            event: RequestFailed | RequestFinished) -> None:
        """The one way out: release the core, revoke dispatched work, push the last event."""
        if rs.terminal:
            return
        event = self._with_attempts(rs, outcome, event)
        self.core.cancel(rs.request_id)     # a no-op once the core has let it go
        if outcome is not Status.FINISHED:
            self.revoke(rs, getattr(event, "message", outcome.value))
            self.counters["cancelled" if outcome is Status.CANCELLED else "failed"] += 1
        else:
            observe_request(event)          # TTFT/TTST/TPOT histograms (common.metrics)
        self.table.end(rs, outcome, event)
        self.work.kick()                    # ended: held fetches look again
        self.log.info("request_ended", request_id=rs.request_id, state=outcome.value,
                      attempt=rs.attempt, hit_tokens=rs.hit_tokens,
                      hit_lookup_failed=rs.hit_lookup_failed,
                      prompt_tokens=rs.sub.prompt_tokens, **_summary(event))

    def after_replan(self, requeued: Sequence[str], failed: Sequence[str], reason: str,
                     code: str) -> None:
        """Mirror the core's re-plans: revoke the old attempt, queue the new one, or fail."""
        for rid in requeued:
            rs = self.table.get(rid)
            if rs is None:
                continue
            self.close_attempt(rs, "failed", "scheduler", code, reason)
            self.revoke(rs, reason)
            phase, attempt = self.core.held(rid) or (None, rs.attempt + 1)
            keep_de = phase is Phase.BOUND
            rs.next_attempt(attempt, keep_de)
            self.counters["replans"] += 1
            if keep_de:                          # same DE, new attempt: tell its loader again
                self.outboxes.rebind(rs)
            self.log.info("request_replanned", request_id=rid, attempt=rs.attempt,
                          kept_de=keep_de, reason=reason)
        for rid in failed:
            rs = self.table.get(rid)
            if rs is None:
                continue
            limit = self.core.config.max_replans   # the core gave up on it already
            self.end(rs, Status.FAILED, rs.failed_event(
                code, f"{reason}; gave up after {limit} re-plans (scheduler.max_replans)",
                True))

    def close_attempt(self, rs: RequestState, outcome: str, hop: str, code: str,
                      message: str) -> None:
        """Record how the current attempt ended (once); a failure is counted per hop/code."""
        rec = rs.close_attempt(outcome, hop, code, message)
        if rec is None or outcome != "failed":
            return
        self.counters["attempts_failed"] += 1
        observe_failed_attempt(rec.hop, rec.code)   # dualpath_failed_attempts_total
        self.log.info("attempt_failed", request_id=rs.request_id, attempt=rec.attempt,
                      hop=rec.hop, code=rec.code, stage=rec.stage, read_bytes=rec.read_bytes,
                      reason=rec.message)

    def revoke(self, rs: RequestState, reason: str) -> None:
        """The groups that got ``rs``'s current attempt drop it (next fetch reply)."""
        self.counters["revocations_sent"] += self.outboxes.revoke(rs, reason)
        self.work.kick()

    def stored(self, rs: RequestState, output_token_ids: list[int] | None) -> None:
        """``rs`` finished: what it left in storage is the session's next hit."""
        keys = _stored_keys(rs.sub, output_token_ids, self.block_tokens)
        self.hits.finished(rs.sub.session_id, keys)
        self.promised.finished(rs.sub.session_id, keys)

    def finish_kept(self, rs: RequestState, kept: ReportProgress, why: str) -> None:
        """End ``rs`` with a result a node finished under an earlier scheduler (not redone)."""
        self.core.cancel(rs.request_id)
        self.revoke(rs, f"finished under an earlier scheduler ({why})")
        self.counters["results_recovered"] += 1
        self.stored(rs, kept.output_token_ids)
        self.log.info("result_recovered", request_id=rs.request_id, attempt=kept.attempt,
                      node=kept.node_id, scheduler_epoch=kept.scheduler_epoch, why=why)
        self.end(rs, Status.FINISHED, rs.finished_event(kept.tokens, loop_now(),
                                                        kept.output_token_ids))

    def _with_attempts(self, rs: RequestState, outcome: Status,
                       event: RequestFailed | RequestFinished) -> RequestFailed | RequestFinished:
        """Close the last attempt and put every attempt's record into the final event."""
        if isinstance(event, RequestFinished):
            self.close_attempt(rs, "finished", "", "", "")
        else:
            self.close_attempt(rs, outcome.value, "scheduler", event.code, event.message)
        return msgspec.structs.replace(event, attempts=list(rs.attempts),
                                       hit_lookup_failed=rs.hit_lookup_failed,
                                       hit_shortfall_tokens=rs.hit_shortfall_tokens)


def _stored_keys(sub: Submission, output_token_ids: list[int] | None,
                 block_tokens: int) -> tuple[str, ...]:
    """Prompt keys plus the generated blocks the decode side wrote back (data path rule:
    full blocks of prompt + output without its last token, whose KV is not computed yet)."""
    if not output_token_ids or sub.tail_token_ids is None:
        return sub.keys
    parent = sub.keys[-1] if sub.keys else ROOT_KEY
    more = list(sub.tail_token_ids) + list(output_token_ids[:-1])
    try:
        return sub.keys + tuple(block_keys_from_tokens(more, block_tokens, parent))
    except DualpathError:       # out-of-range ids from a node: keep what is certain
        return sub.keys


def _summary(event: RequestFailed | RequestFinished) -> dict[str, Any]:
    if isinstance(event, RequestFinished):
        return {"tokens": event.tokens, "ttft_ms": round(event.ttft_s * 1e3, 3),
                "e2e_ms": round(event.e2e_s * 1e3, 3)}
    return {"code": event.code, "reason": event.message}
