"""Connection-level messages every channel shares: the handshake, the RPC envelope
and the admin calls (Ping, GetStats)."""

from __future__ import annotations

from typing import Union

import msgspec

from common.protocol.base import ErrorReply, Message


# --------------------------------------------------------------------------- handshake

class ServerHello(Message, tag="hello.server", frozen=True):
    """First frame a server sends: its protocol version and a fresh nonce to authenticate."""

    version: int
    nonce: bytes
    service: str = ""


class Hello(Message, tag="hello", frozen=True):
    """Client's introduction. ``kv_fingerprint`` empty = this client moves no KV (frontends)."""

    version: int
    role: str
    node_id: str
    kv_fingerprint: str = ""
    auth: bytes | None = None     # HMAC-SHA256(secret, nonce) when the server requires a secret


class HelloReply(Message, tag="hello.reply", frozen=True):
    version: int
    role: str
    node_id: str
    kv_fingerprint: str = ""


HandshakeMsg = Union[ServerHello, Hello, HelloReply, ErrorReply]


# --------------------------------------------------------------------------- RPC envelope

class Call(Message, tag="c", frozen=True, array_like=True):
    """A request. ``deadline_s`` is the time budget left at send time (clocks differ per host)."""

    id: int
    deadline_s: float
    body: msgspec.Raw


class Reply(Message, tag="r", frozen=True, array_like=True):
    id: int
    body: msgspec.Raw


class StreamItem(Message, tag="s", frozen=True, array_like=True):
    """One server-push event of a streaming call."""

    id: int
    body: msgspec.Raw


class StreamEnd(Message, tag="e", frozen=True, array_like=True):
    id: int


class CallError(Message, tag="x", frozen=True, array_like=True):
    """A call (or stream) failed; ``id`` 0 means the connection-level error before closing."""

    id: int
    error: ErrorReply


class CancelCall(Message, tag="k", frozen=True, array_like=True):
    """Client gave up on a call or stream; the server cancels its handler."""

    id: int


class StreamCredit(Message, tag="w", frozen=True, array_like=True):
    """Client → server flow control: the consumer of stream ``id`` can take ``n`` more events.

    A stream starts with one credit (so a mistaken unary call on a stream fails fast); the
    client grants the rest of its window right after the Call and more as it consumes, so a
    slow consumer pauses only its own stream's generator.
    """

    id: int
    n: int


Envelope = Union[Call, Reply, StreamItem, StreamEnd, CallError, CancelCall, StreamCredit]


# --------------------------------------------------------------------------- common control

class Ping(Message, tag="ping", frozen=True):
    payload: bytes = b""


class Pong(Message, tag="pong", frozen=True):
    payload: bytes = b""


class GetStats(Message, tag="stats.get", frozen=True):
    """Ask a service for its counters (buffer pools, transfers, queues)."""


class GetStatsReply(Message, tag="stats.reply", frozen=True):
    service: str
    node_id: str
    counters: dict[str, float]


class PageSlots(Message, tag="pages.slots", frozen=True, array_like=True):
    """Receiver-side destination of one UCX transfer: ``(offset, nbytes)`` runs in its pool.

    The sender cuts its messages with ``common.transport.plan.plan_messages`` over these
    slots, the receiver posts the same messages, so both agree on tags without per-page
    control traffic.
    Offsets also make the descriptor usable by a one-sided RMA backend later.
    """

    transfer_id: int
    segments: list[tuple[int, int]]


AdminRequest = Union[Ping, GetStats]
AdminReply = Union[Pong, GetStatsReply, ErrorReply]
