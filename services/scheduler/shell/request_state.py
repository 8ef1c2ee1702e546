"""One request inside the scheduler service: its checked submission, progress and timestamps.

Status (issue 5) — never stored, derived (:meth:`RequestState.status`) from the core's
``Phase`` of the request, the current attempt's progress reports, and the terminal outcome the
request table records once::

    queued ──▶ placed ──▶ loading ──▶ prefilling ──▶ decoding ──▶ finished
       ▲          │           │            │              │
       └──────────┴── re-plan (retryable failure, lease expiry; ≤ max_replans) ──┘
                         any status ──▶ failed / cancelled

* queued: accepted (hit lookup, then waiting for a DE and a PE in the core's queues: phase
  ``queued`` or ``bound``);
* placed: the core chose (PE, DE, read side) in a PE group fetch (phase ``placed``);
* loading: the plan went to the PE receiver, or its ``allocated`` report (buffers held, read
  issued) came;
* prefilling: ``read_done`` (hit KV read from storage);
* decoding: ``prefill_done`` (phase ``decoding``) or ``first_token``; finished: ``finished``.

A re-plan starts a new attempt: its progress is forgotten and the core puts the request back in
a queue, so the status is ``queued`` again without anyone setting it.

Timestamps are the event loop's monotonic clock. TTFT breakdown (paper §7, Figure 12):
Sch. = submit → placed (queueing and scheduling wait, including earlier failed attempts),
A. = placed → allocated (or dispatched), R. = → read_done (0 without a hit), PF. = → first
token. Missing or out-of-order stamps collapse onto their neighbours, so the four parts are
never negative and always add up to TTFT.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Sequence
from typing import Any

import msgspec

from common.errors import InvalidArgument
from common.kv import block_keys_from_tokens, validate_keys
from common.protocol import (AttemptRecord, FirstToken, RequestEvent, RequestFailed,
                             RequestFinished, SubmitRequest)

from ..core.records import Assignment, Phase
from ..service_config import SchedulerServiceConfig


class Status(enum.StrEnum):
    """What the status replies and logs call a request's standing (derived, never stored)."""

    QUEUED = "queued"
    PLACED = "placed"
    LOADING = "loading"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset((Status.FINISHED, Status.FAILED, Status.CANCELLED))
LIVE = tuple(s for s in Status if s not in TERMINAL)

# Put in a superseded event queue (``RequestState.attach``): that stream ends, the request lives.
SUPERSEDED: Any = object()


class Submission(msgspec.Struct, frozen=True):
    """A SubmitRequest after every check: keys derived, lengths consistent."""

    request_id: str
    session_id: str
    prompt_tokens: int
    gen_tokens: int
    keys: tuple[str, ...]
    hit_tokens: int | None          # None: look it up
    deadline_s: float | None
    tail_token_ids: tuple[int, ...] | None = None   # the partial last block, from token_ids


def check_submit(msg: SubmitRequest, cfg: SchedulerServiceConfig,
                 block_tokens: int) -> Submission:
    """Validate a submission (InvalidArgument naming the field); derive keys from token ids."""
    _check_id("request_id", msg.request_id, cfg.max_id_chars)
    _check_id("session_id", msg.session_id, cfg.max_id_chars)
    rid = msg.request_id
    if not 1 <= msg.prompt_tokens <= cfg.max_prompt_tokens:
        raise InvalidArgument(f"request {rid!r}: prompt_tokens={msg.prompt_tokens} must be in "
                              f"[1, {cfg.max_prompt_tokens}]")
    if not 1 <= msg.gen_tokens <= cfg.max_gen_tokens:
        raise InvalidArgument(f"request {rid!r}: gen_tokens={msg.gen_tokens} must be in "
                              f"[1, {cfg.max_gen_tokens}] (the first token counts)")
    keys = _keys(msg, cfg, block_tokens)
    if msg.hit_tokens is not None:
        _check_hit(msg, keys, block_tokens)
    if msg.deadline_s is not None and not (msg.deadline_s > 0 and math.isfinite(msg.deadline_s)):
        raise InvalidArgument(f"request {rid!r}: deadline_s={msg.deadline_s} must be a positive "
                              f"number of seconds (or omitted)")
    tail = None
    if msg.token_ids is not None:
        tail = tuple(msg.token_ids[len(keys) * block_tokens:])
    return Submission(rid, msg.session_id, msg.prompt_tokens, msg.gen_tokens, tuple(keys),
                      msg.hit_tokens, msg.deadline_s, tail)


