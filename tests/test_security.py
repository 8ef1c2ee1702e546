"""Security properties of issue 8, item 5 (trust model and limits: docs/security.md).

* every listener binds 127.0.0.1 unless configured otherwise (config defaults and a live
  cluster's sockets);
* shared-secret challenge/response on every control hop of a live cluster (secret from a file
  or an environment variable): the cluster works with it, strangers without it or with a wrong
  one get UNAUTHENTICATED, and the secret never shows in logs, errors or config reprs;
* no unsafe deserialization anywhere in the source (pickle, marshal, eval, msgpack ext hooks);
* storage keys can never name a file outside the storage root.
"""

from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path

import msgspec
import numpy as np
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import (KVConfig, RpcConfig, TransportConfig, build_config,
                           load_config)
from tools.config import DualpathConfig
from services.config import ServicesConfig
from common.errors import InvalidArgument, Unauthenticated
from common.framing import FrameCodec
from common.kv import spec_from_config
from common.protocol import (DataPathReply, GatewayReply, GatewayRequest,
                             LookupPrefix, Ping, Pong, SchedulerRequest)
from common.rpc import RpcClient
from tools.cluster import health
from tools.cluster.inprocess import local_datapath
from tests.helpers import two_turns_second_hits
from services.node.config import DELoaderConfig, PEReceiverConfig
from services.scheduler.client.client import SchedulerClient
from services.scheduler.service_config import SchedulerServiceConfig
from storage_gateway.block_format import block_relpath
from storage_gateway.config import GatewayConfig
from storage_gateway.store import GatewayStore
from tests.fuzz_rig import RawPeer, error_code

pytestmark = [pytest.mark.reliability]

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-Zq8WvX1-never-log-me"
LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------- bind addresses

def test_defaults_bind_loopback_only():
    """Every bind address defaults to loopback; exposing a service takes an explicit setting."""
    assert RpcConfig().host == LOOPBACK and TransportConfig().host == LOOPBACK
    assert SchedulerServiceConfig().host is None            # None: falls back to rpc.host
    for cls in (PEReceiverConfig, DELoaderConfig):
        assert cls().host == LOOPBACK
    cfg = load_config(ROOT / "configs" / "default.toml", DualpathConfig, environ={})
    assert cfg.rpc.host == LOOPBACK and cfg.transport.host == LOOPBACK
    assert cfg.pe_receiver.host == LOOPBACK and cfg.de_loader.host == LOOPBACK
    assert cfg.transport.traffic_classes["kv"].ucx_options()["NET_DEVICES"] == "lo"
    for toml in sorted((ROOT / "configs").glob("*.toml")):
        text = toml.read_text()
        assert "0.0.0.0" not in text and "::\"" not in text, f"{toml.name} binds every interface"


async def test_live_cluster_listens_on_loopback_only(tmp_path, reliability):
    async with local_datapath(tmp_path) as c:
        bound = {"scheduler": c.scheduler._server._server.sockets}
        for name, svc in {**c.gateways, **c.pe, **c.de}.items():
            bound[f"{svc.name}:{name}"] = svc.rpc._server.sockets
        for name, sockets in bound.items():
            addrs = {s.getsockname()[0] for s in sockets}
            assert addrs == {LOOPBACK}, (name, addrs)
        for svc in (*c.gateways.values(), *c.pe.values(), *c.de.values()):
            assert svc.transport.address[0] == LOOPBACK, (svc.name, svc.transport.address)
        n = len(bound)
    reliability.record("security", "bind addresses of every control and UCX listener",
                       f"{n} control listeners and their UCX listeners on 127.0.0.1 only")


# --------------------------------------------------------------------------- authentication

def _auth_overrides(kind: str, tmp_path: Path, monkeypatch) -> dict:
    if kind == "file":
        path = tmp_path / "secret"
        path.write_text(SECRET + "\n")
        path.chmod(0o600)
        return {"rpc": {"auth_secret_file": str(path)}}
    monkeypatch.setenv("DUALPATH_TEST_SECRET", SECRET)
    return {"rpc": {"auth_secret_env": "DUALPATH_TEST_SECRET"}}


