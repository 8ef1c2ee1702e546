"""Control-plane RPC server: msgspec msgpack over asyncio TCP, one handler per message type.

Per connection: a hello (version, shared secret, KV spec), then one reader loop that routes
``Call`` envelopes to handlers by ``type(msg)``, one supervised task per call, and one writer
task behind a bounded frame queue (``common.framing.FrameSender``). A handler is either
``async def h(msg, ctx) -> reply`` or an async generator ``async def h(msg, ctx): yield event``
(server push: ``StreamItem`` frames, then ``StreamEnd``). Failures reach the caller as
``CallError``; bad input from one peer closes at most that peer's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import math
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import structlog

from common.config import RpcConfig
from common.errors import (
    DeadlineExceeded, DualpathError, ErrorCode, FrameTooLarge, InternalError, PeerFailed,
)
from common.framing import FrameCodec, FrameSender, close_writer, read_frame
from common.protocol import (
    PROTOCOL_VERSION, Call, CallError, CancelCall, ErrorReply, Hello, Reply,
    ServerHello, StreamCredit, StreamEnd, StreamItem, union_members,
)
from common.rpc_hello import HelloPolicy, hello_fields
from common.tls import HandshakeFailures, server_context
from common.unix_socket import bind_private

log = structlog.get_logger(__name__)

OVERLOAD_RETRY_AFTER_S = 0.05   # hint sent with OVERLOADED: a call slot frees within ~a call
DRAIN_RETRY_AFTER_S = 0.5       # hint sent while stopping: enough for a restart or a failover

Handler = Callable[..., Any]
ConnHook = Callable[["ServerConnection"], Any]


class CallContext:
    """What a handler knows about its call: the peer, the deadline, whether it was cancelled."""

    __slots__ = ("conn", "call_id", "deadline", "notice", "_cancelled")

    def __init__(self, conn: ServerConnection, call_id: int, deadline: float | None,
                 notice: bool = False) -> None:
        self.conn = conn
        self.call_id = call_id
        self.deadline = deadline          # loop.time() (monotonic) seconds; None: no deadline
        self.notice = notice              # a CancelCall does not stop it (RpcServer notices)
        self._cancelled = asyncio.Event()

    @property
    def peer(self) -> Hello:
        return self.conn.peer

    @property
    def conn_id(self) -> int:
        return self.conn.conn_id

    @property
    def cancelled(self) -> bool:
        """True once the client cancelled the call or its connection went away."""
        return self._cancelled.is_set()

    async def wait_cancelled(self) -> None:
        await self._cancelled.wait()

    def remaining(self) -> float:
        """Seconds left before the deadline (``inf`` without one)."""
        if self.deadline is None:
            return math.inf
        return self.deadline - asyncio.get_running_loop().time()


class ServerConnection:
    """One accepted, authenticated peer: its in-flight calls and its outbound frame queue."""

    def __init__(self, conn_id: int, peer: Hello, peer_addr: Any, sender: FrameSender) -> None:
        self.conn_id = conn_id
        self.peer = peer
        self.peer_addr = peer_addr
        self.sender = sender
        self.calls: dict[int, tuple[asyncio.Task, CallContext]] = {}
        self.windows: dict[int, _StreamWindow] = {}     # flow control of streaming calls
        self.closed = False

    def cancel_calls(self) -> list[asyncio.Task]:
        tasks = []
        for task, ctx in self.calls.values():
            ctx._cancelled.set()
            task.cancel()
            tasks.append(task)
        return tasks

    def __repr__(self) -> str:
        return (f"ServerConnection(id={self.conn_id}, role={self.peer.role!r}, "
                f"node_id={self.peer.node_id!r})")


class _StreamWindow:
    """Events a stream may still send before its client grants more (StreamCredit)."""

    def __init__(self) -> None:
        self.credit = 1         # the first event needs no grant (protocol.StreamCredit)
        self._granted = asyncio.Event()

    def grant(self, n: int) -> None:
        self.credit += n
        self._granted.set()

    async def take(self) -> None:
        while self.credit <= 0:
            self._granted.clear()
            await self._granted.wait()
        self.credit -= 1


class _Entry(msgspec.Struct, frozen=True):
    handler: Handler
    streaming: bool
    notice: bool = False


class RpcServer:
    """Serves one request union on a TCP port; see the module docstring for the shape."""

    def __init__(self, cfg: RpcConfig, *, service: str, node_id: str,
                 handlers: Mapping[type, Handler], request_type: Any,
                 kv_fingerprint: str = "", auth_secret: bytes | None = None,
                 on_connect: ConnHook | None = None,
                 on_disconnect: ConnHook | None = None,
                 notices: frozenset[type] = frozenset()) -> None:
        """``notices``: request types that tell rather than ask; once received they run to
        their end (deadline-bounded) though cancelled: after a stall a CancelCall arrives with
        its call (docs/engine-api.md, notices)."""
        self._cfg = cfg
        self._service = service
        self._node_id = node_id
        self._hello = HelloPolicy(service, node_id, kv_fingerprint, auth_secret)
        self._tls = server_context(cfg)     # None: plaintext; bad files fail here, at start
        self._tls_failures = None if self._tls is None else HandshakeFailures(
            self._tls, cfg.handshake_timeout_s)
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._entries = _build_entries(handlers, request_type, notices)
        self._codec = FrameCodec(request_type, cfg.max_frame_bytes)
        envelope_handlers: dict[type, Callable[[ServerConnection, Any], Awaitable[None]]] = {
            Call: self._on_call, CancelCall: self._on_cancel, StreamCredit: self._on_credit}
        self._envelope_handlers = envelope_handlers
        self._lock = asyncio.Lock()
        self._server: asyncio.Server | None = None
        self._port = 0
        self._unix_path: str | None = None
        self._admit_peer: Callable[[Any], bool] | None = None
        self._draining = False
        self._conn_ids = itertools.count(1)
        self._conns: dict[int, ServerConnection] = {}
        self._conn_tasks: set[asyncio.Task] = set()
        self._counters = dict.fromkeys(
            ("connections_accepted", "handshakes_rejected", "calls_total", "calls_failed",
             "calls_rejected", "frames_rejected", "notice_cancels_ignored"), 0)

    # ----------------------------------------------------------------- lifecycle

    @property
    def port(self) -> int:
        return self._port

    @property
    def connections(self) -> tuple[ServerConnection, ...]:
        return tuple(self._conns.values())

    def stats(self) -> dict[str, float]:
        """RPC counters, for a service's GetStats reply."""
        inflight = sum(len(c.calls) for c in self._conns.values())
        failures = self._tls_failures
        return {**self._counters, "connections_open": len(self._conns), "calls_inflight": inflight,
                "tls_handshakes_failed": 0 if failures is None else failures.count()}

    async def start(self, host: str | None = None, port: int = 0) -> None:
        """Listen on ``host`` (default ``rpc.host``) and ``port`` (0: any free port)."""
        async with self._lock:
            if self._server is not None:
                return
            self._draining = False
            # TLS in the listener (not start_tls in the callback: the ClientHello can reach a
            # plaintext reader first). A failed handshake closes only that connection.
            tls: dict[str, Any] = {} if self._tls is None else {
                "ssl": self._tls, "ssl_handshake_timeout": self._cfg.handshake_timeout_s}
            self._server = await asyncio.start_server(self._on_accept, host or self._cfg.host,
                                                      port, **tls)
            self._port = self._server.sockets[0].getsockname()[1]
            log.info("rpc_server_started", service=self._service, node_id=self._node_id,
                     host=host or self._cfg.host, port=self._port, tls=bool(self._tls))

    async def start_unix(self, path: str,
                         admit: Callable[[Any], bool] | None = None) -> None:
        """Listen on the Unix socket ``path`` (a local channel: engines of a node), created
        0600 (common.unix_socket). ``admit(socket)`` (e.g. a peer-uid check) runs on each
        accepted connection before the hello; False closes it.

        A socket file left there by a dead server (nobody accepts on it) is replaced; one a
        live server listens on is refused, so two nodes never share a path.
        """
        async with self._lock:
            if self._server is not None:
                return
            sock = bind_private(path)
            self._draining, self._admit_peer = False, admit
            self._server = await asyncio.start_unix_server(self._on_accept, sock=sock)
            self._port, self._unix_path = 0, path
            log.info("rpc_server_started", service=self._service, node_id=self._node_id,
                     unix=path)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let calls finish for ``grace_s``, cancel the rest, close all."""
        async with self._lock:
            if self._server is None:
                return
            server, self._server = self._server, None
            self._draining = True
            server.close()
            calls = [t for c in self._conns.values() for t, _ in c.calls.values()]
            if calls and grace_s > 0:
                await asyncio.wait(calls, timeout=grace_s)
            for conn in list(self._conns.values()):
                conn.cancel_calls()
            tasks = list(self._conn_tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await server.wait_closed()
            if self._unix_path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._unix_path)
            log.info("rpc_server_stopped", service=self._service, port=self._port,
                     cancelled_connections=len(tasks))

    async def __aenter__(self) -> RpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- connections

    async def _on_accept(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        admit = self._admit_peer
        if self._draining or (admit is not None and not admit(writer.get_extra_info("socket"))):
            await close_writer(writer)     # draining: accepted just before stop() closed it
            return
        task = asyncio.current_task()
        assert task is not None     # start_server runs every client callback in a task
        self._conn_tasks.add(task)  # start_server does not keep a reference on 3.11
        conn_id = next(self._conn_ids)
        peer_addr = writer.get_extra_info("peername")
        try:
            hello = await self._handshake(reader, writer, conn_id, peer_addr)
            if hello is not None:
                sender = FrameSender(writer, self._cfg.send_queue_frames, f"rpc-conn-{conn_id}")
                await self._serve(ServerConnection(conn_id, hello, peer_addr, sender), reader)
        except asyncio.CancelledError:
            pass      # stop() cancels us; ending cancelled makes asyncio log a traceback
        except Exception:
            log.exception("connection_failed", service=self._service, conn_id=conn_id)
        finally:
            self._conn_tasks.discard(task)
            await close_writer(writer)

    async def _serve(self, conn: ServerConnection, reader: asyncio.StreamReader) -> None:
        self._conns[conn.conn_id] = conn
        self._counters["connections_accepted"] += 1
        reason = "server stopping"
        try:
            await _call_hook(self._on_connect, conn, "on_connect")
            reason = await self._read_loop(conn, reader)
        finally:
            conn.closed = True
            del self._conns[conn.conn_id]
            await asyncio.gather(*conn.cancel_calls(), return_exceptions=True)
            await conn.sender.aclose()
            await _call_hook(self._on_disconnect, conn, "on_disconnect")
            log.info("connection_closed", service=self._service, conn_id=conn.conn_id,
                     role=conn.peer.role, node_id=conn.peer.node_id, reason=reason)

    async def _read_loop(self, conn: ServerConnection, reader: asyncio.StreamReader) -> str:
        """Route frames until the peer leaves or misbehaves; returns why it ended."""
        codec = self._codec
        while True:
            try:
                frame = await read_frame(reader, codec.max_frame_bytes)
            except FrameTooLarge as e:
                return self._reject_connection(conn, e.code, e.message, "frame_too_large")
            except PeerFailed as e:
                return self._frame_rejected(conn, "truncated", e.message)
            except (ConnectionError, OSError) as e:
                return f"read failed: {e!r}"
            if frame is None:
                return "peer closed"
            try:
                env = codec.envelope(frame)
            except msgspec.DecodeError as e:
                return self._reject_connection(conn, ErrorCode.PROTOCOL_ERROR,
                                               f"undecodable frame: {e}", "undecodable")
            await self._envelope_handlers.get(type(env), self._on_unexpected)(conn, env)

    def _frame_rejected(self, conn: ServerConnection, reason: str, detail: str) -> str:
        self._counters["frames_rejected"] += 1
        log.warning("frame_rejected", service=self._service, conn_id=conn.conn_id,
                    node_id=conn.peer.node_id, reason=reason, detail=detail)
        return reason

    def _reject_connection(self, conn: ServerConnection, code: ErrorCode, message: str,
                           reason: str) -> str:
        """Queue a connection-level CallError(id=0) as the last frame; the caller closes."""
        conn.sender.push(self._codec.frame(CallError(0, ErrorReply(code, message))))
        return self._frame_rejected(conn, reason, message)

    # ----------------------------------------------------------------- handshake

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         conn_id: int, peer_addr: Any) -> Hello | None:
        """Run the hello; the peer's Hello when accepted, else None (the caller closes)."""
        ev = {"service": self._service, "conn_id": conn_id, "peer": str(peer_addr)}
        nonce = os.urandom(16)
        try:
            async with asyncio.timeout(self._cfg.handshake_timeout_s):
                writer.write(self._codec.frame(ServerHello(PROTOCOL_VERSION, nonce,
                                                           self._service)))
                await writer.drain()
                hello = self._decode_hello(await read_frame(reader, self._codec.max_frame_bytes))
                answer = self._hello.answer(hello, nonce)
                writer.write(self._codec.frame(answer))
                await writer.drain()
        except TimeoutError:
            log.warning("handshake_timed_out", timeout_s=self._cfg.handshake_timeout_s, **ev)
            return None
        except (DualpathError, ConnectionError, OSError) as e:
            log.warning("handshake_failed", error=repr(e), **ev)
            return None
        if isinstance(answer, ErrorReply):
            self._counters["handshakes_rejected"] += 1
            log.warning("handshake_rejected", code=answer.code, **ev, **hello_fields(hello))
            return None
        assert isinstance(hello, Hello)     # answer() turns anything else into an error
        log.info("connection_accepted", role=hello.role, node_id=hello.node_id, **ev)
        return hello

    def _decode_hello(self, frame: bytes | None) -> Hello | ErrorReply:
        if frame is None:
            raise PeerFailed("peer closed the connection before its hello")
        try:
            msg = self._codec.handshake(frame)
        except msgspec.DecodeError as e:
            return ErrorReply(ErrorCode.PROTOCOL_ERROR, f"undecodable hello: {e}")
        if type(msg) is not Hello:
            return ErrorReply(ErrorCode.PROTOCOL_ERROR,
                              f"expected a Hello, got {type(msg).__name__}")
        return msg

    # ----------------------------------------------------------------- calls

    async def _on_call(self, conn: ServerConnection, call: Call) -> None:
        self._counters["calls_total"] += 1
        rejection = self._admit(conn, call)
        if rejection is not None:
            self._counters["calls_rejected"] += 1
            await self._send_error(conn, call.id, rejection)
            return
        try:
            msg = self._codec.body(call.body)
        except msgspec.DecodeError as e:
            unknown = self._codec.body_is_unknown(call.body)
            code = ErrorCode.UNKNOWN_MESSAGE if unknown else ErrorCode.INVALID_ARGUMENT
            self._frame_rejected(conn, code.lower(), str(e))
            await self._send_error(conn, call.id, ErrorReply(code, f"call body rejected: {e}"))
            return
        entry = self._entries.get(type(msg))
        if entry is None:
            self._frame_rejected(conn, "no_handler", type(msg).__name__)
            await self._send_error(conn, call.id, ErrorReply(
                ErrorCode.UNKNOWN_MESSAGE, f"{self._service} has no handler for "
                                           f"{type(msg).__name__}"))
            return
        self._spawn_call(conn, call, msg, entry)

    def _admit(self, conn: ServerConnection, call: Call) -> ErrorReply | None:
        if self._draining:
            return ErrorReply(ErrorCode.UNAVAILABLE, f"{self._service} is shutting down",
                              True, DRAIN_RETRY_AFTER_S)
        if call.id in conn.calls:
            return ErrorReply(ErrorCode.INVALID_ARGUMENT, f"call id {call.id} is in use")
        if len(conn.calls) >= self._cfg.max_inflight_calls:
            return ErrorReply(ErrorCode.OVERLOADED,
                              f"{self._service}: {len(conn.calls)} calls in flight on this "
                              f"connection (rpc.max_inflight_calls); retry shortly",
                              True, OVERLOAD_RETRY_AFTER_S)
        return None

    def _spawn_call(self, conn: ServerConnection, call: Call, msg: Any, entry: _Entry) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + call.deadline_s if math.isfinite(call.deadline_s) else None
        ctx = CallContext(conn, call.id, deadline, entry.notice)
        task = asyncio.create_task(self._run_call(conn, msg, entry, ctx),
                                   name=f"rpc-call-{conn.conn_id}-{call.id}")
        conn.calls[call.id] = (task, ctx)
        if entry.streaming:
            conn.windows[call.id] = _StreamWindow()
        task.add_done_callback(lambda t: _forget_call(conn, call.id, t))

    async def _run_call(self, conn: ServerConnection, msg: Any, entry: _Entry,
                        ctx: CallContext) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = asyncio.timeout_at(ctx.deadline)
        outcome = "cancelled"
        try:
            async with timeout:
                await (self._stream if entry.streaming else self._unary)(conn, msg, entry, ctx)
            outcome = "ok"
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if ctx._cancelled.is_set() or me is None or me.cancelling():
                raise               # this call was cancelled (CancelCall, shutdown, close)
            # A CancelledError out of the handler while nobody cancelled this call (an
            # awaitable it waited on was cancelled elsewhere): answer it, or the client waits
            # for its deadline on a call that is over.
            log.error("handler_cancelled_inside", service=self._service, conn_id=ctx.conn_id,
                      call_id=ctx.call_id, msg=type(msg).__name__)
            outcome = "INTERNAL"
            self._counters["calls_failed"] += 1
            await self._send_error(conn, ctx.call_id, ErrorReply(
                ErrorCode.INTERNAL, f"{self._service} failed handling {type(msg).__name__}: "
                f"an operation it waited on was cancelled", False))
        except Exception as e:
            error = self._error_reply(e, msg, ctx, timeout.expired())
            outcome = error.code
            self._counters["calls_failed"] += 1
            await self._send_error(conn, ctx.call_id, error)
        finally:
            log.debug("call_completed", service=self._service, conn_id=conn.conn_id,
                      call_id=ctx.call_id, msg=type(msg).__name__, outcome=outcome,
                      duration_ms=round((loop.time() - started) * 1e3, 3))

    async def _unary(self, conn: ServerConnection, msg: Any, entry: _Entry,
                     ctx: CallContext) -> None:
        reply = await entry.handler(msg, ctx)
        await conn.sender.send(self._codec.frame(Reply(ctx.call_id, self._codec.raw(reply))))

    async def _stream(self, conn: ServerConnection, msg: Any, entry: _Entry,
                      ctx: CallContext) -> None:
        # Flow control: each event spends one credit of the client's window, so a slow
        # consumer suspends this generator only, and neither side buffers more than the window.
        window = conn.windows[ctx.call_id]
        events = entry.handler(msg, ctx)
        try:
            async for event in events:
                frame = self._codec.frame(StreamItem(ctx.call_id, self._codec.raw(event)))
                await window.take()
                await conn.sender.send(frame)
        finally:
            await events.aclose()
        await conn.sender.send(self._codec.frame(StreamEnd(ctx.call_id)))

    def _error_reply(self, exc: Exception, msg: Any, ctx: CallContext,
                     expired: bool) -> ErrorReply:
        name = type(msg).__name__
        if expired:
            exc = DeadlineExceeded(f"{self._service} did not finish {name} before its deadline")
        elif not isinstance(exc, DualpathError):
            log.exception("handler_failed", service=self._service, conn_id=ctx.conn_id,
                          call_id=ctx.call_id, msg=name)
            exc = InternalError(f"{self._service} failed handling {name}: "
                                f"{type(exc).__name__}: {exc}")
        return ErrorReply(exc.code, exc.message, exc.retryable, exc.retry_after_s)

    async def _send_error(self, conn: ServerConnection, call_id: int,
                          error: ErrorReply) -> None:
        try:
            await conn.sender.send(self._codec.frame(CallError(call_id, error)))
        except PeerFailed:
            pass      # connection already gone: nobody is waiting for this answer

    async def _on_cancel(self, conn: ServerConnection, cancel: CancelCall) -> None:
        entry = conn.calls.get(cancel.id)
        if entry is not None:
            task, ctx = entry
            if ctx.notice:
                self._counters["notice_cancels_ignored"] += 1
                return
            ctx._cancelled.set()
            task.cancel()

    async def _on_credit(self, conn: ServerConnection, credit: StreamCredit) -> None:
        window = conn.windows.get(credit.id)
        if window is not None and credit.n > 0:
            window.grant(credit.n)

    async def _on_unexpected(self, conn: ServerConnection, env: Any) -> None:
        self._frame_rejected(conn, "unexpected_envelope", type(env).__name__)
        await self._send_error(conn, env.id, ErrorReply(
            ErrorCode.PROTOCOL_ERROR, f"a server accepts Call, CancelCall and StreamCredit, "
                                      f"not {type(env).__name__}"))


