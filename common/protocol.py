"""The one wire schema: every control message of dualpath as a frozen, tagged msgspec Struct.

Conventions (docs/CONVENTIONS.md §1): commands are imperative (``ReadBlocks``), events past
tense, replies ``<Command>Reply`` plus the shared :class:`ErrorReply`. Each channel has one
tagged union; a service decodes with one decoder per channel, built once. Bulk KV bytes never
travel here: they move over UCX (``common.transport``) into buffers posted in advance.

Framing (``common.rpc``): a 4-byte big-endian length, then one msgpack-encoded *envelope*
(:data:`Envelope`). Envelope bodies are ``msgspec.Raw`` so the envelope decoder is fixed and the
body is decoded with the channel's union only once the call is routed.

Handshake on every connection:
    server → ServerHello(version, nonce)         (first frame, before anything else)
    client → Hello(version, role, node_id, kv_fingerprint, auth)
    server → HelloReply(...) or ErrorReply(VERSION_MISMATCH | KV_SPEC_MISMATCH | UNAUTHENTICATED)
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 1


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="t"):
    """Base of every control message. Subclasses set ``tag="area.name"``."""


# --------------------------------------------------------------------------- errors

class ErrorReply(Message, tag="error"):
    """The one error shape on the wire; ``code`` is a ``common.errors.ErrorCode`` value."""

    code: str
    message: str
    retryable: bool = False
    retry_after_s: float | None = None


# --------------------------------------------------------------------------- handshake

class ServerHello(Message, tag="hello.server"):
    """First frame a server sends: its protocol version and a fresh nonce to authenticate."""

    version: int
    nonce: bytes
    service: str = ""


class Hello(Message, tag="hello"):
    """Client's introduction. ``kv_fingerprint`` empty = this client moves no KV (frontends)."""

    version: int
    role: str
    node_id: str
    kv_fingerprint: str = ""
    auth: bytes | None = None     # HMAC-SHA256(secret, nonce) when the server requires a secret


class HelloReply(Message, tag="hello.reply"):
    version: int
    role: str
    node_id: str
    kv_fingerprint: str = ""


HandshakeMsg = Union[ServerHello, Hello, HelloReply, ErrorReply]


# --------------------------------------------------------------------------- RPC envelope

class Call(Message, tag="c", array_like=True):
    """A request. ``deadline_s`` is the time budget left at send time (clocks differ per host)."""

    id: int
    deadline_s: float
    body: msgspec.Raw


class Reply(Message, tag="r", array_like=True):
    id: int
    body: msgspec.Raw


class StreamItem(Message, tag="s", array_like=True):
    """One server-push event of a streaming call."""

    id: int
    body: msgspec.Raw


class StreamEnd(Message, tag="e", array_like=True):
    id: int


class CallError(Message, tag="x", array_like=True):
    """A call (or stream) failed; ``id`` 0 means the connection-level error before closing."""

    id: int
    error: ErrorReply


class CancelCall(Message, tag="k", array_like=True):
    """Client gave up on a call or stream; the server cancels its handler."""

    id: int


class StreamCredit(Message, tag="w", array_like=True):
    """Client → server flow control: the consumer of stream ``id`` can take ``n`` more events.

    A stream starts with one credit (so a mistaken unary call on a stream fails fast); the
    client grants the rest of its window right after the Call and more as it consumes, so a
    slow consumer pauses only its own stream's generator.
    """

    id: int
    n: int


Envelope = Union[Call, Reply, StreamItem, StreamEnd, CallError, CancelCall, StreamCredit]


# --------------------------------------------------------------------------- common control

class Ping(Message, tag="ping"):
    payload: bytes = b""


class Pong(Message, tag="pong"):
    payload: bytes = b""


class GetStats(Message, tag="stats.get"):
    """Ask a service for its counters (buffer pools, transfers, queues)."""


class GetStatsReply(Message, tag="stats.reply"):
    service: str
    node_id: str
    counters: dict[str, float]


