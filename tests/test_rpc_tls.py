"""TLS on the control-plane RPC channels (``rpc.tls_*``, common/tls.py; docs/security.md).

Certificates are made at test time (trustme). Checked: a call over TLS works (asyncio and
uvloop); a plaintext client against a TLS server, a TLS client against a plaintext server and a
client trusting another CA all fail with a typed error while the server keeps serving others;
with ``tls_require_client_cert`` a client without a certificate is refused; a bad or missing
file is a ConfigError naming the setting; a whole in-process cluster runs with TLS on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import trustme
import uvloop

from common.config import RpcConfig
from common.errors import ConfigError, Unauthenticated, Unavailable
from common.protocol import Ping, Pong
from common.rpc import RpcClient, RpcServer
from services.scheduler.client.client import SchedulerClient
from tests import test_rpc
from tests.helpers import two_turns_second_hits, until
from tests.test_rpc import CFG, Probe, TestReply, TestRequest
from tools.cluster.inprocess import local_datapath

rig = test_rpc.rig          # the fixture: pytest looks it up by name in this module


class Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""

    def __init__(self, root: Path, ca: trustme.CA | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.ca = ca or trustme.CA()
        self.ca_file = str(root / "ca.pem")
        self.ca.cert_pem.write_to_path(self.ca_file)
        self.server = self._issue(root, "server", "127.0.0.1", "localhost")
        self.client = self._issue(root, "client", "client.dualpath.test")

    def _issue(self, root: Path, name: str, *hosts: str) -> tuple[str, str]:
        cert = self.ca.issue_cert(*hosts)
        cert_file, key_file = str(root / f"{name}.pem"), str(root / f"{name}.key")
        for blob in cert.cert_chain_pems:
            blob.write_to_path(cert_file, append=True)
        cert.private_key_pem.write_to_path(key_file)
        return cert_file, key_file

    def cfg(self, who: str = "server", *, base: RpcConfig = CFG, **kw: object) -> RpcConfig:
        cert, key = getattr(self, who)
        return msgspec.structs.replace(base, tls_cert_file=cert, tls_key_file=key,
                                       tls_ca_file=self.ca_file, **kw)


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path / "pki")


def _once(cfg: RpcConfig) -> RpcConfig:
    """One connection attempt: a refused plaintext peer would otherwise be retried forever."""
    return msgspec.structs.replace(cfg, reconnect_attempts=1, handshake_timeout_s=1.0)


async def test_call_over_tls(rig, pki):
    server = await rig.server(cfg=pki.cfg())
    client = await rig.client(server.port, cfg=pki.cfg("client"))
    assert await client.call(Ping(b"tls")) == Pong(b"tls")
    transport = client._conn._writer.transport
    assert transport.get_extra_info("ssl_object") is not None      # really encrypted


async def test_the_failover_bench_settings_are_mutual_tls(rig, tmp_path):
    """``bench failover --tls`` (tools.cluster.failover.mutual_tls_settings): one certificate
    every process presents as server and client; a client without it is refused."""
    from tools.cluster.failover import mutual_tls_settings
    cfg = msgspec.structs.replace(CFG, **mutual_tls_settings(tmp_path / "bench-pki"))
    assert cfg.tls_require_client_cert
    server = await rig.server(cfg=cfg)
    client = await rig.client(server.port, cfg=cfg)
    assert await client.call(Ping(b"bench")) == Pong(b"bench")
    assert client._conn._writer.transport.get_extra_info("ssl_object") is not None
    anonymous = await rig.client(server.port, connect=False, cfg=_once(msgspec.structs.replace(
        cfg, tls_cert_file="", tls_key_file="")))
    with pytest.raises((Unauthenticated, Unavailable)):     # the alert, or the close after it
        await anonymous.call(Ping(b"no cert"), timeout=10)


def test_call_over_tls_on_uvloop(pki):
    """Services run on uvloop: the server's start_tls upgrade must work there too."""
    async def main() -> None:
        server = RpcServer(pki.cfg(), service="test", node_id="n0",
                           handlers=Probe().handlers, request_type=TestRequest)
        await server.start()
        client = RpcClient(pki.cfg("client"), "127.0.0.1", server.port, role="test",
                           node_id="c1", reply_type=TestReply)
        try:
            assert await client.call(Ping(b"uv"), timeout=10) == Pong(b"uv")
        finally:
            await client.close()
            await server.stop(grace_s=0)
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


