"""Control-plane RPC against live servers on 127.0.0.1:0: calls, streams, typed errors; and the
rig (test channel, ``Rig``, raw peers, ``rig``/``pair`` fixtures) that
``test_rpc_handshake.py`` and ``test_rpc_connections.py`` share."""

from __future__ import annotations

import asyncio
from typing import Any, Union

import msgspec
import pytest
import structlog

from common.config import RpcConfig
from common.errors import (
    DeadlineExceeded, ErrorCode, FrameTooLarge, InternalError, InvalidArgument, NotFound,
    Overloaded, ProtocolError, UnknownMessage,
)
from common.framing import FrameCodec, read_frame
from common.protocol import (
    PROTOCOL_VERSION, Call, CallError, CancelCall, ErrorReply, GetStats, GetStatsReply, Hello, HelloReply,
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
        self.slept = 0
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
        self.slept += 1
        return Slept()

    async def fail(self, msg: Fail, ctx) -> Pong:
        errors = {"invalid": lambda: InvalidArgument("n must be positive"),
                  "runtime": lambda: RuntimeError("boom"),
                  "busy": lambda: Overloaded("queue full", retry_after_s=0.25),
                  # what an awaited operation cancelled elsewhere raises in the handler
                  "cancelled": lambda: asyncio.CancelledError()}
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


async def test_a_notice_runs_to_its_end_though_its_client_stopped_waiting(rig):
    """A notice (``RpcServer(notices=...)``: an engine giving a request up) is not undone by
    the CancelCall its client sends when it stops waiting: after a host stall that cancel
    arrives with the call itself (ci102: an AbandonRequest lost that way left a decode
    attempt waiting for nobody). Its deadline still bounds it."""
    server = await rig.server(notices=frozenset({Sleep}))
    peer = await rig.raw(server.port)                 # the call and its cancel in one read
    peer.send(Call(7, 5.0, msgspec.Raw(msgspec.msgpack.encode(Sleep(0.3)))))
    peer.send(CancelCall(7))
    reply = await peer.recv()
    assert type(reply) is Reply and reply.id == 7
    assert rig.probe.slept == 1 and rig.probe.cancelled == 0
    assert server.stats()["notice_cancels_ignored"] == 1
    reply = await peer.call(8, Sleep(30), deadline_s=0.05)   # still bounded by its deadline
    assert type(reply) is CallError and reply.error.code == ErrorCode.DEADLINE_EXCEEDED


def test_a_notice_must_have_a_handler_and_be_unary():
    for notices, why in (({Unserved}, "without a handler"), ({Count}, "not a stream")):
        with pytest.raises(TypeError, match=why):
            RpcServer(CFG, service="test", node_id="n0", handlers=Probe().handlers,
                      request_type=TestRequest, notices=frozenset(notices))


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


async def test_a_cancelled_error_out_of_a_handler_is_answered_not_dropped(pair):
    # Nobody cancelled this call, but the handler unwound with CancelledError (something it
    # awaited was cancelled elsewhere): the client is answered at once instead of waiting for
    # its deadline on a call the server no longer runs, and the server keeps serving.
    server, client = pair
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(InternalError, match="was cancelled"):
            await client.call(Fail("cancelled"), timeout=30.0)
    assert "handler_cancelled_inside" in [e["event"] for e in logs]
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