class PageSlots(Message, tag="pages.slots", array_like=True):
    """Receiver-side destination of one UCX transfer: ``(offset, nbytes)`` runs in its pool.

    The sender cuts its messages with ``common.transport.plan_messages`` over these slots, the
    receiver posts the same messages, so both agree on tags without per-page control traffic.
    Offsets also make the descriptor usable by a one-sided RMA backend later.
    """

    transfer_id: int
    segments: list[tuple[int, int]]


AdminRequest = Union[Ping, GetStats]
AdminReply = Union[Pong, GetStatsReply, ErrorReply]


def union_members(union) -> tuple[type, ...]:
    """Members of a channel union (for handler-coverage tests)."""
    return tuple(getattr(union, "__args__", (union,)))


# =========================================================================== storage gateway
# Channel of a node's storage gateway (its SNIC). Requesters are the node's PE receiver / DE
# loader (any node in tests), the scheduler (prefix lookups) and operators (stats).

class LookupPrefix(Message, tag="gw.lookup"):
    """How many leading blocks of ``keys`` are stored (the request's hit length in blocks)."""

    keys: list[str]


class LookupPrefixReply(Message, tag="gw.lookup.reply"):
    hit_blocks: int
    read_q_tokens: int


class ReadBatch(Message, tag="gw.read.batch", array_like=True):
    """One UCX transfer of a read: the next ``n_keys`` Full Blocks into the requester's ``slots``.

    The requester posted the receives before sending ReadBlocks; ``slots`` hold exactly
    ``n_keys`` Full Blocks in key order (scattered per layer if the requester wants).
    Several batches let the gateway pipeline: read batch k+1 while batch k is on the wire.

    ``layer_major``: the batch's byte stream is ordered layer by layer instead — layer 0 of
    every block (key order), then layer 1, ... For a requester whose region is laid out
    ``[L, tokens, B]`` the slots of one layer are then contiguous, so each layer of the batch
    travels as one direct message instead of many small packed ones (the gateway scatters
    while reading from disk, at no cost).
    """

    transfer_id: int
    n_keys: int
    slots: list[tuple[int, int]]
    layer_major: bool = False


class ReadBlocks(Message, tag="gw.read"):
    """Read ``keys`` and write them over UCX into the requester's posted receives.

    Every slot is written, found or not: blocks not found (never stored, evicted, corrupt) are
    zero-filled and flagged in the reply, so no receive is ever left dangling; the caller treats
    its hit as the prefix of found blocks and recomputes the rest. If the read fails part-way
    the call ends with its typed error and batches not yet sent are never sent: the requester
    cancels the receives it still has posted (``storage_gateway.client`` does).
    """

    request_id: str
    keys: list[str]
    ucx_host: str
    ucx_port: int
    batches: list[ReadBatch]
    # Same-host shared memory (``common.shm``): when set, ``batches[*].slots`` are offsets in
    # the requester's segment ``/dev/shm/<shm_segment>`` of ``shm_bytes`` and the gateway
    # preads straight into them (no UCX, no receives posted; transfer ids only need to be
    # distinct). A gateway that cannot open the segment answers ``ShmUnavailable``.
    shm_segment: str = ""
    shm_bytes: int = 0


class ShmUnavailable(Message, tag="gw.read.shm_unavailable"):
    """Answer to a shared-memory ReadBlocks the gateway cannot serve that way (segment not
    reachable from its host/container, other uid, shm disabled): nothing was read; the
    requester retries over UCX (and stops asking this gateway for shm)."""

    request_id: str
    reason: str


class ShmFence(Message, tag="gw.read.fence"):
    """Wait until no shared-memory read ``request_id`` into ``shm_segment`` is running.

    A requester whose shm ReadBlocks failed on its side (deadline, cancelled, connection lost)
    sends this before reusing the slots: the gateway may still have been writing into them.
    """

    shm_segment: str
    request_id: str


class ShmFenceReply(Message, tag="gw.read.fence.reply"):
    request_id: str
    waited: int                 # reads that were still running when the fence arrived


class ReadBlocksReply(Message, tag="gw.read.reply"):
    request_id: str
    found: list[bool]
    prefix_blocks: int          # leading blocks found: the usable hit
    corrupt: int                # blocks that failed verification (quarantined, not served)
    nbytes: int
    queued_s: float
    read_s: float
    read_q_tokens: int