async def test_plaintext_client_is_refused_and_server_keeps_serving(rig, pki):
    server = await rig.server(cfg=pki.cfg())
    plain = await rig.client(server.port, connect=False, cfg=_once(CFG))
    with pytest.raises(Unavailable):
        await plain.call(Ping(b"x"), timeout=10)
    good = await rig.client(server.port, cfg=pki.cfg("client"), node_id="c2")
    assert await good.call(Ping(b"still")) == Pong(b"still")


async def test_tls_client_against_plaintext_server_is_typed(rig, pki):
    server = await rig.server()
    client = await rig.client(server.port, connect=False, cfg=_once(pki.cfg("client")))
    with pytest.raises(Unauthenticated, match="TLS"):
        await client.call(Ping(b"x"), timeout=10)


async def test_client_trusting_another_ca_is_refused(rig, pki, tmp_path):
    server = await rig.server(cfg=pki.cfg())
    other = Pki(tmp_path / "other")
    stranger = await rig.client(server.port, connect=False, cfg=_once(other.cfg("client")))
    with pytest.raises(Unauthenticated, match="certificate verify failed"):
        await stranger.call(Ping(b"x"), timeout=10)
    good = await rig.client(server.port, cfg=pki.cfg("client"), node_id="c2")
    assert await good.call(Ping(b"ok")) == Pong(b"ok")


async def test_mutual_auth_refuses_a_client_without_a_certificate(rig, pki, tmp_path):
    server = await rig.server(cfg=pki.cfg(tls_require_client_cert=True))
    anon = msgspec.structs.replace(_once(CFG), tls_ca_file=pki.ca_file)      # verifies, no cert
    refused = await rig.client(server.port, connect=False, cfg=anon)
    # TLS 1.3 checks the client's certificate after the client finished its side: the client
    # sees either the server's alert (Unauthenticated) or the close that follows (Unavailable)
    with pytest.raises((Unauthenticated, Unavailable)):
        await refused.call(Ping(b"x"), timeout=10)
    # a certificate from another CA is refused too; one from the cluster's CA is accepted
    other = Pki(tmp_path / "other")
    foreign = msgspec.structs.replace(other.cfg("client", base=_once(CFG)),
                                      tls_ca_file=pki.ca_file)
    with pytest.raises((Unauthenticated, Unavailable)):
        await (await rig.client(server.port, connect=False, cfg=foreign,
                                node_id="c3")).call(Ping(b"x"), timeout=10)
    good = await rig.client(server.port, cfg=pki.cfg("client"), node_id="c2")
    assert await good.call(Ping(b"mtls")) == Pong(b"mtls")


async def test_failed_handshakes_are_counted_and_the_server_keeps_serving(rig, pki, tmp_path):
    """``tls_handshakes_failed`` (the server's stats): a peer that sends plaintext, a client
    trusting another CA and a plaintext dualpath client (it waits for our hello: the server's
    handshake times out) each count one; a good client is served throughout."""
    server = await rig.server(cfg=pki.cfg(handshake_timeout_s=1.0))
    assert server.stats()["tls_handshakes_failed"] == 0
    good = await rig.client(server.port, cfg=pki.cfg("client"), node_id="good")
    assert server.stats()["tls_handshakes_failed"] == 0          # a good handshake is not one

    def failed() -> float:
        return server.stats()["tls_handshakes_failed"]
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"\x00\x00\x00\x05hello")                     # a plaintext frame
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10) == b""       # closed, nothing said
    writer.close()
    await until(lambda: failed() == 1, 10, what=lambda: f"1 failure counted, got {failed()}")
    assert await good.call(Ping(b"after plaintext")) == Pong(b"after plaintext")

    other = Pki(tmp_path / "other")
    stranger = await rig.client(server.port, connect=False, cfg=_once(other.cfg("client")),
                                node_id="stranger")
    with pytest.raises(Unauthenticated):
        await stranger.call(Ping(b"x"), timeout=10)
    await until(lambda: failed() == 2, 10, what=lambda: f"2 failures counted, got {failed()}")

    plain = await rig.client(server.port, connect=False, cfg=_once(CFG), node_id="plain")
    with pytest.raises(Unavailable):
        await plain.call(Ping(b"x"), timeout=10)
    await until(lambda: failed() == 3, 10, what=lambda: f"3 failures counted, got {failed()}")
    assert await good.call(Ping(b"still")) == Pong(b"still")
    assert failed() == 3
    assert "tls_handshakes_failed" in (await rig.server()).stats()   # plaintext servers: 0
    assert (await rig.server()).stats()["tls_handshakes_failed"] == 0