def _strangers(c, port_of: dict[str, int]) -> list[tuple[str, RpcClient, object]]:
    """Clients of every endpoint without the secret and with a wrong one."""
    plain = RpcConfig(reconnect_attempts=1)
    out = []
    for name, port in port_of.items():
        reply = GatewayReply if name == "gateway" else DataPathReply
        for label, secret in (("missing", None), ("wrong", b"not-" + SECRET.encode())):
            client = RpcClient(plain, LOOPBACK, port, role="stranger", node_id=f"x-{label}",
                               reply_type=reply, auth_secret=secret)
            out.append((f"{name}/{label}", client, Ping(b"hi")))
    return out


@pytest.mark.parametrize("kind", ["file", "env"])
async def test_shared_secret_on_every_hop_and_never_leaked(tmp_path, monkeypatch, capsys,
                                                           caplog, reliability, kind):
    overrides = _auth_overrides(kind, tmp_path, monkeypatch)
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as logs:
        async with local_datapath(tmp_path, overrides=overrides) as c:
            cfg = c.cfg
            assert cfg.rpc.auth_secret_file or cfg.rpc.auth_secret_env
            ports = {"scheduler": c.scheduler.port, "gateway": c.gateways["p0"].rpc_port,
                     "pe_receiver": c.pe["p0"].rpc_port, "de_loader": c.de["d0"].rpc_port}
            # 1. the cluster itself works: nodes registered, two turns of one session, the
            #    second hits what the first wrote (the scheduler's lookup client authenticated)
            async with SchedulerClient(LOOPBACK, c.scheduler.port, rpc=cfg.rpc) as sched:
                await two_turns_second_hits(sched)
            # 2. strangers are refused with a typed error on every endpoint
            errors = []
            for _label, client, msg in _strangers(c, ports):
                with pytest.raises(Unauthenticated) as info:
                    await client.call(msg, timeout=10)
                errors.append(info.value)
                await client.close()
            raw = await RawPeer.open(ports["scheduler"], hello=False)
            first_frame = raw.codec.handshake(await raw.frame())
            await raw.close()
            rejected = sum(int(s.rpc.stats()["handshakes_rejected"])
                           for s in (c.gateways["p0"], c.pe["p0"], c.de["d0"]))
            rejected += int(c.scheduler._server.stats()["handshakes_rejected"])
            # 3. a client holding the secret through the config is accepted everywhere
            for name, port in ports.items():
                ok = RpcClient(cfg.rpc, LOOPBACK, port, role="op", node_id="op",
                               reply_type=GatewayReply if name == "gateway" else DataPathReply)
                assert await ok.call(Ping(b"ok"), timeout=10) == Pong(b"ok"), name
                await ok.close()
            # 4. the container health probe finds the secret the way services do (env)
            monkeypatch.delenv("DUALPATH__RPC__AUTH_SECRET_FILE", raising=False)
            monkeypatch.delenv("DUALPATH__RPC__AUTH_SECRET_ENV", raising=False)
            assert not await health.ping(LOOPBACK, ports["gateway"], timeout=5)
            if cfg.rpc.auth_secret_file:
                monkeypatch.setenv("DUALPATH__RPC__AUTH_SECRET_FILE", cfg.rpc.auth_secret_file)
            else:
                monkeypatch.setenv("DUALPATH__RPC__AUTH_SECRET_ENV", cfg.rpc.auth_secret_env)
            for port in ports.values():
                assert await health.ping(LOOPBACK, port, timeout=5)
            texts = [repr(cfg), str(cfg), repr(cfg.rpc), repr(first_frame),
                     *(repr(e) + str(e) for e in errors),
                     repr(c.scheduler._server.stats()), repr(c.gateways["p0"].counters())]
    assert len(errors) == 2 * len(ports) == rejected
    assert all("UNAUTHENTICATED" in repr(e) for e in errors)
    assert first_frame.nonce and len(first_frame.nonce) == 16
    out, err = capsys.readouterr()
    texts += [repr(e) for e in logs] + [out, err] + [r.getMessage() for r in caplog.records]
    events = {e.get("event") for e in logs}
    assert "handshake_rejected" in events                  # the failures were logged ...
    leaks = [t for t in texts if SECRET in t or SECRET.encode().hex() in t]
    assert not leaks, leaks[:3]                            # ... never with the secret
    reliability.record("security", f"shared secret from {kind}: every hop, strangers",
                       f"cluster ran 2 turns with hits; {len(errors)} missing/wrong-secret "
                       "handshakes UNAUTHENTICATED; secret absent from logs, errors, reprs")