class WriteBlocks(Message, tag="gw.write"):
    """Persist Full Blocks a requester holds; a streaming call.

    The gateway answers with one ``WriteSlots`` event (where to send the blocks it does not
    have yet; it posted those receives), the requester sends them over UCX, and the gateway
    ends with ``BlocksWritten`` once every new block is durable (fsync + rename).
    """

    request_id: str
    keys: list[str]
    ucx_host: str
    ucx_port: int


class WriteSlots(Message, tag="gw.write.slots"):
    """Which keys to send (``send[i]``) and the slots of the one transfer carrying them."""

    request_id: str
    send: list[bool]
    transfer_id: int
    slots: list[tuple[int, int]]


class BlocksWritten(Message, tag="gw.write.done"):
    request_id: str
    written: int                # new blocks made durable
    duplicates: int             # keys already stored (no-op)
    nbytes: int


class WatchTelemetry(Message, tag="gw.watch"):
    """Subscribe to the gateway's telemetry every ``interval_s`` (a streaming call)."""

    interval_s: float = 0.5


class GatewayTelemetry(Message, tag="gw.telemetry"):
    node_id: str
    read_q_tokens: int
    bytes_read: int
    bytes_written: int
    blocks_stored: int


GatewayRequest = Union[LookupPrefix, ReadBlocks, WriteBlocks, WatchTelemetry, Ping, GetStats,
                       ShmFence]
GatewayReply = Union[LookupPrefixReply, ReadBlocksReply, WriteSlots, BlocksWritten,
                     GatewayTelemetry, Pong, GetStatsReply, ErrorReply, ShmUnavailable,
                     ShmFenceReply]


# =========================================================================== scheduler: frontend channel
# Frontend ↔ scheduler (services/scheduler; docs/frontend-api.md). ``SubmitRequest`` is a
# server-push stream of ``RequestEvent``s: Queued, Placed (again after each re-plan),
# FirstToken, then exactly one of Finished / Failed, then the stream ends. Bad input is a
# ``CallError`` (INVALID_ARGUMENT, ALREADY_EXISTS, OVERLOADED with ``retry_after_s``) instead
# of any event. Leaving the stream (cancel, disconnect) cancels the request. Times are seconds.

class SubmitRequest(Message, tag="sched.submit"):
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


class RequestQueued(Message, tag="sched.ev.queued"):
    """Accepted; ``position`` requests were waiting for placement ahead of it."""

    request_id: str
    position: int
    hit_tokens: int = 0


class RequestPlaced(Message, tag="sched.ev.placed"):
    """(PE, DE) pair and read side chosen (``read_side``: "pe", "de" or "none")."""

    request_id: str
    pe_engine: str
    pe_node: str
    de_engine: str
    de_node: str
    read_side: str
    hit_tokens: int
    attempt: int = 0


class FirstToken(Message, tag="sched.ev.first_token"):
    """TTFT and its breakdown (paper §7, Sch./A./R./PF.): ``ttft_s`` = the sum of the four."""

    request_id: str
    ttft_s: float
    sched_s: float
    alloc_s: float
    read_s: float
    prefill_s: float
    attempt: int = 0


class RequestFinished(Message, tag="sched.ev.finished"):
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


class RequestFailed(Message, tag="sched.ev.failed"):
    """The request ended without finishing; ``code`` is a ``common.errors.ErrorCode``."""

    request_id: str
    code: str
    message: str
    retryable: bool = False
    retry_after_s: float | None = None
    attempt: int = 0


RequestEvent = Union[RequestQueued, RequestPlaced, FirstToken, RequestFinished, RequestFailed]


class CancelRequest(Message, tag="sched.cancel"):
    request_id: str


class CancelRequestReply(Message, tag="sched.cancel.reply"):
    """``cancelled`` False: it had already ended (``state`` says how)."""

    request_id: str
    cancelled: bool
    state: str


class GetClusterStatus(Message, tag="sched.status.get"):
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
    """The scheduler's view of one engine: seq_e, tok_e, free HBM (DEs)."""

    engine_id: str
    node_id: str
    role: str
    seq: int
    tok: int
    free_hbm_bytes: int | None = None


