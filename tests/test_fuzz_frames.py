"""Frame-level fuzzing of every control endpoint of a live cluster (issue 8, item 3).

Targets: the scheduler (frontend + node channels on one port), a storage gateway, the PE
receiver (its admin channel) and the DE loader (the data-path channel). Each hypothesis
example opens a raw connection and sends one kind of bad input: random bytes (before and after
the hello), truncated frames, huge declared lengths, envelopes of the wrong shape, bodies of
the wrong msgpack types, unknown tags, calls with absurd ids/deadlines, stray flow-control
frames, bodies nested past the recursion limit and valid call frames mutated (issue 26).
Outcome required: the server answers with a typed error (never INTERNAL) or closes that one
connection; after every example the well-behaved clients — connected since the start,
on the same servers — make real calls; after every test a whole request runs through the data
path, and every buffer is empty again.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from common.errors import ErrorCode
from common.framing import HEADER
from common.protocol import (Call, CallError, CancelCall, Envelope, GetStats, Ping, Reply,
                             StreamCredit, union_members)
from tests.fuzz_rig import (RSS_GROWTH_BOUND_MB, LiveCluster, RawPeer, error_code, frame_of,
                            fuzz_examples)
from tests.test_fuzz_decoders import deep, mutated

pytestmark = [pytest.mark.reliability]

ENDPOINTS = ("scheduler", "gateway", "pe_receiver", "de_loader")
FUZZ = settings(derandomize=True, max_examples=12, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# msgpack values of every type (nested), the raw material of wrong-type bodies.
MSGPACK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=40) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=6),
    max_leaves=25)
ENVELOPE_TAGS = [cls.__struct_config__.tag for cls in union_members(Envelope)]


@pytest.fixture(scope="module")
def live():
    cluster = LiveCluster().start()
    yield cluster
    cluster.close()


def run_examples(live: LiveCluster, name: str, strategy, attack) -> int:
    """Run ``attack(peer_port, value)`` for each example; the real calls follow each one."""
    port = live.endpoints[name].port
    return fuzz_examples(live, FUZZ, strategy, lambda value: attack(port, value))


async def _survives(peer: RawPeer) -> None:
    """The fuzzed connection itself still serves a call."""
    cid = peer.send_call(Ping(b"still-here"))
    env = await peer.answer(cid)
    assert type(env) is Reply, env
    await peer.close()


async def _closed_without_internal(peer: RawPeer) -> list:
    peer.eof()
    envs = await peer.drain()         # asserts every frame is a typed answer
    await peer.close()
    return envs


# --------------------------------------------------------------------------- attacks

async def random_after_hello(port: int, data: bytes) -> None:
    peer = await RawPeer.open(port)
    peer.send_bytes(data)
    await _closed_without_internal(peer)


async def random_instead_of_hello(port: int, data: bytes) -> None:
    peer = await RawPeer.open(port, hello=False)
    peer.send_bytes(data)
    peer.eof()
    await peer.expect_hello_refused()


async def truncated(port: int, cut: float) -> None:
    peer = await RawPeer.open(port)
    whole = peer.codec.frame(msgspec.structs.replace(_ping_call(), id=7))
    peer.send_bytes(bytes(whole[:max(1, int(len(whole) * cut))]))
    assert await _closed_without_internal(peer) == []


async def huge_length(port: int, size: int) -> None:
    peer = await RawPeer.open(port)
    peer.send_bytes(HEADER.pack(size) + b"\x00" * 16)     # no EOF: the server must not wait
    envs = await peer.drain()
    assert len(envs) == 1 and type(envs[0]) is CallError and envs[0].id == 0
    assert envs[0].error.code == ErrorCode.FRAME_TOO_LARGE
    await peer.close()


async def wrong_types(port: int, body) -> None:
    peer = await RawPeer.open(port)
    if isinstance(body, dict) and isinstance(body.get("t"), str):
        body = {**body, "t": "fuzz." + body["t"]}          # never a real tag by chance
    env = await peer.answer(peer.send_call(body))
    assert error_code(env) in (ErrorCode.INVALID_ARGUMENT, ErrorCode.UNKNOWN_MESSAGE), env
    await _survives(peer)


async def unknown_tag(port: int, value: tuple[str, dict]) -> None:
    tag, fields = value
    peer = await RawPeer.open(port)
    env = await peer.answer(peer.send_call({**fields, "t": "zz." + tag}))
    assert error_code(env) == ErrorCode.UNKNOWN_MESSAGE, env
    await _survives(peer)


async def bad_envelope(port: int, value) -> None:
    peer = await RawPeer.open(port)
    peer.send_bytes(frame_of(msgspec.msgpack.encode(value)))
    await _closed_without_internal(peer)


async def odd_calls(port: int, value: tuple[int, float]) -> None:
    call_id, deadline = value
    peer = await RawPeer.open(port)
    env = await peer.answer(peer.send_call(GetStats(), deadline_s=deadline, call_id=call_id))
    # A past deadline may still win the race against an instant handler: reply or expired.
    assert error_code(env) in (None, ErrorCode.DEADLINE_EXCEEDED), env
    if math.isnan(deadline) or deadline >= 1.0:
        assert error_code(env) is None, env
    await _survives(peer)


async def stray_flow_control(port: int, value: list[tuple[bool, int, int]]) -> None:
    peer = await RawPeer.open(port)
    for cancel, call_id, n in value:
        peer.send(CancelCall(call_id) if cancel else StreamCredit(call_id, n))
    await _survives(peer)


async def nested_past_the_limit(port: int, depth: int) -> None:
    """A call body nested past the recursion limit (issue 26: it closed the connection with
    no answer): PROTOCOL_ERROR on the connection, or INVALID_ARGUMENT where it still fits."""
    peer = await RawPeer.open(port)
    peer.send(Call(7, 5.0, msgspec.Raw(deep(depth))))
    peer.eof()
    envs = await peer.drain()
    assert [(type(e), e.id, e.error.code) for e in envs] in (
        [(CallError, 0, ErrorCode.PROTOCOL_ERROR)],
        [(CallError, 7, ErrorCode.INVALID_ARGUMENT)]), envs
    await peer.close()


async def mutated_call(port: int, payload: bytes) -> None:
    """A valid call frame's bytes flipped, cut or spliced: typed answers, then the close."""
    peer = await RawPeer.open(port)
    peer.send_bytes(frame_of(payload))
    peer.eof()
    await peer.drain()
    await peer.close()