def _check_id(name: str, value: str, limit: int) -> None:
    if not value or len(value) > limit or not value.isprintable():
        raise InvalidArgument(f"{name} {value[:80]!r} must be 1..{limit} printable characters")


def _keys(msg: SubmitRequest, cfg: SchedulerServiceConfig, block_tokens: int) -> list[str]:
    rid = msg.request_id
    if msg.token_ids is not None:
        if msg.block_keys:
            raise InvalidArgument(f"request {rid!r}: give block_keys or token_ids, not both")
        if len(msg.token_ids) != msg.prompt_tokens:
            raise InvalidArgument(f"request {rid!r}: {len(msg.token_ids)} token_ids but "
                                  f"prompt_tokens={msg.prompt_tokens}")
        return block_keys_from_tokens(msg.token_ids, block_tokens)
    if len(msg.block_keys) > cfg.max_block_keys:
        raise InvalidArgument(f"request {rid!r}: {len(msg.block_keys)} block keys, more than "
                              f"the limit of {cfg.max_block_keys} (scheduler_service.max_block_keys)")
    keys = validate_keys(msg.block_keys)
    full = msg.prompt_tokens // block_tokens
    if len(keys) > full:
        raise InvalidArgument(f"request {rid!r}: {len(keys)} block keys but a {msg.prompt_tokens}"
                              f"-token prompt has only {full} full {block_tokens}-token blocks")
    return keys


def _check_hit(msg: SubmitRequest, keys: Sequence[str], block_tokens: int) -> None:
    rid, hit = msg.request_id, msg.hit_tokens
    if not 0 <= hit < msg.prompt_tokens:
        raise InvalidArgument(f"request {rid!r}: hit_tokens={hit} must be in [0, prompt_tokens)"
                              f" — at least the last prompt token is computed")
    if keys and (hit % block_tokens or hit > len(keys) * block_tokens):
        raise InvalidArgument(f"request {rid!r}: hit_tokens={hit} must be a multiple of "
                              f"{block_tokens} covering at most the {len(keys)} keys given")


