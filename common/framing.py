"""Length-prefixed msgpack frames over asyncio streams, shared by the RPC server and client.

A frame is a 4-byte big-endian length, then one msgpack-encoded message: during the hello a
``HandshakeMsg``, afterwards an ``Envelope`` whose body is the channel message, still encoded
(``msgspec.Raw``). The codecs are built once per server/client (:class:`FrameCodec`); outbound
frames of a connection go through one bounded queue drained by one writer task
(:class:`FrameSender`), so concurrent calls never interleave bytes and a stalled peer holds at
most ``send_queue_frames`` frames in memory.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Any

import msgspec
import structlog

from common.errors import DualpathError, FrameTooLarge, PeerFailed
from common.protocol import Envelope, HandshakeMsg, Message, union_members

log = structlog.get_logger(__name__)

HEADER = struct.Struct(">I")
FLUSH_ON_CLOSE_S = 1.0   # a closing connection gets this long to flush its last frames


class _TagPeek(msgspec.Struct):
    """Reads only the tag of a body that failed to decode, to tell unknown from malformed."""

    t: str | None = None


class FrameCodec:
    """One encoder and the decoders of one endpoint, built once, reused for every frame."""

    def __init__(self, body_type: Any, max_frame_bytes: int, event_type: Any = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._enc = msgspec.msgpack.Encoder()
        self._env = msgspec.msgpack.Decoder(Envelope)
        self._hello = msgspec.msgpack.Decoder(HandshakeMsg)
        self._body = msgspec.msgpack.Decoder(body_type)
        self._event = self._body if event_type is None else msgspec.msgpack.Decoder(event_type)
        self._peek = msgspec.msgpack.Decoder(_TagPeek)
        self._tags = {tag_of(cls) for cls in union_members(body_type)}

    def frame(self, msg: Message) -> bytearray:
        """Encode ``msg`` behind its length prefix; too big for the peer → FrameTooLarge."""
        buf = bytearray(HEADER.size)
        self._enc.encode_into(msg, buf, HEADER.size)
        size = len(buf) - HEADER.size
        if size > self.max_frame_bytes:
            raise FrameTooLarge(f"{type(msg).__name__} encodes to {size} bytes, above "
                                f"rpc.max_frame_bytes={self.max_frame_bytes}; send less per "
                                f"message or raise the limit on both sides")
        HEADER.pack_into(buf, 0, size)
        return buf

    def raw(self, msg: Message) -> msgspec.Raw:
        """Encode a channel message as an envelope body."""
        return msgspec.Raw(self._enc.encode(msg))

    # Every decode raises msgspec.DecodeError and nothing else on bad input, whatever the
    # peer sent (tests/test_fuzz_decoders.py): callers map that one error to a typed wire code.
    def envelope(self, data: bytes) -> Any:
        return typed_decode(self._env, data)

    def handshake(self, data: bytes) -> Any:
        return typed_decode(self._hello, data)

    def body(self, raw: msgspec.Raw) -> Any:
        return typed_decode(self._body, raw)

    def event(self, raw: msgspec.Raw) -> Any:
        return typed_decode(self._event, raw)

    def body_is_unknown(self, raw: msgspec.Raw) -> bool:
        """After a body failed to decode: True when its tag is missing or not in the union."""
        try:
            tag = typed_decode(self._peek, raw).t
        except msgspec.DecodeError:
            return False          # not even a map with a string tag: malformed, not unknown
        return tag is None or tag not in self._tags


def typed_decode(decoder: msgspec.msgpack.Decoder, data: Any) -> Any:
    """``decoder.decode(data)``, raising only ``msgspec.DecodeError`` on bad input.

    msgspec lets two other errors through, both reachable from a peer's bytes: RecursionError
    for values nested deeper than the interpreter's recursion limit — a field it skips or keeps
    raw (an unknown field, an envelope body) included — and whatever a struct's
    ``__post_init__`` raises other than TypeError / ValueError (``KVSpec`` raises
    InvalidArgument). Either would escape the handlers that catch DecodeError and end the
    connection with no typed answer.
    """
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("message nested too deeply") from None
    except DualpathError as e:
        raise msgspec.ValidationError(e.message) from None


def tag_of(cls: type[msgspec.Struct]) -> Any:
    return cls.__struct_config__.tag


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next frame's payload; ``None`` on a clean EOF between frames.

    Raises FrameTooLarge before reading the payload (the buffer is never allocated) and
    PeerFailed when the stream ends part-way through a frame.
    """
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise PeerFailed(f"connection closed inside a frame header ({len(e.partial)} of "
                         f"{HEADER.size} bytes)") from None
    (size,) = HEADER.unpack(header)
    if size > max_bytes:
        raise FrameTooLarge(f"peer announced a {size}-byte frame, above "
                            f"rpc.max_frame_bytes={max_bytes}")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as e:
        raise PeerFailed(f"connection closed inside a frame ({len(e.partial)} of {size} "
                         f"bytes)") from None


