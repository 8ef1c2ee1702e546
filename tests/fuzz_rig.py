"""Shared rig of the fuzz tests: a live in-process cluster on a background event loop, raw
peers that send what no real client would, and the well-behaved clients that must keep working.

Why a background loop: hypothesis drives synchronous test functions (one example per call),
while the services are asyncio. The cluster (``tools.cluster.inprocess``: gateways,
scheduler, PE receiver, DE loader, emulated engines, real UCX on loopback) starts once per test
module in its own thread; every example runs its coroutine there with a deadline
(:meth:`LiveCluster.run`), so a hang fails the test instead of freezing it.

What an example may get back (:func:`check_answers`): frames that decode as envelopes, errors
with a known wire code that is never ``INTERNAL`` (an unhandled exception in a handler), then
at most a clean close — and the service must still be RUNNING afterwards.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import given

from common.config import RpcConfig
from common.errors import ErrorCode
from common.framing import HEADER, FrameCodec, read_frame
from common.protocol import (PROTOCOL_VERSION, AbortDecode, AdminReply, Call, CallError, DataPathReply,
                             GatewayReply, GetStats, Hello, HelloReply,
                             LookupPrefix, Message, Ping, Pong, Reply, ServerHello, StreamEnd,
                             StreamItem)
from common.rpc import RpcClient
from tests.helpers import until

KNOWN_CODES = frozenset(c.value for c in ErrorCode)
ANSWER_TIMEOUT_S = 15.0        # generous: 2 shared cores; only guards against hangs
CLIENT_CFG = RpcConfig(reconnect_attempts=3, reconnect_initial_s=0.01, default_deadline_s=20.0)
_ANY = msgspec.msgpack.Decoder()


RSS_GROWTH_BOUND_MB = 256      # generous: hypothesis and the test rig allocate in the process too


def rss_mb() -> float:
    """Resident memory of this process now, in MB (an in-process cluster's services run here)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RawPeer:
    """A hand-driven control connection: hello by hand, then any bytes at all."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.codec = FrameCodec(AdminReply, 1 << 30)   # bodies are decoded untyped
        self._ids = 1000

    @classmethod
    async def open(cls, port: int, *, hello: bool = True, path: str | None = None) -> RawPeer:
        """Connect to 127.0.0.1:``port``, or to the Unix socket ``path`` (an engine socket)."""
        peer = cls(*await (asyncio.open_unix_connection(path) if path is not None
                           else asyncio.open_connection("127.0.0.1", port)))
        if hello:
            first = peer.codec.handshake(await peer.frame())
            assert type(first) is ServerHello, first
            peer.send(Hello(PROTOCOL_VERSION, "fuzzer", "fuzz-1"))
            reply = peer.codec.handshake(await peer.frame())
            assert type(reply) is HelloReply, reply
        return peer

    def send(self, msg: Message) -> None:
        self.writer.write(self.codec.frame(msg))

    def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)

    def send_call(self, body: Any, deadline_s: float = 10.0, call_id: int | None = None) -> int:
        """A Call whose body is any msgpack-encodable object (a Struct or not)."""
        if call_id is None:
            self._ids += 1
            call_id = self._ids
        self.send(Call(call_id, deadline_s, msgspec.Raw(msgspec.msgpack.encode(body))))
        return call_id

    async def frame(self) -> bytes | None:
        return await asyncio.wait_for(read_frame(self.reader, 1 << 30), ANSWER_TIMEOUT_S)

    async def answer(self, call_id: int) -> Any:
        """The first envelope answering ``call_id`` (Reply / CallError / StreamItem)."""
        while True:
            frame = await self.frame()
            assert frame is not None, f"connection closed before answering call {call_id}"
            env = self.codec.envelope(frame)
            check_envelope(env)
            if getattr(env, "id", None) == call_id:
                return env

    async def drain(self) -> list[Any]:
        """Every envelope until the server closes (after we sent EOF or broke the stream)."""
        out = []
        while True:
            try:
                frame = await self.frame()
            except (ConnectionError, OSError):
                return out
            if frame is None:
                return out
            env = self.codec.envelope(frame)
            check_envelope(env)
            out.append(env)

    async def expect_hello_refused(self) -> None:
        """After bad bytes in place of the hello: read until the server closes — its
        ServerHello, then nothing but typed refusals — and close."""
        frames = []
        while (f := await self.frame()) is not None:   # ServerHello, maybe an ErrorReply
            frames.append(self.codec.handshake(f))
        assert type(frames[0]).__name__ == "ServerHello"
        for msg in frames[1:]:
            assert type(msg).__name__ == "ErrorReply" and msg.code in (
                ErrorCode.PROTOCOL_ERROR, ErrorCode.VERSION_MISMATCH), msg
        await self.close()

    def eof(self) -> None:
        if self.writer.can_write_eof() and not self.writer.is_closing():
            self.writer.write_eof()

    async def close(self) -> None:
        self.writer.transport.abort()


def check_envelope(env: Any) -> None:
    """A server frame is an answer envelope; errors carry a known code, never INTERNAL."""
    assert type(env) in (Reply, StreamItem, StreamEnd, CallError), env
    if type(env) is CallError:
        assert env.error.code in KNOWN_CODES, env.error
        assert env.error.code != ErrorCode.INTERNAL, f"handler crashed: {env.error.message}"
    if type(env) in (Reply, StreamItem):
        body = _ANY.decode(env.body)
        assert isinstance(body, dict) and isinstance(body.get("t"), str), body
        if body["t"] == "error":
            assert body["code"] in KNOWN_CODES and body["code"] != ErrorCode.INTERNAL, body


def error_code(env: Any) -> str | None:
    """The wire code an answer carries (CallError or an ErrorReply body), None for success."""
    if type(env) is CallError:
        return env.error.code
    body = _ANY.decode(env.body) if type(env) in (Reply, StreamItem) else {}
    return body.get("code") if body.get("t") == "error" else None


def tagged(body: Any) -> str | None:
    return body.get("t") if isinstance(body, dict) else None


# --------------------------------------------------------------------------- the live cluster

@dataclass
class Endpoint:
    """One control endpoint of the cluster: its name, port and its service object."""

    name: str
    port: int
    service: Any
    max_frame_bytes: int


class LiveCluster:
    """``local_datapath`` running on a background loop; :meth:`run` executes a coroutine there."""

    def __init__(self, overrides: dict[str, Any] | None = None, **datapath: Any) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="dualpath-fuzz-")
        self.root = Path(self._tmp.name)
        self._overrides = overrides
        self._datapath = datapath          # more local_datapath arguments (engines=False, ...)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-cluster",
                                        daemon=True)
        self._cm = None
        self.c = None
        self.clients: dict[str, Any] = {}
        self.real_calls = 0
        self.rss_at_start = 0.0        # MB, once the cluster is up: the fuzzing's bound is on growth

    def run(self, coro: Coroutine, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> LiveCluster:
        from tools.cluster.inprocess import local_datapath
        self._thread.start()
        self._cm = local_datapath(self.root, overrides=self._overrides, **self._datapath)
        self.c = self.run(self._cm.__aenter__())
        self.run(self._connect_clients())
        self.rss_at_start = rss_mb()
        return self

    def rss_growth_mb(self) -> float:
        return rss_mb() - self.rss_at_start

    def close(self) -> None:
        try:
            if self.c is not None:
                self.run(self._aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
            self._tmp.cleanup()

    async def _aclose(self) -> None:
        for client in self.clients.values():
            await client.close()
        await self._cm.__aexit__(None, None, None)

    # ------------------------------------------------------------------ endpoints
    @property
    def endpoints(self) -> dict[str, Endpoint]:
        c, mf = self.c, self.c.cfg.rpc.max_frame_bytes
        gw = next(iter(c.gateways.values()))
        return {"scheduler": Endpoint("scheduler", c.scheduler.port, c.scheduler, mf),
                "gateway": Endpoint("gateway", gw.rpc_port, gw, mf),
                "pe_receiver": Endpoint("pe_receiver", c.pe["p0"].rpc_port, c.pe["p0"], mf),
                "de_loader": Endpoint("de_loader", c.de["d0"].rpc_port, c.de["d0"], mf)}

    def services(self) -> list[Any]:
        c = self.c
        return [c.scheduler, *c.gateways.values(), *c.pe.values(), *c.de.values()]

    # ------------------------------------------------------------------ well-behaved clients
    async def _connect_clients(self) -> None:
        """One client per endpoint, connected for the whole module (they share the servers
        with the fuzzers: 'another client connected at the same time keeps working')."""
        if self.c.scheduler is None:
            return                  # a cluster without a scheduler: the test brings its own
        from services.scheduler.client.client import SchedulerClient
        eps = self.endpoints
        sched = SchedulerClient("127.0.0.1", eps["scheduler"].port, rpc=CLIENT_CFG,
                                client_id="well-behaved")
        await sched.connect()
        self.clients["scheduler"] = sched
        for name, reply in (("gateway", GatewayReply), ("pe_receiver", DataPathReply),
                            ("de_loader", DataPathReply)):
            client = RpcClient(CLIENT_CFG, "127.0.0.1", eps[name].port, role="well-behaved",
                               node_id=f"good-{name}", reply_type=reply)
            await client.connect()
            self.clients[name] = client

    async def real_calls_work(self, submit: bool = True) -> None:
        """A real call on every endpoint over the connections opened at start; with
        ``submit`` a whole request runs through the data path and must finish."""
        for svc in self.services():
            assert svc.status.value == "running", f"{svc.name} is {svc.status.value}"
        cl = self.clients
        status = await cl["scheduler"].cluster_status()
        assert {n.service for n in status.nodes} >= {"pe_receiver", "de_loader"}, status.nodes
        lookup = await cl["gateway"].call(LookupPrefix(["0" * 32]))
        assert lookup.hit_blocks == 0
        assert await cl["pe_receiver"].call(Ping(b"alive")) == Pong(b"alive")
        stats = await cl["pe_receiver"].call(GetStats())
        assert stats.node_id == "p0"
        aborted = await cl["de_loader"].call(AbortDecode("never-prepared", 0))
        assert aborted.aborted is False
        if submit:
            self.real_calls += 1
            toks = [(self.real_calls * 7919 + i * 31) % 50_000 for i in range(200)]
            final = await cl["scheduler"].run(f"good-{self.real_calls}", "good-session", 200, 3,
                                              token_ids=toks, deadline_s=30, check=True)
            assert final.tokens == 3, final
        self.real_calls += 1

    async def quiet(self, timeout: float = 20.0) -> None:
        """Wait until no attempt is live and every node buffer is empty (nothing leaked)."""
        await until(lambda: not any(self._held().values()), timeout,
                    lambda: f"quiet (still held: {self._held()})", interval=0.02)

    def _held(self) -> dict[str, Any]:
        """What the cluster still holds: pages per pool, staging, attempts, scheduler requests."""
        c = self.c
        return {"pages": {k: v for k, v in c.leaks().items() if v},
                "staging": sum(g.staging.pool.used_pages for g in c.gateways.values()),
                "attempts": sum(len(s.attempts) for s in (*c.pe.values(), *c.de.values())),
                "scheduler requests": c.scheduler.active_requests}


def frame_of(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def fuzz_examples(live: LiveCluster, fuzz_settings, strategy, attack, *,
                  submit_each: bool = False) -> int:
    """Run ``attack(value)`` (a coroutine) for each hypothesis example of ``strategy`` under
    ``fuzz_settings``; after each one the well-behaved clients make real calls (a full request
    too when ``submit_each``), and at the end a full request runs and the cluster must go quiet.
    Returns the number of examples run."""
    count = 0

    @fuzz_settings
    @given(value=strategy)
    def example(value) -> None:
        nonlocal count
        count += 1
        live.run(attack(value))
        live.run(live.real_calls_work(submit=submit_each))

    example()
    live.run(live.real_calls_work(submit=True))
    live.run(live.quiet())
    return count