def test_secret_misconfiguration_fails_at_start(tmp_path, monkeypatch):
    """A named but missing secret stops the client and the server from starting (never a
    silent fall-back to no authentication)."""
    from common.errors import ConfigError
    from common.rpc import RpcServer
    monkeypatch.delenv("DUALPATH_TEST_SECRET", raising=False)
    cfg = RpcConfig(auth_secret_env="DUALPATH_TEST_SECRET")
    with pytest.raises(ConfigError, match="unset"):
        RpcClient(cfg, LOOPBACK, 1, role="r", node_id="n", reply_type=GatewayReply)
    with pytest.raises(ConfigError, match="cannot be read"):
        from services.scheduler.shell.service import SchedulerService
        SchedulerService(build_config({"rpc": {"auth_secret_file": str(tmp_path / "none")}},
                                      ServicesConfig, environ={}))
    assert RpcServer  # the server side loads the same way (services call load_secret at start)


# --------------------------------------------------------------------------- deserialization

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                  "jsonpickle", "joblib"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
BANNED_KEYWORDS = {"ext_hook", "allow_pickle"}
SOURCE_DIRS = ("common", "services", "storage_gateway", "sim", "bench", "tests")


def _python_sources() -> list[Path]:
    me = Path(__file__).resolve()
    files = [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py") if p.resolve() != me]
    assert len(files) > 50, files
    return files


def test_no_unsafe_deserialization_anywhere():
    problems = []
    for path in _python_sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                problems += [f"{where} import {a.name}" for a in node.names
                             if a.name.split(".")[0] in BANNED_MODULES]
            elif isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in BANNED_MODULES:
                problems.append(f"{where} from {node.module} import")
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in BANNED_CALLS:
                    problems.append(f"{where} {f.id}()")
                if isinstance(f, ast.Attribute) and f.attr in ("load", "unsafe_load") and \
                        isinstance(f.value, ast.Name) and f.value.id in ("yaml", "torch"):
                    problems.append(f"{where} {f.value.id}.{f.attr}()")
                problems += [f"{where} {k.arg}=" for k in node.keywords
                             if k.arg in BANNED_KEYWORDS]
            elif isinstance(node, ast.Attribute) and node.attr in ("Ext", "ExtType"):
                problems.append(f"{where} msgpack extension type")
    assert not problems, "\n".join(problems)


def test_wire_decoders_refuse_msgpack_extensions():
    """An extension value (what pickle-over-msgpack schemes ride on) is a decode error."""
    codec = FrameCodec(SchedulerRequest, 1 << 20)
    for dec in (codec._env, codec._hello, codec._body):
        assert dec.ext_hook is None
    evil = msgspec.msgpack.encode({"t": "ping", "payload": msgspec.msgpack.Ext(1, b"\x80\x04")})
    with pytest.raises(msgspec.DecodeError):
        codec.body(msgspec.Raw(evil))
    with pytest.raises(msgspec.DecodeError):
        FrameCodec(GatewayRequest, 1 << 20).body(msgspec.Raw(msgspec.msgpack.encode(
            msgspec.msgpack.Ext(5, b"x"))))


# --------------------------------------------------------------------------- storage keys

PATH_PARTS = st.sampled_from(["..", ".", "/", "\\", "\x00", "a", "é", "ab", "0" * 30, "etc",
                              "passwd", "~", "%2e%2e", "\u202e", "０"])
HOSTILE_KEYS = st.one_of(
    st.lists(PATH_PARTS, min_size=1, max_size=12).map("".join),
    st.text(max_size=64),
    st.sampled_from(["../" * 10 + "tmp/x", "/tmp/dualpath-escape", "0" * 31 + "/",
                     "0" * 30 + "..", "0" * 31 + "\x00", "A" * 32, "0" * 4096, "", "0" * 33,
                     "g" * 32, "0" * 31 + "é", "00/00/" + "0" * 26, "0" * 31 + "\n"]),
    st.text("0123456789abcdef./\\\x00", min_size=32, max_size=32).filter(
        lambda k: not all(ch in "0123456789abcdef" for ch in k)))


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def test_storage_keys_never_escape_the_root(tmp_path, reliability):
    root = tmp_path / "sandbox" / "storage"
    root.mkdir(parents=True)
    outside = tmp_path
    spec = spec_from_config(KVConfig())
    loop = asyncio.new_event_loop()
    store = GatewayStore(GatewayConfig(root=str(root), io_threads=1), spec)
    loop.run_until_complete(store.start())
    payload = np.zeros(spec.full_block_bytes, np.uint8)
    before = _tree(outside)
    count = 0

    @settings(derandomize=True, max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(key=HOSTILE_KEYS)
    def example(key: str) -> None:
        nonlocal count
        count += 1
        for op in (lambda: store.write_block(key, payload),
                   lambda: store.write_blocks([key], [payload]),
                   lambda: store.lookup_prefix([key]),
                   lambda: store.read_blocks([key], [[memoryview(payload)]]),
                   lambda: store.delete(key)):
            with pytest.raises(InvalidArgument):
                loop.run_until_complete(op())
        with pytest.raises(InvalidArgument):
            store.contains(key)
        with pytest.raises(InvalidArgument):
            block_relpath(key)

    try:
        example()
        assert _tree(outside) == before, _tree(outside) ^ before   # no file anywhere, none new
        assert store.stats()["blocks_stored"] == 0
    finally:
        loop.run_until_complete(store.close())
        loop.close()
    reliability.record("security", "storage keys: ../, absolute paths, NUL, unicode, overlong",
                       "INVALID_ARGUMENT on write/read/lookup/delete; no file created",
                       examples=count)


async def test_storage_keys_over_rpc_are_refused(tmp_path, reliability):
    """The same over the gateway's wire channel (LookupPrefix / WriteBlocks / ReadBlocks)."""
    from common.protocol import ReadBatch, ReadBlocks, WriteBlocks
    keys = ["../" * 10 + "tmp/x", "/etc/passwd", "0" * 31 + "\x00", "é" * 32, "0" * 5000]
    async with local_datapath(tmp_path, scheduler=False, engines=False) as c:
        gw = c.gateways["p0"]
        before = _tree(tmp_path)
        for key in keys:
            for msg in (LookupPrefix([key]),
                        WriteBlocks("w", [key], LOOPBACK, 1),
                        ReadBlocks("r", [key], LOOPBACK, 1, [ReadBatch(1, 1, [(0, 65536)])])):
                peer = await RawPeer.open(gw.rpc_port)
                env = await peer.answer(peer.send_call(msg))
                await peer.close()
                assert error_code(env) == "INVALID_ARGUMENT", (key, env)
        assert _tree(tmp_path) == before
        assert gw.store.stats()["blocks_stored"] == 0
    reliability.record("security", "storage keys over the gateway RPC",
                       "INVALID_ARGUMENT; no file created", examples=len(keys) * 3)
