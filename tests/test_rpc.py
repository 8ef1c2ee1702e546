"""Control-plane RPC against live servers on 127.0.0.1:0: calls, streams, errors, bad input."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Union

import msgspec
import pytest
import structlog
import uvloop

from common import rpc_client
from common.auth import compute_response, load_secret, verify_response
from common.config import RpcConfig
from common.errors import (
    Cancelled, ConfigError, DeadlineExceeded, ErrorCode, FrameTooLarge, InternalError,
    InvalidArgument, KVSpecMismatch, NotFound, Overloaded, PeerFailed, ProtocolError,
    Unauthenticated, Unavailable, UnknownMessage, VersionMismatch,
)
from common.framing import HEADER, FrameCodec, read_frame
from common.protocol import (
    PROTOCOL_VERSION, Call, CallError, ErrorReply, GetStats, GetStatsReply, Hello, HelloReply,
    Message, Ping, Pong, Reply, ServerHello,
)
from common.rpc import RpcClient, RpcServer, check_handler_coverage
from tests.helpers import until


# --------------------------------------------------------------------------- test channel

class Count(Message, tag="test.count"):
    """Stream ``n`` Counted events; raise NotFound at ``fail_at``; sleep between events."""

    n: int
    fail_at: int = -1
    delay_s: float = 0.0


class Counted(Message, tag="test.counted"):
    i: int


class Sleep(Message, tag="test.sleep"):
    seconds: float


class Slept(Message, tag="test.slept"):
    pass


class Fail(Message, tag="test.fail"):
    kind: str


class Unserved(Message, tag="test.unserved"):
    pass


TestRequest = Union[Ping, GetStats, Count, Sleep, Fail, Unserved]
TestReply = Union[Pong, GetStatsReply, Slept, Counted, ErrorReply]

WINDOW = 16
CFG = RpcConfig(max_inflight_calls=4, stream_queue_items=WINDOW, max_frame_bytes=64 * 1024,
                reconnect_initial_s=0.01, reconnect_max_s=0.1, reconnect_attempts=0,
                handshake_timeout_s=2.0, default_deadline_s=10.0)


class Probe:
    """Handlers of the test service, recording what the server side saw."""

    def __init__(self) -> None:
        self.server: RpcServer | None = None
        self.started = self.cancelled = self.produced = self.streams_closed = 0
        self.saw_ctx_cancelled = False
        self.connected: list[str] = []
        self.disconnected: list[str] = []

    @property
    def handlers(self) -> dict[type, Any]:
        return {Ping: self.ping, GetStats: self.stats, Count: self.count, Sleep: self.sleep,
                Fail: self.fail}

    async def ping(self, msg: Ping, ctx) -> Pong:
        return Pong(msg.payload)

    async def stats(self, msg: GetStats, ctx) -> GetStatsReply:
        return GetStatsReply("test", "n0", self.server.stats())

    async def count(self, msg: Count, ctx):
        try:
            for i in range(msg.n):
                if i == msg.fail_at:
                    raise NotFound(f"event {i} is gone")
                if msg.delay_s:
                    await asyncio.sleep(msg.delay_s)
                self.produced += 1
                yield Counted(i)
        finally:
            self.streams_closed += 1

    async def sleep(self, msg: Sleep, ctx) -> Slept:
        self.started += 1
        try:
            await asyncio.sleep(msg.seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.saw_ctx_cancelled |= ctx.cancelled
            raise
        return Slept()

    async def fail(self, msg: Fail, ctx) -> Pong:
        errors = {"invalid": lambda: InvalidArgument("n must be positive"),
                  "runtime": lambda: RuntimeError("boom"),
                  "busy": lambda: Overloaded("queue full", retry_after_s=0.25)}
        raise errors[msg.kind]()


class RawPeer:
    """A hand-driven connection, to send what RpcClient never would."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.codec = FrameCodec(TestReply, 1 << 20)

    @classmethod
    async def open(cls, port: int, *, handshake: bool = True,
                   version: int = PROTOCOL_VERSION) -> RawPeer:
        peer = cls(*await asyncio.open_connection("127.0.0.1", port))
        if handshake:
            assert type(await peer.recv_hello()) is ServerHello
            peer.send(Hello(version, "raw", "raw-1"))
            assert type(await peer.recv_hello()) is HelloReply
        return peer

    def send(self, msg: Message) -> None:
        self.writer.write(self.codec.frame(msg))

    async def recv_frame(self) -> bytes | None:
        return await asyncio.wait_for(read_frame(self.reader, 1 << 20), 5)

    async def recv_hello(self) -> Any:
        return self.codec.handshake(await self.recv_frame())

    async def recv(self) -> Any:
        frame = await self.recv_frame()
        return None if frame is None else self.codec.envelope(frame)

    async def call(self, call_id: int, body: Any, deadline_s: float = 5.0) -> Any:
        raw = msgspec.Raw(msgspec.msgpack.encode(body))
        self.send(Call(call_id, deadline_s, raw))
        return await self.recv()

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