def _ping_call():
    return Call(1, 5.0, msgspec.Raw(msgspec.msgpack.encode(Ping(b"x" * 40))))


INT64 = st.integers(-(2**63), 2**63 - 1)
CASES = {
    "random-bytes-after-hello": (st.binary(min_size=1, max_size=600), random_after_hello),
    "random-bytes-instead-of-hello": (st.binary(min_size=1, max_size=600),
                                      random_instead_of_hello),
    "truncated-frame": (st.floats(0.01, 0.99), truncated),
    "huge-declared-length": (st.integers(4 * 1024 * 1024 + 1, 2**32 - 1), huge_length),
    "wrong-msgpack-types": (MSGPACK, wrong_types),
    "unknown-tag": (st.tuples(st.text(max_size=20), st.dictionaries(st.text(max_size=8),
                                                                    MSGPACK, max_size=4)),
                    unknown_tag),
    "bad-envelope": (st.one_of(MSGPACK, st.tuples(st.sampled_from(ENVELOPE_TAGS),
                                                   st.lists(MSGPACK, max_size=4))
                               .map(lambda p: [p[0], *p[1]])), bad_envelope),
    "odd-call-ids-and-deadlines": (st.tuples(INT64, st.floats() | st.sampled_from(
        [0.0, -1.0, 1e-9, 1e300, math.inf, -math.inf, math.nan])), odd_calls),
    "stray-cancel-and-credit": (st.lists(st.tuples(st.booleans(), INT64, INT64), max_size=8),
                                stray_flow_control),
    "nested-past-the-limit": (st.integers(1_100, 50_000), nested_past_the_limit),
    "mutated-valid-call": (mutated(st.just(msgspec.msgpack.encode(_ping_call()))), mutated_call),
}


REJECTED = {"random-bytes-after-hello", "truncated-frame", "huge-declared-length",
            "wrong-msgpack-types", "unknown-tag", "bad-envelope", "nested-past-the-limit"}


def _rpc_stats(svc) -> dict[str, float]:
    server = getattr(svc, "rpc", None) or svc._server      # the scheduler names it _server
    return server.stats()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ENDPOINTS)
def test_bad_frames_never_hurt_the_service(live, reliability, name, case):
    strategy, attack = CASES[case]
    before = live.endpoints[name].service
    rejected = _rpc_stats(before)["frames_rejected"]
    n = run_examples(live, name, strategy, attack)
    assert n >= 1
    if case in REJECTED:              # the server saw (and counted) the bad frames itself
        assert _rpc_stats(before)["frames_rejected"] > rejected
    assert live.endpoints[name].service is before and before.status.value == "running"
    reliability.record("input", f"{name}: {case}", "typed error or that connection closed; "
                       "service running; concurrent client's real calls succeeded",
                       examples=n)


def test_the_cluster_served_on_and_its_memory_stayed_bounded(live, reliability):
    """Last in the module: after every case above, a whole request still runs, nothing is
    held, and the process the services run in grew less than a generous bound."""
    live.run(live.real_calls_work(submit=True))
    live.run(live.quiet())
    grown = live.rss_growth_mb()
    assert grown < RSS_GROWTH_BOUND_MB, f"RSS grew {grown:.0f} MB over the frame fuzzing"
    reliability.record("input", "all four services after every frame case", "a whole request "
                       f"ran; nothing held; RSS {grown:+.0f} MB (bound {RSS_GROWTH_BOUND_MB})")