class ClusterStatus(Message, tag="sched.status"):
    """Nodes with leases, engines with load, node read queues (tokens), queue lengths
    (global / private / pe / total), requests by state, counters since start."""

    policy: str
    nodes: list[NodeStatus]
    engines: list[EngineStatus]
    read_q: dict[str, int]
    queues: dict[str, int]
    requests: dict[str, int]
    counters: dict[str, int]


FrontendRequest = Union[SubmitRequest, CancelRequest, GetClusterStatus]
FrontendReply = Union[CancelRequestReply, ClusterStatus, ErrorReply]


# =========================================================================== scheduler: node channel
# Node services ↔ scheduler. Every node service (PE receiver = prefill group leader, DE loader =
# decode group leader, storage gateway, engine emulator) registers with an ``epoch`` (any number
# that grows with each restart) and keeps its lease with Heartbeat (or any call). Group leaders
# pull work with FetchWork every ``fetch_interval_s`` and report progress per request attempt.
# A NOT_FOUND answer to Heartbeat/FetchWork means the lease is gone: drop all work and register
# again with a higher epoch. Sequence and rules: docs/frontend-api.md ("Node services").

class EngineInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine a group leader registers; ``hbm_capacity_bytes`` = HBM for KV (DEs)."""

    engine_id: str
    role: str
    hbm_capacity_bytes: int = 0


class RegisterNode(Message, tag="sched.node.register"):
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


class RegisterNodeReply(Message, tag="sched.node.register.reply"):
    lease_s: float
    heartbeat_s: float
    fetch_interval_s: float
    block_tokens: int = 64
    fetch_wait_s: float = 0.0       # long-poll: an idle group's empty fetch may be held this long


class Heartbeat(Message, tag="sched.node.heartbeat"):
    """Renew the lease; a gateway may report its node's read queue (tokens) here."""

    node_id: str
    service: str
    epoch: int
    read_q_tokens: int | None = None


class HeartbeatReply(Message, tag="sched.node.heartbeat.reply"):
    lease_s: float


class EngineLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Telemetry of one engine (paper §6.1): unfinished requests, their tokens, free HBM."""

    engine_id: str
    seq: int
    tok: int
    free_hbm_bytes: int | None = None


class FetchWork(Message, tag="sched.node.fetch"):
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
    reads them through its gateway and streams the layers; "none": nothing to read.
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
    read_side: str
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


class Revocation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Drop this request attempt and free what it holds (cancelled, failed, re-planned)."""

    request_id: str
    attempt: int
    reason: str


class FetchWorkReply(Message, tag="sched.node.fetch.reply"):
    """Work for the group. Apply ``revoked`` first; ``more``: fetch again at once."""

    seq: int
    bindings: list[DecodeBinding]
    plans: list[RequestPlan]
    revoked: list[Revocation]
    more: bool = False


class ReportProgress(Message, tag="sched.node.progress"):
    """A stage of one request attempt.

    ``stage``: "allocated" (buffers held, read issued), "read_done", "prefill_done" (the PE
    is free; implies the first token), "first_token", "second_token" (first decoded token),
    "finished" (``tokens`` generated), "failed" (``code``, ``message``, ``retryable``, and
    the failed ``hop``, e.g. "gateway", "de_loader", "engine").
    """

    request_id: str
    attempt: int
    stage: str
    tokens: int = 0
    code: str = ""
    message: str = ""
    retryable: bool = False
    hop: str = ""
    node_id: str = ""
    output_token_ids: list[int] | None = None   # with "finished": the generated token ids


class ReportProgressReply(Message, tag="sched.node.progress.reply"):
    """``current`` False: the attempt is no longer live (``state``); drop its work."""

    current: bool
    state: str


NodeRequest = Union[RegisterNode, Heartbeat, FetchWork, ReportProgress]
NodeReply = Union[RegisterNodeReply, HeartbeatReply, FetchWorkReply, ReportProgressReply,
                  ErrorReply]

# The scheduler serves both channels (and the admin Ping/GetStats) on one port.
SchedulerRequest = Union[SubmitRequest, CancelRequest, GetClusterStatus, RegisterNode,
                         Heartbeat, FetchWork, ReportProgress, Ping, GetStats]