class Rig:
    """Servers, clients and raw peers of one test; ``aclose`` tears down and checks leaks."""

    def __init__(self) -> None:
        self.probe = Probe()
        self.servers: list[RpcServer] = []
        self.clients: list[RpcClient] = []
        self.raws: list[RawPeer] = []

    async def server(self, port: int = 0, cfg: RpcConfig = CFG, **kw: Any) -> RpcServer:
        server = RpcServer(cfg, service="test", node_id="n0", handlers=self.probe.handlers,
                           request_type=TestRequest, **kw)
        self.probe.server = server
        self.servers.append(server)
        await server.start(port=port)
        return server

    async def client(self, port: int, *, connect: bool = True, cfg: RpcConfig = CFG,
                     node_id: str = "c1", **kw: Any) -> RpcClient:
        client = RpcClient(cfg, "127.0.0.1", port, role="test", node_id=node_id,
                           reply_type=TestReply, **kw)
        self.clients.append(client)
        if connect:
            await client.connect()
        return client

    async def raw(self, port: int, **kw: Any) -> RawPeer:
        peer = await RawPeer.open(port, **kw)
        self.raws.append(peer)
        return peer

    async def aclose(self) -> None:
        for peer in self.raws:
            await peer.close()
        for client in self.clients:
            await client.close()
        for server in self.servers:
            await server.stop(grace_s=0)
        me = asyncio.current_task()
        await until(lambda: not (asyncio.all_tasks() - {me}), what="tasks left behind")


@pytest.fixture
async def rig():
    r = Rig()
    yield r
    await r.aclose()


