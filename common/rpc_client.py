"""Control-plane RPC client: unary calls and server-push streams over one TCP connection.

One reader task per connection resolves replies by call id; one writer task drains a bounded
frame queue. Every call carries a deadline (sent as the seconds left, enforced here too). When
the connection drops, every pending call fails at once with PeerFailed; the next call
reconnects with capped exponential backoff and full jitter. Handshake refusals (version, KV
spec, secret) raise their typed error and are not retried.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

from common.auth import compute_response, load_secret
from common.config import RpcConfig
from common.errors import (
    Cancelled, DeadlineExceeded, DualpathError, PeerFailed, ProtocolError, Unauthenticated,
    Unavailable, error_from_code,
)
from common.framing import FrameCodec, FrameSender, close_writer, read_frame
from common.protocol import (
    PROTOCOL_VERSION, Call, CallError, CancelCall, ErrorReply, Hello, HelloReply, Message,
    Reply, ServerHello, StreamCredit, StreamEnd, StreamItem,
)
from common.tls import client_context, is_refusal

log = structlog.get_logger(__name__)

_MAX_BACKOFF_EXP = 30      # 2**30 × initial is past any sane reconnect_max_s
_ANSWERS = frozenset((Reply, StreamItem, StreamEnd, CallError))


class _Verdict:
    KEEP, DONE, CANCEL = range(3)   # after a delivery: still open / finished / cancel it


def _raise_for(env: Any) -> None:
    """Raise the typed error a CallError envelope or an ErrorReply body carries."""
    err = env.error if isinstance(env, CallError) else env
    raise error_from_code(err.code, err.message, err.retry_after_s)


def _copy(err: DualpathError) -> DualpathError:
    """A fresh instance per waiter, so tracebacks of concurrent raisers do not pile up."""
    return type(err)(err.message, retry_after_s=err.retry_after_s)


class _UnarySlot:
    """A pending unary call: a future resolved with its Reply envelope or a typed error."""

    def __init__(self) -> None:
        self.fut: asyncio.Future = asyncio.get_running_loop().create_future()

    def deliver(self, env: Any) -> int:
        if self.fut.done():
            return _Verdict.DONE
        match env:
            case Reply():
                self.fut.set_result(env)
            case CallError():
                self.fut.set_exception(error_from_code(env.error.code, env.error.message,
                                                       env.error.retry_after_s))
            case _:
                self.fut.set_exception(ProtocolError(
                    "server answered a unary call with a stream; use RpcClient.stream()"))
                return _Verdict.CANCEL
        return _Verdict.DONE

    def fail(self, err: DualpathError) -> None:
        if not self.fut.done():
            self.fut.set_exception(err)


class _StreamSlot:
    """A pending stream: received envelopes up to ``limit``, then its end or error."""

    def __init__(self, limit: int) -> None:
        self.items: deque[Any] = deque()
        self.limit = limit
        self.finished = False
        self.error: DualpathError | None = None
        self.wake = asyncio.Event()

    def deliver(self, env: Any) -> int:
        match env:
            case StreamItem() if len(self.items) >= self.limit:
                self._finish(ProtocolError(f"server sent past the stream window of "
                                           f"{self.limit} events; the call was cancelled"))
                return _Verdict.CANCEL
            case StreamItem():
                self.items.append(env)
                self.wake.set()
                return _Verdict.KEEP
            case Reply():               # a unary handler answered: one event, then the end
                self.items.append(env)
                self._finish(None)
            case CallError():
                self._finish(error_from_code(env.error.code, env.error.message,
                                             env.error.retry_after_s))
            case _:
                self._finish(None)
        return _Verdict.DONE

    def fail(self, err: DualpathError) -> None:
        self._finish(err)

    def _finish(self, err: DualpathError | None) -> None:
        if not self.finished:
            self.finished, self.error = True, err
            self.wake.set()


class _Connection:
    """One live, handshaken connection: pending calls by id, a reader and a writer task."""

    def __init__(self, client: RpcClient, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, peer: HelloReply) -> None:
        self.client = client
        self.peer = peer
        self.pending: dict[int, _UnarySlot | _StreamSlot] = {}
        self.closed = False
        self._codec = client._codec
        self._writer = writer
        self.sender = FrameSender(writer, client._cfg.send_queue_frames,
                                  f"rpc-client-{client.address}")
        self._reader_task = asyncio.create_task(self._read_loop(reader),
                                                name=f"rpc-client-{client.address}-reader")

    async def open_call(self, slot: _UnarySlot | _StreamSlot, call_id: int, msg: Message,
                        remaining_s: float, window: int = 0) -> None:
        """Register ``slot``, send the Call (and a stream's first credit); on failure nothing
        stays registered."""
        frame = self._codec.frame(Call(call_id, remaining_s, self._codec.raw(msg)))
        self.pending[call_id] = slot
        try:
            await self.sender.send(frame)
            if window > 1:      # the server starts every stream with one credit
                await self.sender.send(self._codec.frame(StreamCredit(call_id, window - 1)))
        except BaseException:
            self.abandon(call_id)
            raise

    async def grant(self, call_id: int, n: int) -> None:
        """Give a stream ``n`` more credits; a broken connection fails the stream anyway."""
        try:
            await self.sender.send(self._codec.frame(StreamCredit(call_id, n)))
        except PeerFailed:
            pass

    def abandon(self, call_id: int) -> None:
        """The caller gave up on a call: forget it and tell the server.

        The CancelCall may pass the queue bound: it is one small frame per call, and dropping
        it would leave the server working for nobody until the deadline.
        """
        if self.pending.pop(call_id, None) is not None and not self.closed:
            self.sender.push(self._codec.frame(CancelCall(call_id)))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        err: DualpathError = Cancelled("client closed")
        try:
            err = await self._read_frames(reader)
        except Exception as e:      # a bug here must still fail the pending calls
            log.exception("rpc_reader_failed", address=self.client.address)
            err = PeerFailed(f"reader of {self.client.address} failed: {e!r}")
        finally:
            self._lost(err)

    async def _read_frames(self, reader: asyncio.StreamReader) -> DualpathError:
        codec = self._codec
        addr = self.client.address
        try:
            while True:
                frame = await read_frame(reader, codec.max_frame_bytes)
                if frame is None:
                    return PeerFailed(f"{addr} closed the connection")
                env = codec.envelope(frame)
                if type(env) is CallError and env.id == 0:
                    return error_from_code(env.error.code, env.error.message)
                if type(env) in _ANSWERS:
                    self._dispatch(env)
                else:
                    log.warning("envelope_unexpected", address=addr, kind=type(env).__name__)
        except DualpathError as e:
            return e
        except msgspec.DecodeError as e:
            return ProtocolError(f"undecodable frame from {addr}: {e}")
        except (ConnectionError, OSError) as e:
            return PeerFailed(f"connection to {addr} lost: {e!r}")

    def _dispatch(self, env: Any) -> None:
        slot = self.pending.get(env.id)
        if slot is None:        # answer to a call we already gave up on
            return
        verdict = slot.deliver(env)
        if verdict != _Verdict.KEEP:
            self.pending.pop(env.id, None)
        if verdict == _Verdict.CANCEL:
            self.sender.push(self._codec.frame(CancelCall(env.id)))

    def _lost(self, err: DualpathError) -> None:
        if self.closed:
            return
        self.closed = True
        pending, self.pending = self.pending, {}
        for slot in pending.values():
            slot.fail(_copy(err))
        if not isinstance(err, Cancelled):      # not our own close(): the peer is gone
            level = log.warning if pending else log.info
            level("rpc_connection_lost", address=self.client.address, error=repr(err),
                  pending_calls=len(pending))
            self.sender.abort(err.message)

    async def aclose(self) -> None:
        """Fail pending calls with Cancelled, flush what is queued, close the socket."""
        self._reader_task.cancel()
        await asyncio.wait({self._reader_task})
        await self.sender.aclose()
        await close_writer(self._writer)


class RpcClient:
    """Client of one RpcServer; reconnects on the next call after the connection drops."""

    def __init__(self, cfg: RpcConfig, host: str, port: int, *, role: str, node_id: str,
                 reply_type: Any, kv_fingerprint: str = "", auth_secret: bytes | None = None,
                 event_type: Any = None, unix_path: str | None = None,
                 resolve: Callable[[], Awaitable[tuple[str, int]]] | None = None) -> None:
        self._cfg = cfg
        self._host, self._port = host, port
        self._unix_path = unix_path          # set: a local Unix socket instead of TCP
        self._resolve = resolve     # asked for the address before each connection attempt
        self._role, self._node_id = role, node_id
        self._kv_fingerprint = kv_fingerprint
        # No explicit secret: the one ``cfg`` names (rpc.auth_secret_file / _env), so every
        # client built from a cluster's config authenticates without each caller remembering.
        self._secret = auth_secret if auth_secret is not None else load_secret(cfg)
        self._tls = client_context(cfg)     # None: plaintext; bad files fail here, at start
        self._codec = FrameCodec(reply_type, cfg.max_frame_bytes, event_type)
        self._ids = itertools.count(1)
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task | None = None
        self._closed = False

    @property
    def address(self) -> str:
        if self._unix_path is not None:
            return f"unix:{self._unix_path}"
        return f"{self._host}:{self._port}"

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def peer(self) -> HelloReply | None:
        """The server's HelloReply on the current connection."""
        return self._conn.peer if self._conn is not None else None

    async def drop_connection(self) -> None:
        """Close the current connection (pending calls fail); the next call connects anew
        (and resolves the address again): e.g. after a reply from a deposed leader."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            await conn.aclose()

    async def connect(self) -> None:
        """Connect now (with backoff); raises Unavailable or a typed handshake error."""
        await self._ensure_connected()

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Connect, retrying up to ``timeout`` seconds; Unavailable when that is not enough."""
        try:
            async with asyncio.timeout(timeout):
                await self._ensure_connected()
        except TimeoutError:
            raise Unavailable(f"not connected to {self.address} within {timeout}s") from None

    async def close(self) -> None:
        """Fail pending calls with Cancelled and close; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.wait({self._connecting})
        if self._conn is not None:
            await self._conn.aclose()

    async def __aenter__(self) -> RpcClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- calls

    async def call(self, msg: Message, timeout: float | None = None) -> Any:
        """Send ``msg`` and return the reply; failures raise their typed DualpathError.

        ``timeout`` (default ``rpc.default_deadline_s``) covers reconnecting too.
        """
        budget = self._cfg.default_deadline_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self._ensure_connected()
                call_id, slot = next(self._ids), _UnarySlot()
                await conn.open_call(slot, call_id, msg, deadline - loop.time())
                try:
                    env = await slot.fut
                finally:
                    conn.abandon(call_id)
        except TimeoutError:
            raise DeadlineExceeded(f"{type(msg).__name__} to {self.address} got no reply "
                                   f"within {budget:.3g}s") from None
        return self._decode(env.body, self._codec.body, msg)

    def stream(self, msg: Message, timeout: float | None = None) -> RpcStream:
        """Start a server-push call; iterate the result for its events.

        Leaving the iteration early (``break``, ``aclose()``, ``async with`` exit) cancels
        the call on the server. ``timeout`` bounds the whole stream.
        """
        budget = self._cfg.default_deadline_s if timeout is None else timeout
        return RpcStream(self, msg, budget)

    def _decode(self, raw: msgspec.Raw, decode: Any, request: Message) -> Any:
        try:
            reply = decode(raw)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"reply to {type(request).__name__} from {self.address} does "
                                f"not decode: {e}") from e
        if isinstance(reply, ErrorReply):
            _raise_for(reply)
        return reply

    # ----------------------------------------------------------------- connecting

    async def _ensure_connected(self) -> _Connection:
        if self._closed:
            raise Cancelled(f"rpc client to {self.address} is closed")
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.create_task(self._connect_with_backoff(),
                                                   name=f"rpc-client-{self.address}-connect")
            self._connecting.add_done_callback(_retrieve)
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        except asyncio.CancelledError:
            # ``close()`` cancelled the shared connect task under us: a shield passes the
            # inner task's cancellation on to every waiter, which would then unwind as if
            # *it* had been cancelled (a scheduler's submit stream ended, its client never
            # answered). Only a cancellation of the waiter itself stays one.
            me = asyncio.current_task()
            if connecting.cancelled() and (me is None or not me.cancelling()):
                raise Cancelled(f"rpc client to {self.address} was closed while "
                                f"connecting") from None
            raise

    async def _connect_with_backoff(self) -> _Connection:
        cfg = self._cfg
        for attempt in itertools.count():
            try:
                self._conn = await self._open()
                log.info("rpc_connected", address=self.address, service=self._conn.peer.role,
                         node_id=self._conn.peer.node_id, attempts=attempt + 1)
                return self._conn
            except DualpathError as e:
                if not e.retryable:
                    log.warning("rpc_connect_refused", address=self.address, code=e.code,
                                error=e.message)
                    raise
                last: DualpathError = e
            if cfg.reconnect_attempts and attempt + 1 >= cfg.reconnect_attempts:
                raise Unavailable(f"could not connect to {self.address} in "
                                  f"{cfg.reconnect_attempts} attempts: {last.message}")
            cap = cfg.reconnect_initial_s * 2 ** min(attempt, _MAX_BACKOFF_EXP)
            delay = random.uniform(0, min(cfg.reconnect_max_s, cap))
            log.debug("rpc_connect_retrying", address=self.address, attempt=attempt + 1,
                      delay_s=round(delay, 3), error=last.message)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: itertools.count() does not end")

    async def _open(self) -> _Connection:
        """One connection attempt; transient failures raise Unavailable (retryable)."""
        cfg = self._cfg
        if self._resolve is not None:       # e.g. the scheduler leader, from etcd
            async with asyncio.timeout(cfg.connect_timeout_s):
                self._host, self._port = await self._resolve()
        try:
            async with asyncio.timeout(cfg.connect_timeout_s):
                if self._unix_path is not None:
                    reader, writer = await asyncio.open_unix_connection(self._unix_path)
                else:
                    reader, writer = await asyncio.open_connection(
                        self._host, self._port, **self._tls_kwargs())
        except (OSError, TimeoutError) as e:
            if is_refusal(e):
                raise Unauthenticated(f"TLS handshake with {self.address} refused: {e}; check "
                                      f"rpc.tls_* on both sides") from None
            raise Unavailable(f"cannot reach {self.address}: {e!r}") from None
        try:
            async with asyncio.timeout(cfg.handshake_timeout_s):
                peer = await self._handshake(reader, writer)
        except BaseException as e:
            writer.transport.abort()
            if is_refusal(e):     # TLS 1.3: the server checks our certificate after connect
                raise Unauthenticated(f"{self.address} refused our TLS certificate: {e}; "
                                      f"check rpc.tls_cert_file / rpc.tls_ca_file") from None
            if isinstance(e, TimeoutError | ConnectionError | OSError):
                raise Unavailable(f"hello with {self.address} failed: {e!r}") from None
            raise
        return _Connection(self, reader, writer, peer)

    def _tls_kwargs(self) -> dict[str, Any]:
        if self._tls is None or self._unix_path is not None:
            return {}
        return {"ssl": self._tls, "server_hostname": self._cfg.tls_server_name or self._host,
                "ssl_handshake_timeout": self._cfg.handshake_timeout_s}

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> HelloReply:
        server_hello = await self._read_hello(reader, ServerHello)
        auth = None if self._secret is None else compute_response(self._secret,
                                                                  server_hello.nonce)
        writer.write(self._codec.frame(Hello(PROTOCOL_VERSION, self._role, self._node_id,
                                             self._kv_fingerprint, auth)))
        await writer.drain()
        return await self._read_hello(reader, HelloReply)

    async def _read_hello(self, reader: asyncio.StreamReader, expected: type) -> Any:
        frame = await read_frame(reader, self._codec.max_frame_bytes)
        if frame is None:
            raise Unavailable(f"{self.address} closed the connection during the hello")
        try:
            msg = self._codec.handshake(frame)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"{self.address} is not a dualpath RPC endpoint: {e}") from e
        if isinstance(msg, ErrorReply):
            _raise_for(msg)
        if type(msg) is not expected:
            raise ProtocolError(f"expected {expected.__name__} from {self.address}, "
                                f"got {type(msg).__name__}")
        return msg


class RpcStream:
    """Async iterator over one server-push call; ``aclose()`` (or ``async with``) cancels it.

    The call starts at the first ``__anext__``. Any exception out of ``__anext__`` (the
    deadline, a typed error, cancellation of the consuming task) ends and cancels the stream.
    """

    def __init__(self, client: RpcClient, msg: Message, budget: float) -> None:
        self._client = client
        self._msg = msg
        self._budget = budget
        self._deadline: float | None = None
        self._conn: _Connection | None = None
        self._call_id = 0
        self._slot: _StreamSlot | None = None
        self._done = False
        self._window = client._cfg.stream_queue_items
        self._unacked = 0       # events consumed since the last credit sent

    def __aiter__(self) -> RpcStream:
        return self

    async def __aenter__(self) -> RpcStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout_at(self._deadline):
                if self._slot is None:
                    await self._start()
                env = await self._next_envelope()
        except TimeoutError:
            self._cancel()
            raise DeadlineExceeded(f"stream {type(self._msg).__name__} from "
                                   f"{self._client.address} ran past {self._budget:.3g}s") from None
        except BaseException:
            self._cancel()
            raise
        if env is None:
            self._done = True
            raise StopAsyncIteration
        return self._client._decode(env.body, self._client._codec.event, self._msg)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + self._budget
        async with asyncio.timeout_at(self._deadline):
            self._conn = await self._client._ensure_connected()
            self._call_id = next(self._client._ids)
            self._slot = _StreamSlot(self._window)
            await self._conn.open_call(self._slot, self._call_id, self._msg,
                                       self._deadline - loop.time(), self._window)

    async def _next_envelope(self) -> Any:
        slot, conn = self._slot, self._conn
        assert slot is not None and conn is not None    # __anext__ ran _start() first
        while not slot.items:
            if slot.finished:
                if slot.error is not None:
                    raise _copy(slot.error)
                return None
            slot.wake.clear()
            await slot.wake.wait()
        env = slot.items.popleft()
        # Re-grant in half-window batches, counting only events already taken out of the
        # inbox: the server then never has more than a window unread, and never stalls.
        self._unacked += 1
        if self._unacked >= max(1, self._window // 2) and not slot.finished:
            unacked, self._unacked = self._unacked, 0
            await conn.grant(self._call_id, unacked)
        return env

    async def aclose(self) -> None:
        self._cancel()

    def _cancel(self) -> None:
        if not self._done:
            self._done = True
            if self._conn is not None:
                self._conn.abandon(self._call_id)

    def __del__(self) -> None:
        # Dropped without aclose() (e.g. ``break`` out of ``async for``): cancel on the server.
        if not self._done and self._conn is not None and not self._conn.closed:
            try:
                self._cancel()
            except RuntimeError:
                pass        # event loop already closed: the connection is gone anyway


def _retrieve(task: asyncio.Task) -> None:
    """Mark a connect task's exception as seen: waiters re-raise it, nobody else needs it."""
    if not task.cancelled():
        task.exception()