def usable_hit_blocks(blocks: int, keys: int, prompt_tokens: int, block_tokens: int) -> int:
    """Clamp a looked-up hit: within the keys, and leaving at least one token to compute."""
    return max(0, min(blocks, keys, (prompt_tokens - 1) // block_tokens))


class RequestState:
    """Service-side life of one request; the core holds its placement and phase.

    What is stored here is what only the shell knows: the submission, the frontend's event
    stream, the current attempt's progress stamps and placement as sent, the records of ended
    attempts, and — once — the terminal ``outcome``. The request table owns every instance.
    """

    __slots__ = ("sub", "conn_id", "outcome", "hit_tokens", "attempt", "events",
                 "t_submit", "t_placed", "t_dispatched", "t_allocated", "t_read", "t_first",
                 "t_second", "assignment", "de_engine", "de_node", "de_group", "pe_group",
                 "deadline", "hbm_bytes", "attempts", "hit_lookup_failed",
                 "hit_shortfall_tokens", "reads")

    def __init__(self, sub: Submission, conn_id: int, now: float, deadline: float | None) -> None:
        self.sub = sub
        self.conn_id = conn_id           # frontend connection that owns the event stream
        self.outcome: Status | None = None   # set once, by RequestTable.end
        self.hit_tokens = 0
        self.hit_lookup_failed = False   # the storage lookup failed: hit taken as 0
        self.hit_shortfall_tokens = 0    # stored by an earlier turn, not found (stored_prefix)
        self.hbm_bytes = 0
        self.attempt = 0                 # the core's attempt number, copied at submit and
        #                                  at each re-plan (the epoch's base + re-plans)
        self.events: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.t_submit = now
        self.deadline = deadline         # loop time, or None
        self.de_engine = self.de_node = None
        self.de_group: str | None = None  # DE group that got this attempt's binding
        self.pe_group: str | None = None  # PE group that got this attempt's plan
        # How each ended attempt went; bounded by scheduler.max_replans (+1 for the last).
        self.attempts: list[AttemptRecord] = []
        # What nodes reported an attempt read, by attempt: [the largest total a node knew,
        # the PE's own part, the DE's own part] (one entry per attempt: as bounded as above)
        self.reads: dict[int, list[int]] = {}
        self._reset_attempt()

    @property
    def request_id(self) -> str:
        return self.sub.request_id

    @property
    def terminal(self) -> bool:
        return self.outcome is not None

    def progress(self) -> Status:
        """How far the current attempt got, by what was sent and reported for it."""
        if self.t_first is not None:
            return Status.DECODING
        if self.t_read is not None:
            return Status.PREFILLING
        if self.t_allocated is not None or self.t_dispatched is not None:
            return Status.LOADING
        if self.assignment is not None:
            return Status.PLACED
        return Status.QUEUED

    def status(self, phase: Phase | None) -> Status:
        """The request's status from the core's ``phase`` (None: the core does not hold it —
        still in the hit lookup, or being released on its way out) and its outcome."""
        if self.outcome is not None:
            return self.outcome
        if phase is Phase.QUEUED or phase is Phase.BOUND:
            return Status.QUEUED
        if phase is Phase.DECODING:
            return Status.DECODING
        return self.progress()       # placed: the attempt's reports say how far it got

    @property
    def new_tokens(self) -> int:
        return self.sub.prompt_tokens - self.hit_tokens

    def _reset_attempt(self) -> None:
        self.t_placed = self.t_dispatched = self.t_allocated = None
        self.t_read = self.t_first = self.t_second = None
        self.assignment: Assignment | None = None
        self.pe_group = None

    def next_attempt(self, attempt: int, keep_de: bool) -> None:
        """The core re-planned (its ``attempt`` count): forget this attempt's placement and
        progress (the DE too unless the core kept it)."""
        self.attempt = attempt
        self._reset_attempt()
        self.de_group = None
        if not keep_de:
            self.de_engine = self.de_node = None

    def close_attempt(self, outcome: str, hop: str = "", code: str = "",
                      message: str = "") -> AttemptRecord | None:
        """Record how the current attempt ended; None when it was recorded already. An
        attempt that did not finish is charged what its nodes reported reading (a finished
        one's read is the request's hit)."""
        if self.attempts and self.attempts[-1].attempt >= self.attempt:
            return None
        a = self.assignment
        read = 0 if outcome == "finished" else self.read_bytes(self.attempt)
        rec = AttemptRecord(self.attempt, a.pe_node if a else "", self.de_node or "",
                            a.read_side.value if a else "", self.progress().value, outcome,
                            hop[:80], code, message[:500], read)
        self.attempts.append(rec)
        return rec

    def count_read(self, attempt: int, read_bytes: int, pe_bytes: int, de_bytes: int) -> None:
        """A node's account of what ``attempt`` read (its ``failed`` or ``dropped`` report,
        current or late): ``read_bytes`` the total it knew, ``pe_bytes`` / ``de_bytes`` its
        own part. The PE's total includes the DE's part only once the DE answered, so the
        parts of a split read — or a DE read whose PE gave up first — are added, never
        the larger taken. A report of an attempt this request never ran is ignored."""
        i = next((i for i, r in enumerate(self.attempts) if r.attempt == attempt), None)
        if i is None and attempt != self.attempt:
            return
        seen = self.reads.setdefault(attempt, [0, 0, 0])
        for k, n in enumerate((read_bytes, pe_bytes, de_bytes)):
            seen[k] = max(seen[k], n)
        if i is not None and self.attempts[i].outcome != "finished":
            self.attempts[i] = msgspec.structs.replace(self.attempts[i],
                                                       read_bytes=self.read_bytes(attempt))

    def node_account(self, attempt: int, hop: str, code: str, message: str) -> None:
        """The node's own account of how ``attempt`` failed, come after the scheduler closed
        the attempt on its behalf (hop ``scheduler``: the node's telemetry said the attempt's
        engine was not attached before its failure report came): the record takes the node's
        hop, code and message, which say why (the engine died, went silent, got stuck)."""
        i = next((i for i, r in enumerate(self.attempts) if r.attempt == attempt), None)
        if i is None or (self.attempts[i].outcome, self.attempts[i].hop) != ("failed",
                                                                            "scheduler"):
            return
        self.attempts[i] = msgspec.structs.replace(self.attempts[i], hop=hop[:80], code=code,
                                                   message=message[:500])

    def read_bytes(self, attempt: int) -> int:
        """Storage bytes ``attempt`` read, as its nodes reported them (0: none reported)."""
        total, pe, de = self.reads.get(attempt, (0, 0, 0))
        return max(total, pe + de)

    def attach(self, conn_id: int) -> asyncio.Queue:
        """A resubmission of this live request takes over its event stream.

        Events not yet sent move to a fresh queue; the old stream finds ``SUPERSEDED`` in its
        queue and ends without cancelling the request (docs/frontend-api.md, "Resubmitting").
        """
        old, self.events = self.events, asyncio.Queue()
        while not old.empty():
            self.events.put_nowait(old.get_nowait())
        old.put_nowait(SUPERSEDED)
        self.conn_id = conn_id
        return self.events

    def same_request(self, sub: Submission) -> bool:
        """A resubmission is the same request when all but its deadline match."""
        return msgspec.structs.replace(sub, deadline_s=None) == \
            msgspec.structs.replace(self.sub, deadline_s=None)

    def remaining(self, now: float) -> float | None:
        return None if self.deadline is None else max(self.deadline - now, 0.0)

    # ---------------------------------------------------------------- metrics
    def first_token_event(self, now: float) -> FirstToken:
        """Stamp the first token and split TTFT into Sch./A./R./PF."""
        self.t_first = first = now
        submit = self.t_submit
        placed = _clamp(self.t_placed, submit, first)
        alloc = _clamp(self.t_allocated or self.t_dispatched, placed, first)
        read = _clamp(self.t_read, alloc, first)
        return FirstToken(self.request_id, first - submit, placed - submit, alloc - placed,
                          read - alloc, first - read, self.attempt)

    def finished_event(self, tokens: int, now: float,
                       output_token_ids: list[int] | None = None) -> RequestFinished:
        first = self.t_first if self.t_first is not None else now
        tokens = tokens if tokens > 0 else self.sub.gen_tokens
        ttst = None if self.t_second is None else max(self.t_second - first, 0.0)
        tpot = (now - first) / (tokens - 1) if tokens > 1 else 0.0
        return RequestFinished(self.request_id, tokens, first - self.t_submit, ttst, tpot,
                               now - self.t_submit, self.hit_tokens, self.attempt,
                               output_token_ids)

    def failed_event(self, code: str, message: str, retryable: bool,
                     retry_after_s: float | None = None) -> RequestFailed:
        return RequestFailed(self.request_id, code, message, retryable, retry_after_s,
                             self.attempt)


def _clamp(t: float | None, lo: float, hi: float) -> float:
    """``t`` inside [lo, hi]; a missing stamp takes ``lo`` (that part of TTFT is zero)."""
    if t is None:
        return lo
    return min(max(t, lo), hi)