# =========================================================================== data path
# PE receiver ↔ DE loader (services/pe_receiver, services/de_loader; docs/datapath.md). The DE
# loader serves this channel; the PE receiver of a plan is the client. KV bytes move over UCX
# (``common.transport``) into receives posted in advance; these messages only say where.
# A request region is laid out ``[L, prompt_tokens, B]`` on both sides, so one layer of one
# request is one contiguous run: each ``LayerSlots`` is normally a single ``(offset, nbytes)``.
#
#   PE → DE  PrepareDecode     DE allocates; PE/none path: posts receives for every layer
#                              ``[l, 0:prompt]`` (reply.forward); DE path: starts its read.
#   PE → DE  PullLayers        (DE path) PE posted receives for layers' ``[l, 0:hit]``; the DE
#                              sends them once its read is done and posts receives for the
#                              return of ``[l, hit:prompt]`` (reply.returns, reply.hit_tokens).
#   PE → DE  PrefillDone       all layers sent; DE answers once every receive completed.
#   PE → DE  AbortDecode       the PE gave up on the attempt: the DE frees it.

class LayerSlots(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One layer's transfer: the receiver's ``transfer_id`` and its arena ``slots``."""

    layer: int
    transfer_id: int
    slots: list[tuple[int, int]]


class PrepareDecode(Message, tag="dp.prepare"):
    """Reserve the DE region of one request attempt and set up its read side.

    ``hit_tokens``: the planned hit (a multiple of the block size, covered by ``hit_keys``).
    ``ucx_host``/``ucx_port``: the PE receiver's page transport. ``read_gateway``: where the
    DE reads the hit on the DE path (None: the loader's own node gateway).
    """

    request_id: str
    attempt: int
    session_id: str
    de_engine: str
    pe_node: str
    read_side: str
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int
    hit_keys: list[str]
    new_keys: list[str]
    ucx_host: str
    ucx_port: int
    tail_token_ids: list[int] | None = None
    read_gateway: Endpoint | None = None
    deadline_s: float | None = None


class PrepareDecodeReply(Message, tag="dp.prepare.reply"):
    """``forward``: per layer, where the PE sends ``[l, 0:prompt]`` (PE/none path; [] on DE)."""

    request_id: str
    attempt: int
    forward: list[LayerSlots]


class PullLayers(Message, tag="dp.pull"):
    """DE path: send these layers' hit KV ``[l, 0:hit_tokens]`` into the PE's posted slots.

    Consecutive entries with the same ``transfer_id`` are one transfer (the layers' bytes in
    the listed order): one posted receive and one send for several layers.
    """

    request_id: str
    attempt: int
    layers: list[LayerSlots]


class PullLayersReply(Message, tag="dp.pull.reply"):
    """The layers were sent. ``hit_tokens``: the usable hit after the DE's read (a missing
    block shortens it; the PE computes the rest); ``returns``: where the PE sends each pulled
    layer's ``[l, hit_tokens:prompt]`` back."""

    request_id: str
    attempt: int
    hit_tokens: int
    returns: list[LayerSlots]


class PrefillDone(Message, tag="dp.prefill_done"):
    """Every layer was sent. ``hit_tokens``: the hit the PE used (its read on the PE path)."""

    request_id: str
    attempt: int
    hit_tokens: int
    first_token_id: int | None = None


class PrefillDoneReply(Message, tag="dp.prefill_done.reply"):
    """The DE holds the full prompt KV of the attempt."""

    request_id: str
    attempt: int


class AbortDecode(Message, tag="dp.abort"):
    request_id: str
    attempt: int
    reason: str = ""


class AbortDecodeReply(Message, tag="dp.abort.reply"):
    request_id: str
    aborted: bool


DataPathRequest = Union[PrepareDecode, PullLayers, PrefillDone, AbortDecode, Ping, GetStats]
DataPathReply = Union[PrepareDecodeReply, PullLayersReply, PrefillDoneReply, AbortDecodeReply,
                      Pong, GetStatsReply, ErrorReply]
