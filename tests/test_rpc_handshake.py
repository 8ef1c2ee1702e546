"""Control-plane RPC handshake against live servers on 127.0.0.1:0: protocol version, KV spec
fingerprint, shared-secret auth, a silent peer. Rig: ``test_rpc.py``."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import structlog

from common import rpc_client
from common.auth import compute_response, load_secret, verify_response
from common.config import RpcConfig
from common.errors import ConfigError, ErrorCode, KVSpecMismatch, Unauthenticated, VersionMismatch
from common.protocol import PROTOCOL_VERSION, ErrorReply, Hello, Ping, Pong, ServerHello
from tests import test_rpc
from tests.helpers import until
from tests.test_rpc import CFG, RawPeer

rig = test_rpc.rig          # the fixture: pytest looks it up by name in this module


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
