"""Schema-level fuzzing of every control endpoint (issue 8, item 3): frames that decode, whose
bodies are the wrong shape, or the right shape with inconsistent or absurd content.

* wrong schema: a real tag of the endpoint's union with fields of random msgpack types;
* frontend: SubmitRequest with hostile ids, lengths, keys, token ids, hits, NaN/past
  deadlines, huge lists; duplicate request ids; CancelRequest of anything;
* node channel: FetchWork / Heartbeat from unregistered nodes or with wrong epochs,
  ReportProgress for unknown / finished requests and absurd stages, RegisterNode with bad
  ports, too many or duplicate engines, inconsistent roles (fuzzed node ids are ``fz-…``: a
  node that registers under another node's id is trusted by design, see docs/security.md);
* gateway: LookupPrefix with path-like keys, ReadBlocks with slots out of bounds and batches
  that do not add up, WriteBlocks with mismatched lengths, WatchTelemetry with NaN intervals;
* DE loader: PrepareDecode with inconsistent sizes, PullLayers / PrefillDone for attempts
  that do not exist or with layers out of range, AbortDecode of anything.

UCX addresses in fuzzed messages are always loopback ports nobody listens on: the fuzzer
never makes a service send traffic off the host or into another test's process.
Outcome: a typed error (never INTERNAL), or a valid answer; after every example the
well-behaved clients make real calls, after every test a request runs end to end, and no page
stays allocated anywhere.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from common.errors import ErrorCode
from common.protocol import (AbortDecode, AdminRequest, CancelCall, CancelRequest,
                             DataPathRequest, EngineInfo, EngineLoad, FetchWork,
                             GatewayRequest, Heartbeat, LayerSlots, LookupPrefix, PrefillDone,
                             PrepareDecode, PullLayers, ReadBatch, ReadBlocks, RegisterNode,
                             ReportProgress, SchedulerRequest, StreamItem, SubmitRequest,
                             WatchTelemetry, WriteBlocks, union_members)
from tests.fuzz_rig import LiveCluster, RawPeer, error_code, fuzz_examples
from tests.helpers import closed_port, until

pytestmark = [pytest.mark.reliability]

FUZZ = settings(derandomize=True, max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
UNIONS = {"scheduler": SchedulerRequest, "gateway": GatewayRequest,
          "pe_receiver": AdminRequest, "de_loader": DataPathRequest}
DEAD_PORT = closed_port()

MSGPACK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=30) | st.binary(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=5),
    max_leaves=20)
# one_of picks a branch uniformly: plausible values often enough to get past the first check
INTS = st.one_of(st.integers(-(2**63), 2**63 - 1),
                 st.sampled_from([0, 1, -1, 63, 64, 65, 2**31, 2**32]), st.integers(0, 3))
FLOATS = st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-9, 1e300])
HEX = st.text("0123456789abcdef", min_size=32, max_size=32)
PATHISH = st.sampled_from(["../" * 8 + "etc/passwd", "/etc/passwd", "a" * 31 + "\x00",
                           "A" * 32, "0" * 33, "0" * 31, "", "é" * 32, "0" * 10_000,
                           "00/../../" + "0" * 23, "\\..\\" * 8])
KEYS = st.one_of(st.lists(HEX, max_size=6), st.lists(HEX | PATHISH | st.text(max_size=40),
                                                    max_size=12))
VALID_ID = st.text("abcdefghij0123456789-", min_size=1, max_size=12)
IDS = st.one_of(VALID_ID, VALID_ID, st.text(max_size=20),
                st.sampled_from(["", "x" * 10_000, "a\nb", "\x00", "good-1"]))
HOSTS = st.sampled_from(["127.0.0.1", ""])                    # never off this host
PORTS = st.sampled_from([DEAD_PORT, 0, -1, 65_536, 2**40])     # never another live port
SLOTS = st.lists(st.tuples(INTS, INTS), max_size=6)


@pytest.fixture(scope="module")
def live():
    cluster = LiveCluster().start()
    yield cluster
    cluster.close()


def fuzz(live: LiveCluster, strategy, attack, *, submit_each: bool = False) -> int:
    """``attack(live, value)`` per example (``fuzz_rig.fuzz_examples``)."""
    return fuzz_examples(live, FUZZ, strategy, lambda value: attack(live, value),
                         submit_each=submit_each)


async def ask(live: LiveCluster, endpoint: str, body, deadline_s: float = 10.0):
    """One call on a fresh raw connection; streams are cancelled after their first event."""
    peer = await RawPeer.open(live.endpoints[endpoint].port)
    try:
        cid = peer.send_call(body, deadline_s)
        env = await peer.answer(cid)
        if type(env) is StreamItem:
            peer.send(CancelCall(cid))
        return env
    finally:
        await peer.close()


def answered(env, *allowed: str) -> None:
    """A success, or one of the ``allowed`` typed errors (INTERNAL was already refused)."""
    code = error_code(env)
    assert code is None or code in allowed, (code, env)


# --------------------------------------------------------------------------- wrong schema

@pytest.mark.parametrize("name", list(UNIONS))
def test_known_tags_with_wrong_field_types(live, reliability, name):
    members = union_members(UNIONS[name])

    async def attack(live, value):
        cls, fields = value
        body = {"t": cls.__struct_config__.tag, **fields}
        env = await ask(live, name, body, deadline_s=3.0)
        answered(env, ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.ALREADY_EXISTS,
                 ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNKNOWN_MESSAGE)

    def bodies(cls):
        names = [f.name for f in msgspec.structs.fields(cls)]
        return st.fixed_dictionaries({}, optional={n: MSGPACK for n in names}).map(
            lambda d: (cls, d))

    n = fuzz(live, st.sampled_from(members).flatmap(bodies), attack)
    reliability.record("input", f"{name}: known tag, fields of random msgpack types",
                       "INVALID_ARGUMENT (or a valid answer); service running", examples=n)


# --------------------------------------------------------------------------- scheduler: frontend

SUBMITS = st.builds(
    SubmitRequest, request_id=IDS, session_id=IDS,
    prompt_tokens=INTS | st.integers(1, 600), gen_tokens=INTS | st.integers(1, 4),
    block_keys=KEYS | st.just(["0" * 32] * 9000),
    token_ids=st.none() | st.lists(INTS, max_size=8) | st.lists(st.integers(0, 99), min_size=64,
                                                                  max_size=200),
    hit_tokens=st.none() | INTS | st.sampled_from([0, 64, 128]),
    deadline_s=st.none() | FLOATS)


def test_frontend_hostile_submissions(live, reliability):
    async def attack(live, msg):
        env = await ask(live, "scheduler", msg)
        answered(env, ErrorCode.INVALID_ARGUMENT, ErrorCode.ALREADY_EXISTS)

    n = fuzz(live, SUBMITS, attack)
    reliability.record("input", "scheduler: SubmitRequest with hostile ids/lengths/keys/token "
                       "ids/hits, NaN and past deadlines, huge lists",
                       "INVALID_ARGUMENT or accepted then cancelled; nothing leaked", examples=n)


def test_duplicate_request_ids_and_stray_cancels(live, reliability):
    async def attack(live, value):
        rid, cancel_id = value
        port = live.endpoints["scheduler"].port
        first, second = await RawPeer.open(port), await RawPeer.open(port)
        try:
            # the same id with other content (the same content is a resubmission: it takes
            # the live request's stream over, by design). Both leave before either answer is
            # awaited, so the scheduler reads the second while the first is still live (a
            # request finishes only after node fetches and reports). Sent one after the other,
            # the first could finish first under CI load (one CI run).
            sent = (first.send_call(SubmitRequest(rid, "dup", 200, 2, deadline_s=20.0), 20.0),
                    second.send_call(SubmitRequest(rid, "dup", 201, 2, deadline_s=20.0), 20.0))
            a, b = await first.answer(sent[0]), await second.answer(sent[1])
            assert sorted(map(str, (error_code(a), error_code(b)))) == \
                sorted(map(str, (None, ErrorCode.ALREADY_EXISTS))), (a, b)   # one queued
            c = await second.answer(second.send_call(CancelRequest(cancel_id)))
            answered(c, ErrorCode.NOT_FOUND)
        finally:
            await first.close()
            await second.close()

    n = fuzz(live, st.tuples(st.text("abcdef0123", min_size=1, max_size=12).map(
        lambda s: "dup-" + s), IDS), attack)
    reliability.record("input", "scheduler: duplicate live request id; CancelRequest of "
                       "unknown ids", "ALREADY_EXISTS / NOT_FOUND", examples=n)


# --------------------------------------------------------------------------- scheduler: nodes

ENGINES = st.lists(st.builds(EngineInfo, engine_id=IDS.map(lambda s: "fz-" + s),
                             role=st.sampled_from(["prefill", "decode", "", "boss"]),
                             hbm_capacity_bytes=INTS), max_size=5) | st.just(
    [EngineInfo(f"fz-e{i}", "decode", 1) for i in range(65)])
REGISTERS = st.builds(
    RegisterNode, node_id=IDS.map(lambda s: "fz-" + s[:200]), service=IDS,
    role=st.sampled_from(["prefill", "decode", "", "sideways"]), control_host=HOSTS,
    control_port=PORTS, ucx_host=HOSTS, ucx_port=PORTS, engines=ENGINES, epoch=INTS)
NODE_CALLS = st.one_of(
    st.builds(Heartbeat, node_id=IDS, service=IDS, epoch=INTS, read_q_tokens=st.none() | INTS),
    st.builds(FetchWork, node_id=IDS | st.sampled_from(["p0", "d0"]), group_id=IDS,
              role=st.sampled_from(["prefill", "decode", "x"]), epoch=INTS,
              engines=st.lists(st.builds(EngineLoad, engine_id=IDS, seq=INTS, tok=INTS,
                                         free_hbm_bytes=st.none() | INTS), max_size=3),
              read_q_tokens=st.none() | INTS, ack_seq=st.none() | INTS),
    st.builds(ReportProgress, request_id=IDS | st.sampled_from(["good-0", "good-2"]),
              attempt=INTS, stage=st.sampled_from(["allocated", "read_done", "prefill_done",
                                                   "first_token", "second_token", "finished",
                                                   "failed", "", "exploded"]),
              tokens=INTS, code=st.text(max_size=12), message=st.text(max_size=40),
              retryable=st.booleans(), hop=st.text(max_size=12), node_id=IDS,
              output_token_ids=st.none() | st.lists(INTS, max_size=5)))


def test_node_channel_inconsistent_messages(live, reliability):
    async def attack(live, msg):
        env = await ask(live, "scheduler", msg)
        answered(env, ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND)

    n = fuzz(live, NODE_CALLS, attack)
    reliability.record("input", "scheduler node channel: Heartbeat/FetchWork from unregistered "
                       "nodes or wrong epochs, ReportProgress for unknown/finished requests, "
                       "bad stages, negative tokens", "NOT_FOUND / INVALID_ARGUMENT / "
                       "current=False; no real request disturbed", examples=n)


def test_hostile_registrations(live, reliability):
    async def attack(live, msg):
        env = await ask(live, "scheduler", msg)
        answered(env, ErrorCode.INVALID_ARGUMENT, ErrorCode.ALREADY_EXISTS)
        await _retire_fuzz_leaders(live)

    n = fuzz(live, REGISTERS, attack, submit_each=True)
    reliability.record("input", "scheduler: RegisterNode with bad ports, >max engines, duplicate "
                       "engine ids, role mismatches, absurd epochs",
                       "INVALID_ARGUMENT / ALREADY_EXISTS; valid ones retired cleanly",
                       examples=n)


async def _retire_fuzz_leaders(live: LiveCluster) -> None:
    """A fuzzed registration that was valid brought engines nobody drives: replace it (a
    higher epoch, no engines), as a restarted node would, so real requests are not placed there."""
    sched = live.c.scheduler
    for reg in list(sched.leases):
        if reg.node_id.startswith("fz-") and reg.engines and reg.epoch < 2**63 - 1:
            m = reg.msg
            env = await ask(live, "scheduler", RegisterNode(m.node_id, m.service, "", "127.0.0.1",
                                                            0, "127.0.0.1", 0, [], m.epoch + 1))
            assert error_code(env) is None, env
    # epochs that cannot grow: the lease runs out (scheduler_service.lease_s)
    await until(lambda: not any(r.node_id.startswith("fz-") and r.engines for r in sched.leases),
                10.0, "every fuzzed group leader's lease to run out", interval=0.02)


# --------------------------------------------------------------------------- gateway

BATCHES = st.lists(st.builds(ReadBatch, transfer_id=INTS, n_keys=INTS | st.integers(0, 3),
                             slots=SLOTS | st.just([(0, 64 * 1024)]) | st.just(
                                 [(2**62, 64 * 1024)]),
                             layer_major=st.booleans()), max_size=4)
GATEWAY_CALLS = st.one_of(
    st.builds(LookupPrefix, keys=KEYS | st.just([f"{i:032x}" for i in range(20_000)])),
    st.builds(ReadBlocks, request_id=IDS, keys=st.lists(HEX, max_size=3) | KEYS,
              ucx_host=HOSTS, ucx_port=PORTS, batches=BATCHES),
    st.builds(WriteBlocks, request_id=IDS, keys=st.lists(HEX, max_size=3) | KEYS
              | st.just(["0" * 32] * 3) | st.just(["1" * 32] * 20_000),
              ucx_host=HOSTS, ucx_port=PORTS),
    st.builds(WatchTelemetry, interval_s=FLOATS))


def test_gateway_inconsistent_requests(live, reliability):
    async def attack(live, msg):
        env = await ask(live, "gateway", msg, deadline_s=2.0)
        answered(env, ErrorCode.INVALID_ARGUMENT, ErrorCode.OVERLOADED, ErrorCode.PEER_FAILED,
                 ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CANCELLED,
                 ErrorCode.RESOURCE_EXHAUSTED)

    gw = live.endpoints["gateway"].service
    n = fuzz(live, GATEWAY_CALLS, attack)
    assert gw.store.stats()["blocks_stored"] >= 0 and gw.staging.pool.used_pages == 0
    reliability.record("input", "gateway: path-like/huge key lists, ReadBlocks with slots out of "
                       "bounds and mismatched batches, WriteBlocks with mismatched lengths, "
                       "NaN telemetry intervals", "typed errors; staging freed", examples=n)


# --------------------------------------------------------------------------- DE loader

LAYERS = st.lists(st.builds(LayerSlots, layer=INTS | st.integers(-1, 5), transfer_id=INTS,
                            slots=SLOTS), max_size=5)
DE_CALLS = st.one_of(
    st.builds(PrepareDecode, request_id=IDS.map(lambda s: "fz-" + s), attempt=INTS,
              session_id=IDS, de_engine=st.sampled_from(["d0.e0", "d0.e9", ""]),
              pe_node=IDS, read_side=st.sampled_from(["pe", "de", "none", "up"]),
              prompt_tokens=INTS | st.integers(1, 300), hit_tokens=INTS | st.just(64),
              gen_tokens=INTS | st.integers(1, 3), hit_keys=KEYS, new_keys=KEYS,
              ucx_host=HOSTS, ucx_port=PORTS,
              tail_token_ids=st.none() | st.lists(INTS, max_size=4),
              deadline_s=st.none() | FLOATS | st.just(1.0)),
    st.builds(PullLayers, request_id=IDS, attempt=INTS, layers=LAYERS),
    st.builds(PrefillDone, request_id=IDS, attempt=INTS, hit_tokens=INTS,
              first_token_id=st.none() | INTS),
    st.builds(AbortDecode, request_id=IDS, attempt=INTS, reason=st.text(max_size=50)))


def test_de_loader_inconsistent_requests(live, reliability):
    async def attack(live, msg):
        env = await ask(live, "de_loader", msg, deadline_s=3.0)
        answered(env, ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.ALREADY_EXISTS,
                 ErrorCode.PEER_FAILED, ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED,
                 ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.CANCELLED)
        # a PE that prepared and went away: AbortDecode frees the attempt (what a PE does)
        de = live.c.de["d0"]
        for rid, attempt in [k for k in de.attempts if k[0].startswith("fz-")]:
            await ask(live, "de_loader", AbortDecode(rid, attempt, "fuzz cleanup"))

    n = fuzz(live, DE_CALLS, attack)
    reliability.record("input", "DE loader: PrepareDecode with inconsistent sizes/keys/engines, "
                       "PullLayers with layers/slots out of range or for unknown attempts, "
                       "PrefillDone/AbortDecode of anything", "typed errors; every page freed",
                       examples=n)


def test_de_loader_prepared_attempt_with_inconsistent_follow_ups(live, reliability):
    """A real DE-path attempt (the DE reads the hit from its gateway), then PullLayers /
    PrefillDone with layers out of range, slots that do not add up, wrong hits, repeats."""
    spec = live.c.spec
    keys = [f"{i:032x}" for i in range(1, 3)]
    follow_ups = st.lists(st.one_of(
        st.builds(lambda layers: ("pull", layers), LAYERS),
        st.builds(lambda hit: ("done", hit), INTS | st.sampled_from([0, 64, 128]))),
        min_size=1, max_size=4)
    seq = iter(range(10**6))

    async def attack(live, steps):
        rid = f"fz-prep-{next(seq)}"
        prep = PrepareDecode(rid, 0, "s", "d0.e0", "p0", "de", 200, 128, 2, keys, [], "127.0.0.1",
                             DEAD_PORT, deadline_s=5.0)
        env = await ask(live, "de_loader", prep)
        assert error_code(env) is None, env
        for kind, arg in steps:
            msg = (PullLayers(rid, 0, arg) if kind == "pull" else PrefillDone(rid, 0, arg))
            env = await ask(live, "de_loader", msg, deadline_s=1.0)
            answered(env, ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND,
                     ErrorCode.ALREADY_EXISTS, ErrorCode.UNAVAILABLE, ErrorCode.PEER_FAILED,
                     ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CANCELLED)
        env = await ask(live, "de_loader", AbortDecode(rid, 0, "fuzz done"))
        answered(env)

    assert spec.num_layers >= 1
    n = fuzz(live, follow_ups, attack)
    reliability.record("input", "DE loader: prepared DE-path attempt, then PullLayers/PrefillDone "
                       "with layers out of range, mismatched slots, wrong hits, repeats",
                       "typed errors; attempt aborted; every page freed", examples=n)
