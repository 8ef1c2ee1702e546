"""Fuzzing the engine socket (issue 26, item 6): the Unix socket an engine in another process
drives its node through (``services/engine_api/server.py``; docs/engine-api.md).

A PE receiver and a DE loader serve their engine sockets (no scheduler, no in-process engines);
a well-behaved prefill engine (``EngineClient``) stays attached the whole time. Each hypothesis
example opens a raw connection to the PE's socket and sends one kind of bad input: random bytes
instead of the hello or after it, calls whose bodies are any msgpack value, engine messages
built from the schema with random content (a stranger attaching under random ids and specs,
calls for requests nobody holds), valid call frames mutated, and bodies nested past the
recursion limit (the decoder bug this issue found: they dropped the connection untyped).

Asserted after every example: the node answered with typed errors (never INTERNAL) or closed
that one connection; it is still RUNNING; the well-behaved engine's calls still work on the
connection it opened at the start. After the whole run: a request planned on the node runs
through the well-behaved engine and the decode side, no page is left allocated, and the test
process's RSS (the node runs in it) grew by less than a generous bound.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.errors import ErrorCode, NotFound
from common.framing import HEADER
from common.protocol import Call, CallError, EngineOk, EngineRequest, ReportCounters, WaitLayer
from services.engine_api.remote import EngineClient
from tests.fuzz_rig import RSS_GROWTH_BOUND_MB, LiveCluster, RawPeer, error_code, frame_of
from tests.helpers import until
from tests.test_datapath import BT, no_leaks, plan, report, tokens
from tests.test_fuzz_decoders import MSGPACK, deep, message_values, mutated
from tools.engine_sim.engines import DecodeEngineSim
from tools.engine_sim.kv_pattern import fill_tokens

pytestmark = [pytest.mark.reliability]

FUZZ = settings(derandomize=True, max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
GOOD = "p0.e0"                 # the well-behaved engine's id; fuzzed attaches never take it


class EngineRig:
    """The cluster (on its own loop, tests/fuzz_rig.py) plus the well-behaved engine."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dp-engsock-")
        root = Path(self._dir.name)
        self.pe_sock, self.de_sock = str(root / "p0.sock"), str(root / "d0.sock")
        self.live = LiveCluster({"pe_receiver": {"engine_socket": self.pe_sock},
                                 "de_loader": {"engine_socket": self.de_sock}},
                                scheduler=False, engines=False)
        self.good: EngineClient | None = None
        self.answers: dict[str, int] = {}
        self.examples: dict[str, int] = {}

    def start(self) -> EngineRig:
        self.live.start()
        self.good = self.live.run(EngineClient.connect(
            self.pe_sock, engine_id=GOOD, role="prefill", kv_spec=self.live.c.spec,
            timeout_s=10.0))
        return self

    def close(self) -> None:
        try:
            if self.good is not None:
                self.live.run(self.good.close())
        finally:
            self.live.close()
            self._dir.cleanup()

    async def still_serving(self) -> None:
        pe = self.live.c.pe["p0"]
        assert pe.status.value == "running", pe.status
        assert type(await self.good.call(ReportCounters({"fuzz_checks": 1.0}))) is EngineOk
        with pytest.raises(NotFound):
            await self.good.call(WaitLayer("nobody", 0, 0, 0.05), 0.05)
        assert GOOD in pe.engine_api.attached()

    def count(self, env: Any) -> None:
        code = error_code(env) or "ok"
        self.answers[code] = self.answers.get(code, 0) + 1


@pytest.fixture(scope="module")
def rig():
    r = EngineRig().start()
    yield r
    r.close()


# ------------------------------------------------------------------ what one example sends

async def instead_of_hello(rig: EngineRig, data: bytes) -> None:
    peer = await RawPeer.open(0, hello=False, path=rig.pe_sock)
    peer.send_bytes(data)
    peer.eof()
    await peer.expect_hello_refused()


async def after_hello(rig: EngineRig, data: bytes) -> None:
    peer = await RawPeer.open(0, path=rig.pe_sock)
    peer.send_bytes(data)
    peer.eof()
    for env in await peer.drain():        # check_envelope: typed, never INTERNAL
        rig.count(env)
    await peer.close()


async def calls(rig: EngineRig, bodies: list[Any]) -> None:
    """One connection, one call per value (its body: the value, encoded)."""
    peer = await RawPeer.open(0, path=rig.pe_sock)
    try:
        for body in bodies:
            rig.count(await peer.answer(peer.send_call(body, deadline_s=2.0)))
    finally:
        await peer.close()