@pytest.fixture
async def pair(rig):
    server = await rig.server()
    return server, await rig.client(server.port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- calls

async def test_unary_call(pair):
    server, client = pair
    assert await client.call(Ping(b"hi")) == Pong(b"hi")
    stats = await client.call(GetStats(), timeout=1.0)
    assert isinstance(stats, GetStatsReply) and stats.counters["calls_total"] == 2
    assert client.peer.role == "test" and client.peer.node_id == "n0"


async def test_concurrent_calls_share_one_connection(pair):
    server, client = pair
    replies = await asyncio.gather(*(client.call(Ping(bytes([i]))) for i in range(4)))
    assert replies == [Pong(bytes([i])) for i in range(4)]
    assert server.stats()["connections_accepted"] == 1


async def test_stream_delivers_many_events_in_order(rig, pair):
    _, client = pair
    events = [e async for e in client.stream(Count(3000))]
    assert [e.i for e in events] == list(range(3000))
    await until(lambda: rig.probe.streams_closed == 1)


@pytest.mark.parametrize("window", [1, 2, 5])
async def test_stream_flow_control_with_small_windows(rig, window):
    server = await rig.server()
    cfg = msgspec.structs.replace(CFG, stream_queue_items=window)
    client = await rig.client(server.port, cfg=cfg)
    seen = []
    async for event in client.stream(Count(200)):
        seen.append(event.i)
        await asyncio.sleep(0)          # let the reader run ahead as far as it is allowed
    assert seen == list(range(200))
    streams = [client.stream(Count(50)) for _ in range(3)]      # interleaved on one connection

    async def drain(stream) -> list[int]:
        return [e.i async for e in stream]

    assert await asyncio.gather(*map(drain, streams)) == [list(range(50))] * 3


async def test_slow_stream_consumer_pauses_only_its_stream(rig, pair):
    _, client = pair
    stream = client.stream(Count(100_000))
    assert (await anext(stream)).i == 0
    await until(lambda: rig.probe.produced == WINDOW + 1)   # window sent, one more pulled
    for i in range(20):                                      # the connection stays usable
        assert await client.call(Ping(b"%d" % i)) == Pong(b"%d" % i)
    assert rig.probe.produced == WINDOW + 1                 # ...and the generator paused
    await stream.aclose()
    await until(lambda: rig.probe.streams_closed == 1)


async def test_breaking_out_of_a_stream_cancels_it(rig, pair):
    server, client = pair
    async for event in client.stream(Count(100_000)):
        if event.i == 3:
            break
    await until(lambda: rig.probe.streams_closed == 1)
    await until(lambda: server.stats()["calls_inflight"] == 0)
    assert rig.probe.produced < 100_000


async def test_stream_error_after_events_is_typed(pair):
    _, client = pair
    seen = []
    with pytest.raises(NotFound, match="event 5 is gone"):
        async for event in client.stream(Count(10, fail_at=5)):
            seen.append(event.i)
    assert seen == [0, 1, 2, 3, 4]


async def test_stream_deadline(rig, pair):
    _, client = pair
    with pytest.raises(DeadlineExceeded):
        async for _ in client.stream(Count(10_000, delay_s=0.01), timeout=0.1):
            pass
    await until(lambda: rig.probe.streams_closed == 1)


async def test_unary_and_streaming_mismatch(pair):
    _, client = pair
    with pytest.raises(ProtocolError, match="stream"):
        await client.call(Count(3))
    assert [e async for e in client.stream(Ping(b"one"))] == [Pong(b"one")]


async def test_deadline_exceeded_is_typed_and_cancels_the_handler(rig, pair):
    _, client = pair
    with pytest.raises(DeadlineExceeded) as info:
        await client.call(Sleep(30), timeout=0.05)
    assert info.value.retryable
    await until(lambda: rig.probe.cancelled == 1)
    assert await client.call(Ping()) == Pong()


async def test_server_enforces_the_deadline_it_was_sent(rig):
    server = await rig.server()
    peer = await rig.raw(server.port)
    reply = await peer.call(1, Sleep(30), deadline_s=0.05)
    assert type(reply) is CallError and reply.id == 1
    assert reply.error.code == ErrorCode.DEADLINE_EXCEEDED and reply.error.retryable


async def test_handler_typed_error_reaches_the_client(pair):
    _, client = pair
    with pytest.raises(InvalidArgument, match="n must be positive"):
        await client.call(Fail("invalid"))
    with pytest.raises(Overloaded) as info:
        await client.call(Fail("busy"))
    assert info.value.retry_after_s == 0.25


async def test_handler_crash_is_internal_and_server_survives(pair):
    server, client = pair
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(InternalError, match="RuntimeError: boom"):
            await client.call(Fail("runtime"))
    assert [e["event"] for e in logs] == ["handler_failed"]
    assert await client.call(Ping(b"alive")) == Pong(b"alive")
    assert server.stats()["calls_failed"] == 1


async def test_overload_answers_with_a_retry_hint(rig):
    server = await rig.server(cfg=msgspec.structs.replace(CFG, max_inflight_calls=2))
    client = await rig.client(server.port)
    holds = [asyncio.create_task(client.call(Sleep(30))) for _ in range(2)]
    await until(lambda: rig.probe.started == 2)
    with pytest.raises(Overloaded) as info:
        await client.call(Ping())
    assert info.value.retryable and info.value.retry_after_s > 0
    for task in holds:
        task.cancel()
    await until(lambda: rig.probe.cancelled == 2)
    assert await client.call(Ping()) == Pong()


async def test_unserved_request_is_unknown_message(pair):
    _, client = pair
    with pytest.raises(UnknownMessage, match="Unserved"):
        await client.call(Unserved())


async def test_request_above_frame_limit_fails_locally(pair):
    _, client = pair
    with pytest.raises(FrameTooLarge):
        await client.call(Ping(b"x" * (CFG.max_frame_bytes + 1)))
    assert await client.call(Ping()) == Pong()


def test_handler_coverage_and_table_validation():
    handlers = Probe().handlers
    assert check_handler_coverage(handlers, TestRequest) == [Unserved]
    assert check_handler_coverage({**handlers, Unserved: handlers[Ping]}, TestRequest) == []
    with pytest.raises(TypeError, match="Pong"):
        RpcServer(CFG, service="t", node_id="n", request_type=TestRequest,
                  handlers={Pong: handlers[Ping]})
    with pytest.raises(TypeError, match="async"):
        RpcServer(CFG, service="t", node_id="n", request_type=TestRequest,
                  handlers={Ping: lambda msg, ctx: Pong()})


# --------------------------------------------------------------------------- handshake

async def test_version_mismatch_is_typed_and_not_retried(rig, monkeypatch):
    server = await rig.server()
    client = await rig.client(server.port, connect=False)
    monkeypatch.setattr(rpc_client, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    async with asyncio.timeout(5):         # reconnect_attempts=0: a retry would never end
        with pytest.raises(VersionMismatch, match="matching dualpath versions"):
            await client.connect()
    await until(lambda: server.stats()["handshakes_rejected"] == 1)


async def test_raw_hello_with_wrong_version_gets_error_then_close(rig):
    server = await rig.server()
    peer = RawPeer(*await asyncio.open_connection("127.0.0.1", server.port))
    rig.raws.append(peer)
    assert type(await peer.recv_hello()) is ServerHello
    peer.send(Hello(PROTOCOL_VERSION + 7, "raw", "r"))
    error = await peer.recv_hello()
    assert type(error) is ErrorReply and error.code == ErrorCode.VERSION_MISMATCH
    assert await peer.recv_frame() is None


@pytest.mark.parametrize("client_fp", ["", "kv-a"])
async def test_kv_spec_match_or_empty_is_accepted(rig, client_fp):
    server = await rig.server(kv_fingerprint="kv-a")
    client = await rig.client(server.port, kv_fingerprint=client_fp)
    assert await client.call(Ping()) == Pong() and client.peer.kv_fingerprint == "kv-a"


async def test_kv_spec_mismatch(rig):
    server = await rig.server(kv_fingerprint="kv-a")
    client = await rig.client(server.port, connect=False, kv_fingerprint="kv-b")
    with pytest.raises(KVSpecMismatch, match="kv-b"):
        await client.call(Ping(), timeout=5)
    await until(lambda: server.stats()["handshakes_rejected"] == 1)


async def test_auth_with_the_right_secret(rig):
    server = await rig.server(auth_secret=b"s3cret")
    client = await rig.client(server.port, auth_secret=b"s3cret")
    assert await client.call(Ping()) == Pong()


@pytest.mark.parametrize("secret", [b"wrong", None], ids=["wrong", "missing"])
async def test_auth_rejects_wrong_or_missing_secret(rig, secret):
    server = await rig.server(auth_secret=b"s3cret")
    client = await rig.client(server.port, connect=False, auth_secret=secret)
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(Unauthenticated):
            await client.connect()
    assert all(b"s3cret" not in repr(e).encode() for e in logs)
    await until(lambda: server.stats()["handshakes_rejected"] == 1)


def test_auth_helpers(tmp_path):
    nonce = b"n" * 16
    assert verify_response(b"k", nonce, compute_response(b"k", nonce))
    assert not verify_response(b"k", nonce, compute_response(b"j", nonce))
    assert not verify_response(b"k", nonce, None)
    path = tmp_path / "secret"
    path.write_bytes(b"from-file\n")
    path.chmod(0o600)
    assert load_secret(RpcConfig(auth_secret_file=str(path))) == b"from-file"
    assert load_secret(RpcConfig(auth_secret_env="S"), {"S": "from-env"}) == b"from-env"
    assert load_secret(RpcConfig()) is None
    with pytest.raises(ConfigError, match="unset"):
        load_secret(RpcConfig(auth_secret_env="S"), {})
    with pytest.raises(ConfigError, match="only one"):
        load_secret(RpcConfig(auth_secret_env="S", auth_secret_file=str(path)), {"S": "x"})
    with pytest.raises(ConfigError, match="cannot be read"):
        load_secret(RpcConfig(auth_secret_file=str(tmp_path / "nope")))


async def test_handshake_times_out_on_a_silent_peer(rig):
    server = await rig.server(cfg=msgspec.structs.replace(CFG, handshake_timeout_s=0.1))
    peer = RawPeer(*await asyncio.open_connection("127.0.0.1", server.port))
    rig.raws.append(peer)
    assert type(await peer.recv_hello()) is ServerHello
    assert await peer.recv_frame() is None      # closed by the server, nothing else sent


# --------------------------------------------------------------------------- lifecycle

async def test_reconnect_after_server_restart_on_the_same_port(rig):
    server = await rig.server()
    port = server.port
    client = await rig.client(port)
    assert await client.call(Ping(b"1")) == Pong(b"1")
    await server.stop(grace_s=0)
    await until(lambda: not client.connected)
    pending = asyncio.create_task(client.call(Ping(b"2"), timeout=10))
    await until(lambda: client._connecting is not None and not client._connecting.done())
    await server.start(port=port)
    assert await pending == Pong(b"2")
    assert server.port == port and client.connected


async def test_pending_calls_fail_fast_when_the_server_dies(rig):
    server = await rig.server()
    client = await rig.client(server.port)
    calls = [asyncio.create_task(client.call(Sleep(60), timeout=60)) for _ in range(3)]
    stream = client.stream(Count(100_000))
    assert (await anext(stream)).i == 0
    await until(lambda: rig.probe.started == 3)
    await server.stop(grace_s=0)
    async with asyncio.timeout(10):             # far below the calls' own 60 s deadline
        for task in calls:
            with pytest.raises(PeerFailed) as info:
                await task
            assert info.value.retryable
        with pytest.raises(PeerFailed):
            async for _ in stream:
                pass


async def test_stop_lets_inflight_calls_finish_within_grace(rig):
    server = await rig.server()
    client = await rig.client(server.port)
    call = asyncio.create_task(client.call(Sleep(0.05)))
    await until(lambda: rig.probe.started == 1)
    await server.stop(grace_s=5)
    assert await call == Slept()
    await server.stop()                          # idempotent


async def test_connect_gives_up_after_configured_attempts(rig):
    cfg = msgspec.structs.replace(CFG, reconnect_attempts=3)
    client = await rig.client(free_port(), connect=False, cfg=cfg)
    with pytest.raises(Unavailable, match="3 attempts"):
        await client.connect()
    forever = await rig.client(free_port(), connect=False)
    with pytest.raises(Unavailable, match="within"):
        await forever.wait_connected(0.05)


async def test_client_close_cancels_pending_calls_and_server_sees_it(rig):
    server = await rig.server(on_connect=lambda c: rig.probe.connected.append(c.peer.node_id),
                              on_disconnect=_async_hook(rig.probe.disconnected))
    client = await rig.client(server.port, node_id="fe-7")
    await until(lambda: rig.probe.connected == ["fe-7"])
    call = asyncio.create_task(client.call(Sleep(60)))
    await until(lambda: rig.probe.started == 1)
    await client.close()
    with pytest.raises(Cancelled):
        await call
    await until(lambda: rig.probe.disconnected == ["fe-7"])
    assert rig.probe.cancelled == 1 and rig.probe.saw_ctx_cancelled
    with pytest.raises(Cancelled):
        await client.call(Ping())


def _async_hook(sink: list[str]):
    async def hook(conn) -> None:
        sink.append(conn.peer.node_id)
    return hook


# --------------------------------------------------------------------------- bad input

def _garbage(peer: RawPeer) -> None:
    peer.writer.write(HEADER.pack(8) + b"\xc1" * 8)       # 0xc1: never valid msgpack


def _truncated(peer: RawPeer) -> None:
    peer.writer.write(HEADER.pack(100) + b"x" * 10)
    peer.writer.write_eof()


def _oversized(peer: RawPeer) -> None:
    peer.writer.write(HEADER.pack(CFG.max_frame_bytes + 1))


@pytest.mark.parametrize("attack, code, reason", [
    (_garbage, ErrorCode.PROTOCOL_ERROR, "undecodable"),
    (_truncated, None, "truncated"),
    (_oversized, ErrorCode.FRAME_TOO_LARGE, "frame_too_large"),
], ids=["garbage", "truncated", "oversized"])
async def test_broken_frames_close_only_that_connection(rig, attack, code, reason):
    server = await rig.server()
    healthy = await rig.client(server.port, node_id="healthy")
    peer = await rig.raw(server.port)
    with structlog.testing.capture_logs() as logs:
        attack(peer)
        if code is not None:
            error = await peer.recv()
            assert type(error) is CallError and error.id == 0 and error.error.code == code
        assert await peer.recv_frame() is None                  # then a clean close
        await until(lambda: server.stats()["connections_open"] == 1)
    rejected = [e for e in logs if e["event"] == "frame_rejected"]
    assert len(rejected) == 1 and rejected[0]["reason"] == reason
    assert await healthy.call(Ping(b"ok")) == Pong(b"ok")
    assert await (await rig.client(server.port, node_id="new")).call(Ping()) == Pong()


@pytest.mark.parametrize("body, code", [
    ({"t": "no.such.message"}, ErrorCode.UNKNOWN_MESSAGE),
    ({"t": "ping", "payload": 123}, ErrorCode.INVALID_ARGUMENT),
    ({"t": "pong", "payload": b""}, ErrorCode.UNKNOWN_MESSAGE),     # known, wrong channel
    (17, ErrorCode.INVALID_ARGUMENT),
], ids=["unknown-tag", "wrong-type", "other-channel", "not-a-map"])
async def test_bad_bodies_are_answered_and_the_connection_survives(rig, body, code):
    server = await rig.server()
    healthy = await rig.client(server.port, node_id="healthy")
    peer = await rig.raw(server.port)
    with structlog.testing.capture_logs() as logs:
        error = await peer.call(5, body)
    assert type(error) is CallError and error.id == 5 and error.error.code == code
    assert [e["event"] for e in logs] == ["frame_rejected"]
    reply = await peer.call(6, Ping(b"still here"))
    assert type(reply) is Reply and reply.id == 6
    assert msgspec.msgpack.decode(reply.body, type=TestReply) == Pong(b"still here")
    assert await healthy.call(Ping()) == Pong()


async def test_unexpected_envelope_is_answered_and_the_connection_survives(rig):
    server = await rig.server()
    peer = await rig.raw(server.port)
    peer.send(Reply(9, msgspec.Raw(msgspec.msgpack.encode(Pong()))))
    error = await peer.recv()
    assert type(error) is CallError and error.error.code == ErrorCode.PROTOCOL_ERROR
    reply = await peer.call(10, Ping())
    assert type(reply) is Reply and reply.id == 10


async def test_garbage_instead_of_hello_is_refused(rig):
    server = await rig.server()
    peer = RawPeer(*await asyncio.open_connection("127.0.0.1", server.port))
    rig.raws.append(peer)
    assert type(await peer.recv_hello()) is ServerHello
    _garbage(peer)
    error = await peer.recv_hello()
    assert type(error) is ErrorReply and error.code == ErrorCode.PROTOCOL_ERROR
    assert await peer.recv_frame() is None


# --------------------------------------------------------------------------- event loops

def test_everything_runs_on_uvloop():
    async def scenario() -> None:
        rig = Rig()
        try:
            server = await rig.server()
            client = await rig.client(server.port)
            assert await client.call(Ping(b"uv")) == Pong(b"uv")
            assert len([e async for e in client.stream(Count(500))]) == 500
            _garbage(await rig.raw(server.port))
            await until(lambda: server.stats()["frames_rejected"] == 1)
            with pytest.raises(DeadlineExceeded):
                await client.call(Sleep(30), timeout=0.02)
            await server.stop(grace_s=0)
            await until(lambda: not client.connected)
            await server.start(port=server.port)
            assert await client.call(Ping()) == Pong()
        finally:
            await rig.aclose()

    uvloop.run(scenario())
