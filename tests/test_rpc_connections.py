"""Control-plane RPC connections against live servers on 127.0.0.1:0: reconnect, server death,
graceful stop, client close; broken frames and bad bodies close or answer only the offending
connection; the same on uvloop. Rig: ``test_rpc.py``."""

from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest
import structlog
import uvloop

from common.errors import Cancelled, DeadlineExceeded, ErrorCode, PeerFailed, Unavailable
from common.framing import HEADER
from common.protocol import CallError, ErrorReply, Ping, Pong, Reply, ServerHello
from tests import test_rpc
from tests.helpers import until
from tests.test_rpc import CFG, Count, RawPeer, Rig, Sleep, Slept, TestReply

rig = test_rpc.rig          # the fixture: pytest looks it up by name in this module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


async def test_closing_a_client_while_it_connects_fails_its_callers_with_a_typed_error(rig):
    """``close()`` cancels the connect task every caller waits on; each caller gets a typed
    Cancelled — never a bare CancelledError, which would unwind the caller as if *it* had been
    cancelled (a scheduler's hit lookup did: its submit stream ended and its frontend waited
    for the deadline)."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()             # accepts, never says hello: the handshake waits
        writer.close()
    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    slow = msgspec.structs.replace(CFG, connect_timeout_s=30.0, handshake_timeout_s=30.0)
    client = await rig.client(port, connect=False, cfg=slow)
    calls = [asyncio.create_task(client.call(Ping(b"x"), timeout=30.0)) for _ in range(2)]
    await until(lambda: client._connecting is not None and not client._connecting.done(),
                what="the client connecting")
    await client.close()
    for call in calls:
        with pytest.raises(Cancelled, match="closed while connecting"):
            await call
    srv.close()
    await srv.wait_closed()
