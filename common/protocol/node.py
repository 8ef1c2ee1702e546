"""Scheduler node channel: registration and leases, work fetches, progress reports."""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from common.protocol.base import ErrorReply, Message, ReadSide
from common.protocol.connection import GetStats, Ping
from common.protocol.frontend import CancelRequest, GetClusterStatus, SubmitRequest


# =========================================================================== scheduler: node channel
# Node services ↔ scheduler. Every node service (PE receiver = prefill group leader, DE loader =
# decode group leader, storage gateway, engine emulator) registers with an ``epoch`` (any number
# that grows with each restart) and keeps its lease with Heartbeat (or any call). Group leaders
# pull work with FetchWork every ``fetch_interval_s`` and report progress per request attempt.
# A NOT_FOUND answer to Heartbeat/FetchWork means the lease is gone: drop all work and register
# again with a higher epoch. Sequence and rules: docs/frontend-api.md ("Node services").

class EngineInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine a group leader registers; ``hbm_capacity_bytes`` = HBM for KV (DEs), its
    node's KV buffer, the same for every PE of the node (PEs; 0: not stated, not checked)."""

    engine_id: str
    role: str
    hbm_capacity_bytes: int = 0


class RegisterNode(Message, tag="sched.node.register", frozen=True):
    """Register (or re-register with a higher ``epoch``, replacing the old incarnation).

    ``role`` is the node's role ("prefill" / "decode"; "" for role-less services); a service
    that lists ``engines`` is the group leader of that role on the node (one per node and role).
    """

    node_id: str
    service: str
    role: str
    control_host: str
    control_port: int
    ucx_host: str
    ucx_port: int
    engines: list[EngineInfo]
    epoch: int
    # The UCX transport list of the node's KV traffic class (``UCX_TLS`` when set, else the
    # class's ``TLS`` option; "" = not stated). Every node of a cluster must state the same
    # set: hosts that cannot share a transport never connect (issue #17, docs/deploy.md).
    kv_tls: str = ""


class RegisterNodeReply(Message, tag="sched.node.register.reply", frozen=True):
    lease_s: float
    heartbeat_s: float
    fetch_interval_s: float
    block_tokens: int = 64
    fetch_wait_s: float = 0.0       # long-poll: an idle group's empty fetch may be held this long
    # The scheduler's incarnation (v2): a node that re-registers and sees another value knows
    # the scheduler restarted and redelivers the results it kept (docs/frontend-api.md,
    # "Scheduler restart").
    scheduler_epoch: int = 0


class Heartbeat(Message, tag="sched.node.heartbeat", frozen=True):
    """Renew the lease; a gateway may report its node's read queue (tokens) here."""

    node_id: str
    service: str
    epoch: int
    read_q_tokens: int | None = None


class HeartbeatReply(Message, tag="sched.node.heartbeat.reply", frozen=True):
    lease_s: float


class EngineLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Telemetry of one engine (paper §6.1): unfinished requests, their tokens, free HBM (DEs)
    or its node's free KV buffer (PEs)."""

    engine_id: str
    seq: int
    tok: int
    free_hbm_bytes: int | None = None
    # v5: False while the engine, served over its node's engine socket, is not attached (its
    # process died or has not started): the scheduler places nothing on it and re-plans what
    # it held, until the node reports it attached again
    attached: bool = True
    # v6: how many times the engine attached to this node process (0: in-process, or never).
    # "attached" with the number of an attachment known dead is telemetry older than its end
    attaches: int = 0
    # v7 (decode engines): the free bytes of the node's DE buffer, shared by all its decode
    # engines (each attempt stages its KV there from its binding to its write-back), less what
    # the node has taken on and not allocated yet; the scheduler places no more onto the node
    # than this holds (free_hbm_bytes is then the engine's own HBM). None: not stated
    buffer_free_bytes: int | None = None


class FetchWork(Message, tag="sched.node.fetch", frozen=True):
    """A group leader pulls work for its engines, reporting their load.

    ``engines`` (may be empty: the scheduler keeps its own count) and ``read_q_tokens``
    replace the scheduler's figures. ``ack_seq``: the ``seq`` of the last reply processed;
    when it is behind, the scheduler sends that reply again (at-least-once delivery; ``None``
    = at most once). ``group_id`` "" = ``node_id``. ``wait_s`` > 0: long-poll — when every
    reported engine is idle and there is nothing to send, the scheduler holds the call until
    work for the group appears or ``min(wait_s, scheduler_service.fetch_wait_s)`` passes, so
    an idle cluster does not poll every ``fetch_interval_s``.
    """

    node_id: str
    group_id: str
    role: str
    epoch: int
    engines: list[EngineLoad] = []
    read_q_tokens: int | None = None
    ack_seq: int | None = None
    wait_s: float = 0.0


class Endpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where to reach a node service: control RPC and UCX listener."""

    node_id: str
    service: str
    control_host: str
    control_port: int
    ucx_host: str
    ucx_port: int


class DecodeBinding(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """To a DE loader: this request attempt is bound to ``de_engine``; reserve for it.

    The PE receiver of the plan contacts the loader later (read side, keys, layers).
    """

    request_id: str
    attempt: int
    session_id: str
    de_engine: str
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int
    hbm_bytes: int
    deadline_s: float | None = None


class RequestPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """To a PE receiver: everything needed to run one request attempt.

    ``read_side`` "pe": read ``hit_keys`` through this node's gateway; "de": the DE loader
    reads them through its gateway and streams the layers; "split": the DE loader reads the
    leading ``split_tokens`` through ``split_gateway`` (its node's) and streams them, this node
    reads the rest of the hit through ``read_gateway`` at the same time; "none": nothing to read.
    ``read_gateway`` is the read node's gateway (None when unregistered or nothing to read).
    ``new_keys`` are the keys of the prompt's full blocks after the hit (to persist).
    ``deadline_s`` is the budget left at dispatch (None: no deadline).
    """

    request_id: str
    attempt: int
    session_id: str
    pe_engine: str
    pe_node: str
    de_engine: str
    de_node: str
    read_side: ReadSide
    read_node: str
    hit_tokens: int
    new_tokens: int
    gen_tokens: int
    hbm_bytes: int
    hit_keys: list[str]
    new_keys: list[str]
    de_loader: Endpoint | None = None
    read_gateway: Endpoint | None = None
    deadline_s: float | None = None
    # The prompt's partial last block (``prompt_tokens % block_tokens`` ids) when the frontend
    # sent token ids: the decode side keys generated blocks with it (None: not known).
    tail_token_ids: list[int] | None = None
    split_tokens: int = 0                       # read_side "split": the DE's leading part
    split_gateway: Endpoint | None = None       # read_side "split": the DE node's gateway


class Revocation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Drop this request attempt and free what it holds (cancelled, failed, re-planned)."""

    request_id: str
    attempt: int
    reason: str


class FetchWorkReply(Message, tag="sched.node.fetch.reply", frozen=True):
    """Work for the group. Apply ``revoked`` first; ``more``: fetch again at once."""

    seq: int
    bindings: list[DecodeBinding]
    plans: list[RequestPlan]
    revoked: list[Revocation]
    more: bool = False
    # v2: the epoch of the scheduler that sent it (fencing: a node refuses a reply from an
    # epoch below the highest it has seen — a deposed leader's plans)
    scheduler_epoch: int = 0


# The stages a node reports, in the order an attempt reaches them ("failed" may come at any
# point). A Literal so a stage the scheduler does not know fails at decode, as a typed
# INVALID_ARGUMENT, before any handler runs.
Stage = Literal["allocated", "read_done", "prefill_done", "first_token", "second_token",
                "finished", "failed", "dropped"]


class ReportProgress(Message, tag="sched.node.progress", frozen=True):
    """A stage of one request attempt.

    ``stage``: "allocated" (buffers held, read issued), "read_done", "prefill_done" (the PE
    is free; implies the first token), "first_token", "second_token" (first decoded token),
    "finished" (``tokens`` generated), "failed" (``code``, ``message``, ``retryable``, and
    the failed ``hop``, e.g. "gateway", "de_loader", "engine").

    "dropped" (v4): the node let go of an attempt it was told to drop (a revocation, the
    PE's ``AbortDecode``) after its storage read had finished; it carries only the read
    counts below and moves nothing (the reply is always ``current=False``).

    ``read_bytes`` (with "failed" / "dropped"): storage bytes the attempt read, as the
    gateway counted them, as far as this node knows (the PE's read on the PE path, the DE's
    hit read on the DE path, the PE's count includes the DE's once the DE answered; 0 when
    nothing was read). ``pe_read_bytes`` / ``de_read_bytes`` (v4): this node's *own* read,
    by the side it read for. The scheduler charges the attempt max(``read_bytes``, PE part
    + DE part) over all reports of it, so a split read's two parts add up and a dropped
    node's read still counts. A retry reads again, so the replay's storage check adds these
    to the final attempts' hits (docs/frontend-api.md, "Retried attempts re-read").
    """

    request_id: str
    attempt: int
    stage: Stage
    tokens: int = 0
    code: str = ""
    message: str = ""
    retryable: bool = False
    hop: str = ""
    node_id: str = ""
    output_token_ids: list[int] | None = None   # with "finished": the generated token ids
    read_bytes: int = 0
    # v2: ``RegisterNodeReply.scheduler_epoch`` of the scheduler that planned the attempt
    # (0: the current one). A report from an earlier incarnation is a redelivered result.
    scheduler_epoch: int = 0
    # v4: this node's own part of ``read_bytes``, by the side it read for
    pe_read_bytes: int = 0
    de_read_bytes: int = 0
    # v6 (with "failed"): the attempt failed because this engine's process detached from the
    # node — its attachment number ``engine_attaches`` ended. The scheduler takes the engine
    # out of placement before the request re-plans (docs/engine-api.md "An engine that is not
    # attached")
    detached_engine: str = ""
    engine_attaches: int = 0


class ReportProgressReply(Message, tag="sched.node.progress.reply", frozen=True):
    """``current`` False: the attempt is no longer live (``state``); drop its work."""

    current: bool
    state: str


NodeRequest = Union[RegisterNode, Heartbeat, FetchWork, ReportProgress]
NodeReply = Union[RegisterNodeReply, HeartbeatReply, FetchWorkReply, ReportProgressReply,
                  ErrorReply]

# The scheduler serves both channels (and the admin Ping/GetStats) on one port.
SchedulerRequest = Union[SubmitRequest, CancelRequest, GetClusterStatus, RegisterNode,
                         Heartbeat, FetchWork, ReportProgress, Ping, GetStats]