class FrameSender:
    """Bounded outbound frame queue of one connection, drained by one writer task.

    ``send`` waits while the queue is full (backpressure on that caller only); once the
    connection is broken or closed every waiting and later ``send`` raises PeerFailed.
    """

    def __init__(self, writer: asyncio.StreamWriter, limit: int, name: str) -> None:
        self._writer = writer
        self._limit = limit
        self._frames: deque[bytes | bytearray] = deque()
        self._has_frames = asyncio.Event()
        self._has_space = asyncio.Event()
        self._has_space.set()
        self._closing = False
        self._error: str | None = None
        self._task = asyncio.create_task(self._run(), name=f"{name}-writer")

    @property
    def broken(self) -> bool:
        return self._error is not None

    async def send(self, frame: bytes | bytearray) -> None:
        while True:
            self._raise_if_closed()
            if len(self._frames) < self._limit:
                break
            self._has_space.clear()
            await self._has_space.wait()
        self._frames.append(frame)
        self._has_frames.set()

    def push(self, frame: bytes | bytearray) -> None:
        """Queue a control frame now, even past the bound (cancellations, a last error).

        Callers guarantee these stay few (one per call, one per connection); a closed
        connection drops them silently.
        """
        if self._error is None and not self._closing:
            self._frames.append(frame)
            self._has_frames.set()

    def _raise_if_closed(self) -> None:
        if self._error is not None:
            raise PeerFailed(self._error)
        if self._closing:
            raise PeerFailed("connection is closing")

    async def _run(self) -> None:
        try:
            while True:
                if not self._frames:
                    if self._closing:
                        return
                    self._has_frames.clear()
                    await self._has_frames.wait()
                    continue
                while self._frames:       # write all queued frames, then wait for the socket
                    self._writer.write(self._frames.popleft())
                self._has_space.set()
                await self._writer.drain()
        except (ConnectionError, OSError, RuntimeError) as e:   # uvloop: RuntimeError if closed
            self._fail(f"connection lost while writing: {e!r}")
        finally:
            self._fail(self._error or "connection closed")

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = reason
        self._frames.clear()
        self._has_space.set()       # wake blocked senders: they raise now

    def abort(self, reason: str) -> None:
        """The peer is gone: drop queued frames, fail senders, reset the transport."""
        self._fail(reason)
        self._closing = True
        self._has_frames.set()
        self._writer.transport.abort()

    async def aclose(self, flush_s: float = FLUSH_ON_CLOSE_S) -> None:
        """Flush what is queued (up to ``flush_s``), then close the transport."""
        self._closing = True
        self._has_frames.set()
        self._has_space.set()
        _, pending = await asyncio.wait({self._task}, timeout=flush_s)
        if pending:                     # the peer is not reading: do not wait any longer
            self._task.cancel()
            await asyncio.wait({self._task})
            self._writer.transport.abort()
            return
        await close_writer(self._writer)


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a stream writer; errors of an already-broken transport are of no interest."""
    if writer.is_closing():
        return
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), FLUSH_ON_CLOSE_S)
    except (ConnectionError, OSError, TimeoutError):
        writer.transport.abort()