def _build_entries(handlers: Mapping[type, Handler], request_type: Any,
                   notices: frozenset[type] = frozenset()) -> dict[type, _Entry]:
    """Validate the handler table at construction: typos fail at start, not on first call."""
    members = set(union_members(request_type))
    if stray := [t.__name__ for t in notices if t not in handlers]:
        raise TypeError(f"notices without a handler: {', '.join(sorted(stray))}")
    entries = {}
    for msg_type, handler in handlers.items():
        if msg_type not in members:
            raise TypeError(f"handler for {msg_type.__name__}, which is not in the request "
                            f"union; add it to the union or drop the handler")
        streaming = inspect.isasyncgenfunction(handler)
        if not (streaming or inspect.iscoroutinefunction(handler)):
            raise TypeError(f"handler for {msg_type.__name__} must be an async function or "
                            f"an async generator function")
        if streaming and msg_type in notices:
            raise TypeError(f"{msg_type.__name__}: a notice is a unary call, not a stream")
        entries[msg_type] = _Entry(handler, streaming, msg_type in notices)
    return entries


def _forget_call(conn: ServerConnection, call_id: int, task: asyncio.Task) -> None:
    entry = conn.calls.get(call_id)
    if entry is not None and entry[0] is task:     # not a later call that reused the id
        del conn.calls[call_id]
        conn.windows.pop(call_id, None)


def check_handler_coverage(handlers: Mapping[type, Any], request_union: Any) -> list[type]:
    """Members of ``request_union`` without a handler (empty when every request is served)."""
    return [m for m in union_members(request_union) if m not in handlers]


async def _call_hook(hook: ConnHook | None, conn: ServerConnection, name: str) -> None:
    if hook is None:
        return
    try:
        result = hook(conn)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("connection_hook_failed", hook=name, conn_id=conn.conn_id)