def test_bad_or_missing_files_are_config_errors_naming_the_setting(pki, tmp_path):
    def server(**kw: object) -> None:
        RpcServer(msgspec.structs.replace(CFG, **kw), service="t", node_id="n",
                  handlers={}, request_type=TestRequest)

    def client(**kw: object) -> None:
        RpcClient(msgspec.structs.replace(CFG, **kw), "127.0.0.1", 1, role="t", node_id="c",
                  reply_type=TestReply)

    cert, key = pki.server
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [
        (server, {"tls_cert_file": str(tmp_path / "none.pem"), "tls_key_file": key},
         "rpc.tls_cert_file"),
        (server, {"tls_cert_file": cert, "tls_key_file": str(tmp_path / "none.key")},
         "rpc.tls_key_file"),
        (server, {"tls_cert_file": cert}, "rpc.tls_key_file"),
        (server, {"tls_cert_file": str(junk), "tls_key_file": key}, "rpc.tls_cert_file"),
        (server, {"tls_cert_file": cert, "tls_key_file": pki.client[1]}, "rpc.tls_key_file"),
        (server, {"tls_cert_file": cert, "tls_key_file": key, "tls_require_client_cert": True},
         "rpc.tls_ca_file"),
        (client, {"tls_ca_file": str(junk)}, "rpc.tls_ca_file"),
        (client, {"tls_ca_file": str(tmp_path / "none.pem")}, "rpc.tls_ca_file"),
    ]
    for build, kw, field in cases:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            build(**kw)


async def test_cluster_end_to_end_with_mutual_tls(tmp_path, pki):
    """Every hop (nodes → scheduler, PE → DE, nodes and the scheduler's lookup → gateways)
    over TLS with client certificates: the cluster runs two turns and the second hits."""
    cert, key = pki.server          # one certificate per host: all processes share 127.0.0.1
    overrides = {"rpc": {"tls_cert_file": cert, "tls_key_file": key,
                         "tls_ca_file": pki.ca_file, "tls_require_client_cert": True}}
    async with local_datapath(tmp_path, overrides=overrides) as c:
        async with SchedulerClient("127.0.0.1", c.scheduler.port, rpc=c.cfg.rpc) as sched:
            await two_turns_second_hits(sched)
        servers = [c.scheduler._server, *(s.rpc for s in (*c.gateways.values(),
                                                          *c.pe.values(), *c.de.values()))]
        assert all(s._tls is not None for s in servers)
        plain = RpcClient(_once(RpcConfig()), "127.0.0.1", c.scheduler.port, role="op",
                          node_id="op", reply_type=TestReply)
        with pytest.raises(Unavailable):
            await plain.call(Ping(b"x"), timeout=10)
        await plain.close()
        # every service publishes its listener's failed handshakes (common.metrics exports
        # stats()): the plaintext client counts on the scheduler, nowhere else
        await until(lambda: c.scheduler.stats()["rpc_tls_handshakes_failed"] == 1,
                    what=lambda: f"scheduler stats {c.scheduler.stats()}")
        for svc in (*c.gateways.values(), *c.pe.values(), *c.de.values()):
            assert svc.stats()["rpc_tls_handshakes_failed"] == 0, svc.name
        async with SchedulerClient("127.0.0.1", c.scheduler.port, rpc=c.cfg.rpc) as sched:
            assert (await sched.cluster_status()).nodes          # still serving
        await asyncio.sleep(0)