async def nested(rig: EngineRig, depth: int) -> None:
    """A nest past the recursion limit where msgspec skips a value instead of checking its
    type: a call's whole body (the envelope keeps it raw) and an unknown field of a known
    message (the tag peek skips it). The frame is undecodable (PROTOCOL_ERROR on the
    connection, which then closes) or, where the nest still fits, the body is refused
    (INVALID_ARGUMENT). Before the fix either closed the connection with no answer."""
    for body in (deep(depth), b"\x82\xa1t\xacengine.claim\xa1y" + deep(depth)):
        peer = await RawPeer.open(0, path=rig.pe_sock)
        peer.send(Call(7, 2.0, msgspec.Raw(body)))
        peer.eof()
        answers = await peer.drain()
        assert [(type(e), e.id, e.error.code) for e in answers] in (
            [(CallError, 0, ErrorCode.PROTOCOL_ERROR)],
            [(CallError, 7, ErrorCode.INVALID_ARGUMENT)]), answers
        rig.count(answers[0])
        await peer.close()


async def mutated_frames(rig: EngineRig, payload: bytes) -> None:
    peer = await RawPeer.open(0, path=rig.pe_sock)
    peer.send_bytes(frame_of(payload)[:HEADER.size + (1 << 20)])
    peer.eof()
    for env in await peer.drain():
        rig.count(env)
    await peer.close()


def no_good_takeover(value: Any) -> bool:
    """Schema values a stranger may send: never an attach that would replace the good one."""
    return not (isinstance(value, dict) and value.get("t") == "engine.attach"
                and value.get("engine_id") == GOOD)


ENGINE_VALUES = message_values(EngineRequest).filter(no_good_takeover)
VALID_CALL = Call(1, 2.0, msgspec.Raw(msgspec.msgpack.encode(WaitLayer("r", 0, 0, 0.01))))
CASES = {
    "bytes-instead-of-hello": (st.binary(min_size=1, max_size=400), instead_of_hello),
    "bytes-after-hello": (st.binary(min_size=1, max_size=400), after_hello),
    "any-msgpack-bodies": (st.lists(MSGPACK, min_size=1, max_size=4), calls),
    "schema-built-engine-calls": (st.lists(ENGINE_VALUES, min_size=1, max_size=6), calls),
    "mutated-call-frames": (mutated(st.just(msgspec.msgpack.encode(VALID_CALL))),
                            mutated_frames),
    "nested-past-the-limit": (st.integers(1_100, 60_000), nested),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_socket_answers_typed_and_keeps_serving(rig, case):
    strategy, attack = CASES[case]
    live = rig.live
    examples = 0

    @FUZZ
    @given(value=strategy)
    def example(value: Any) -> None:
        nonlocal examples
        examples += 1
        live.run(attack(rig, value))
        live.run(rig.still_serving())
    example()
    rig.examples[case] = examples
    assert examples >= 50, f"only {examples} examples ran"


# ------------------------------------------------------------------ afterwards: real work

def test_after_the_fuzzing_a_request_runs_and_nothing_leaked(rig, reliability):
    """Runs last in the module: the node that took every example above still serves a whole
    request through the well-behaved engine, frees every page, and its process did not grow
    without bound."""
    rig.live.run(_one_request(rig), timeout=120)
    rig.live.run(no_leaks(rig.live.c))
    grown = rig.live.rss_growth_mb()
    assert grown < RSS_GROWTH_BOUND_MB, f"RSS grew {grown:.0f} MB over the fuzzing"
    assert rig.answers.get(ErrorCode.INTERNAL, 0) == 0
    reliability.record(
        "input", "engine socket: bytes instead of / after the hello, any msgpack bodies, "
        "schema-built engine calls, mutated call frames, bodies nested past the recursion "
        "limit", f"typed errors {dict(sorted(rig.answers.items()))}; node running; the "
        f"attached engine's calls and then a whole request succeeded; RSS {grown:+.0f} MB "
        f"(bound {RSS_GROWTH_BOUND_MB})", leaked_pages=0,
        examples=sum(rig.examples.values()))


async def _one_request(rig: EngineRig) -> None:
    c = rig.live.c
    pe = c.pe["p0"]
    rid = "after-fuzz"
    claim = asyncio.ensure_future(rig.good.claim_prefill(rid, 20.0))
    await until(lambda: rid in pe.engine_api.claims_waiting, what="the claim waiting")
    pe.submit_plan(plan(c, rid, tokens(BT + 9, 4), 0, "none"))
    h = await claim
    info = h.info
    for layer in range(c.spec.num_layers):
        await h.layer(layer, 10.0)
        fill_tokens(h.output(layer), c.spec, info.block_keys, info.tail_key, layer, 0,
                    info.prompt_tokens)
        await h.put_layer(layer)
    dec = asyncio.ensure_future(DecodeEngineSim(c.de["d0"].ports["d0.e0"], c.spec,
                                                c.cfg.engine_sim).run())
    try:
        await h.finish(5)
        await until(lambda: report(c.de["d0"], rid, "finished") is not None, 30,
                    what="the request finished on the decode side")
    finally:
        dec.cancel()
        await asyncio.gather(dec, return_exceptions=True)

