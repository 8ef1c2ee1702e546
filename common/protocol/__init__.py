"""The one wire schema: every control message of dualpath as a frozen, tagged msgspec Struct.

Conventions (docs/contributing.md, 'One wire schema'): commands are imperative (``ReadBlocks``),
events past tense, replies ``<Command>Reply`` plus the shared :class:`ErrorReply`. Each channel has
one tagged union; a service decodes with one decoder per channel, built once. Bulk KV bytes never
travel here: they move over UCX (``common.transport``) into buffers posted in advance.

Framing (``common.rpc``): a 4-byte big-endian length, then one msgpack-encoded *envelope*
(:data:`Envelope`). Envelope bodies are ``msgspec.Raw`` so the envelope decoder is fixed and the
body is decoded with the channel's union only once the call is routed.

Handshake on every connection:
    server → ServerHello(version, nonce)         (first frame, before anything else)
    client → Hello(version, role, node_id, kv_fingerprint, auth)
    server → HelloReply(...) or ErrorReply(VERSION_MISMATCH | KV_SPEC_MISMATCH | UNAUTHENTICATED)

Layout: the schema is one namespace, ``common.protocol``, written in one module per channel —
``base`` (:class:`Message`, :class:`ErrorReply`, the version), ``connection`` (handshake, RPC
envelope, admin calls), ``gateway``, ``frontend`` and ``node`` (the scheduler's two channels)
and ``datapath`` (PE receiver ↔ DE loader), ``engine`` (an engine process ↔ its node).
Import messages from here, never from the modules.
"""

from __future__ import annotations

from common.protocol.base import (
    PROTOCOL_VERSION, Message, ErrorReply, ReadSide, union_members,
)
from common.protocol.connection import (
    ServerHello, Hello, HelloReply, HandshakeMsg, Call, Reply, StreamItem, StreamEnd,
    CallError, CancelCall, StreamCredit, Envelope, Ping, Pong, GetStats, GetStatsReply,
    PageSlots, AdminRequest, AdminReply,
)
from common.protocol.gateway import (
    LookupPrefix, LookupPrefixReply, ReadBatch, ReadBlocks, ShmUnavailable, ShmFence,
    ShmFenceReply, ReadBlocksReply, WriteBlocks, WriteSlots, BlocksWritten, WatchTelemetry,
    GatewayTelemetry, GatewayRequest, GatewayReply, GetLimits, GatewayLimits,
)
from common.protocol.frontend import (
    SubmitRequest, RequestQueued, RequestPlaced, FirstToken, AttemptRecord, RequestFinished,
    RequestFailed, RequestEvent, CancelRequest, CancelRequestReply, GetClusterStatus, NodeStatus,
    EngineStatus, ClusterStatus, FrontendRequest, FrontendReply,
)
from common.protocol.node import (
    EngineInfo, RegisterNode, RegisterNodeReply, Heartbeat, HeartbeatReply, EngineLoad,
    FetchWork, Endpoint, DecodeBinding, RequestPlan, Revocation, FetchWorkReply, Stage,
    ReportProgress, ReportProgressReply, NodeRequest, NodeReply, SchedulerRequest,
)
from common.protocol.datapath import (
    LayerSlots, PrepareDecode, PrepareDecodeReply, PullLayers, PullLayersReply, PrefillDone,
    PrefillDoneReply, AbortDecode, AbortDecodeReply, DataPathRequest, DataPathReply,
)
from common.protocol.engine import (
    ENGINE_API_VERSION, ArenaSlot, EnginePrompt, AttachEngine, EngineAttached, NextRequest,
    ClaimRequest, PrefillAssigned, DecodeAssigned, Assigned, WaitLayer, LayerReady, PutLayer,
    FinishPrefill, TookKV, SecondToken, NewBlock, BlockOpened, PutBlock, FinishDecode,
    FailRequest, AbandonRequest, EngineOk, EngineRequest, EngineReply, ReportCounters, EngineAlive,
    CollectiveBegin, CollectiveEnd,
)

__all__ = [
    "PROTOCOL_VERSION", "Message", "ErrorReply", "union_members", "ServerHello", "Hello",
    "HelloReply", "HandshakeMsg", "Call", "Reply", "StreamItem", "StreamEnd", "CallError",
    "CancelCall", "StreamCredit", "Envelope", "Ping", "Pong", "GetStats", "GetStatsReply",
    "PageSlots", "AdminRequest", "AdminReply", "LookupPrefix", "LookupPrefixReply",
    "ReadBatch", "ReadBlocks", "ShmUnavailable", "ShmFence", "ShmFenceReply",
    "ReadBlocksReply", "WriteBlocks", "WriteSlots", "BlocksWritten", "WatchTelemetry",
    "GatewayTelemetry", "GatewayRequest", "GatewayReply", "GetLimits", "GatewayLimits",
    "SubmitRequest", "RequestQueued",
    "RequestPlaced", "FirstToken", "AttemptRecord", "RequestFinished", "RequestFailed", "RequestEvent",
    "CancelRequest", "CancelRequestReply", "GetClusterStatus", "NodeStatus", "EngineStatus",
    "ClusterStatus", "FrontendRequest", "FrontendReply", "EngineInfo", "RegisterNode",
    "RegisterNodeReply", "Heartbeat", "HeartbeatReply", "EngineLoad", "FetchWork", "Endpoint",
    "DecodeBinding", "RequestPlan", "Revocation", "FetchWorkReply", "Stage", "ReportProgress",
    "ReportProgressReply", "NodeRequest", "NodeReply", "SchedulerRequest", "LayerSlots",
    "PrepareDecode", "PrepareDecodeReply", "PullLayers", "PullLayersReply", "PrefillDone",
    "PrefillDoneReply", "AbortDecode", "AbortDecodeReply", "DataPathRequest", "DataPathReply",
    "ENGINE_API_VERSION", "ArenaSlot", "EnginePrompt", "AttachEngine", "EngineAttached",
    "NextRequest", "ClaimRequest", "PrefillAssigned", "DecodeAssigned", "Assigned", "WaitLayer",
    "LayerReady", "PutLayer", "FinishPrefill", "TookKV", "SecondToken", "NewBlock",
    "BlockOpened", "PutBlock", "FinishDecode", "FailRequest", "AbandonRequest", "EngineOk", "EngineRequest",
    "EngineReply", "ReportCounters", "EngineAlive", "CollectiveBegin", "CollectiveEnd", "ReadSide",
]
