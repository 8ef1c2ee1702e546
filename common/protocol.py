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
