"""Scheduler frontend channel: submit a request (a stream of events), cancel, status."""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from common.protocol.base import ErrorReply, Message, ReadSide


# =========================================================================== scheduler: frontend channel
# Frontend ↔ scheduler (services/scheduler; docs/frontend-api.md). ``SubmitRequest`` is a
# server-push stream of ``RequestEvent``s: Queued, Placed (again after each re-plan),
# FirstToken, then exactly one of Finished / Failed, then the stream ends. Bad input is a
# ``CallError`` (INVALID_ARGUMENT, ALREADY_EXISTS, OVERLOADED with ``retry_after_s``) instead
# of any event. Leaving the stream (cancel, disconnect) cancels the request. Times are seconds.

class SubmitRequest(Message, tag="sched.submit", frozen=True):
    """Run one turn of a session: place it, load its hit KV, prefill, decode ``gen_tokens``.

    ``block_keys`` (chained keys of the prompt's full blocks, ``common.kv``) or ``token_ids``
    (the prompt itself; keys are derived) tell the scheduler what the prompt is; the hit
    length is looked up from storage unless ``hit_tokens`` is given. ``deadline_s`` is the
    time budget from now; when it runs out the request fails with DEADLINE_EXCEEDED.
    """

    request_id: str
    session_id: str
    prompt_tokens: int
    gen_tokens: int
    block_keys: list[str] = []
    token_ids: list[int] | None = None
    hit_tokens: int | None = None
    deadline_s: float | None = None


class RequestQueued(Message, tag="sched.ev.queued", frozen=True):
    """Accepted; ``position`` requests were waiting for placement ahead of it.
    ``hit_lookup_failed``: the storage lookup failed (every gateway), so ``hit_tokens`` was
    taken as 0 — the request recomputes its prompt (correct, slower)."""

    request_id: str
    position: int
    hit_tokens: int = 0
    hit_lookup_failed: bool = False
    # v2: prompt tokens an earlier turn of the session stored that the lookup did not find
    # (write-backs lost with a DE, or evicted): recomputed, so the hit is shorter by this much
    hit_shortfall_tokens: int = 0


class RequestPlaced(Message, tag="sched.ev.placed", frozen=True):
    """(PE, DE) pair and read side chosen (``read_side``: "pe", "de", "split" or "none";
    ``split_tokens``: on a split read, the hit's leading part the DE's node reads)."""

    request_id: str
    pe_engine: str
    pe_node: str
    de_engine: str
    de_node: str
    read_side: ReadSide
    hit_tokens: int
    attempt: int = 0
    split_tokens: int = 0


class FirstToken(Message, tag="sched.ev.first_token", frozen=True):
    """TTFT and its breakdown (paper §7, Sch./A./R./PF.): ``ttft_s`` = the sum of the four."""

    request_id: str
    ttft_s: float
    sched_s: float
    alloc_s: float
    read_s: float
    prefill_s: float
    attempt: int = 0


class AttemptRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one attempt of a request ended (``RequestFinished`` / ``RequestFailed.attempts``).

    ``stage``: the request state the attempt reached ("loading", "prefilling", "decoding",
    ...). ``outcome``: "finished", "failed" (its ``hop``, ``code`` and ``message``), "replanned"
    or "cancelled". ``read_bytes``: storage bytes a failed attempt read (node reports; a
    finished attempt's read is the request's ``hit_tokens``).
    """

    attempt: int
    pe_node: str
    de_node: str
    read_side: ReadSide | Literal[""]       # "": the attempt ended before placement
    stage: str
    outcome: str
    hop: str = ""
    code: str = ""
    message: str = ""
    read_bytes: int = 0


class RequestFinished(Message, tag="sched.ev.finished", frozen=True):
    """Decode finished: ``tokens`` generated. ``ttst_s`` = second token − first token (None
    when the decode side did not report it); ``tpot_s`` over tokens after the first."""

    request_id: str
    tokens: int
    ttft_s: float
    ttst_s: float | None
    tpot_s: float
    e2e_s: float
    hit_tokens: int
    attempt: int = 0
    output_token_ids: list[int] | None = None   # generated ids (first included), when reported
    attempts: list[AttemptRecord] = []          # every attempt, the last one included
    hit_lookup_failed: bool = False             # the hit was taken as 0 (RequestQueued)
    hit_shortfall_tokens: int = 0               # v2: see RequestQueued


class RequestFailed(Message, tag="sched.ev.failed", frozen=True):
    """The request ended without finishing; ``code`` is a ``common.errors.ErrorCode``."""

    request_id: str
    code: str
    message: str
    retryable: bool = False
    retry_after_s: float | None = None
    attempt: int = 0
    attempts: list[AttemptRecord] = []          # every attempt, the last one included
    hit_lookup_failed: bool = False             # the hit was taken as 0 (RequestQueued)
    hit_shortfall_tokens: int = 0               # v2: see RequestQueued
    # v2: the scheduler stopped without an outcome for it (shutting down): submitting the
    # same request again is safe, and the client does so (docs/frontend-api.md)
    resubmit: bool = False


RequestEvent = Union[RequestQueued, RequestPlaced, FirstToken, RequestFinished, RequestFailed]


class CancelRequest(Message, tag="sched.cancel", frozen=True):
    request_id: str


class CancelRequestReply(Message, tag="sched.cancel.reply", frozen=True):
    """``cancelled`` False: it had already ended (``state`` says how)."""

    request_id: str
    cancelled: bool
    state: str


class GetClusterStatus(Message, tag="sched.status.get", frozen=True):
    pass


class NodeStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered node service and its lease."""

    node_id: str
    service: str
    role: str
    epoch: int
    lease_left_s: float
    control_host: str
    control_port: int
    engines: list[str] = []


class EngineStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The scheduler's view of one engine: seq_e, tok_e, free HBM (DEs), attached."""

    engine_id: str
    node_id: str
    role: str
    seq: int
    tok: int
    free_hbm_bytes: int | None = None
    attached: bool = True       # v5: False: its node reports it not attached (not placed on)


class ClusterStatus(Message, tag="sched.status", frozen=True):
    """Nodes with leases, engines with load, node read queues (tokens), queue lengths
    (global / private / pe / total), requests by state, counters since start."""

    policy: str
    nodes: list[NodeStatus]
    engines: list[EngineStatus]
    read_q: dict[str, int]
    queues: dict[str, int]
    requests: dict[str, int]
    counters: dict[str, int]
    discovery: dict[str, str] = {}      # etcd mode: registered key → "ok …" / "refused: why"


FrontendRequest = Union[SubmitRequest, CancelRequest, GetClusterStatus]
FrontendReply = Union[CancelRequestReply, ClusterStatus, ErrorReply]
