"""UCX page transport, the pure part: message planning (unit + property), tags, staging, source
maps, the transport hello and the UCX environment rules. No UCX traffic here; the real-UCX
tests are in ``tests/test_transport.py``.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import InvalidArgument, ProtocolError
from common.transport.plan import (COMMIT_INDEX, HELLO_BYTES, INDEX_BITS, MAX_MESSAGES,
                                   MAX_TRANSFER_ID, SourceMap, StagingPool, TransferHello,
                                   TransferIdSource, check_same_plan, check_transfer_id,
                                   decode_hello, encode_hello, fit_hello, make_tag,
                                   plan_messages, single_copy_link)
from common.transport.ucx_env import (apply_ucx_env, local_host_id, options_overridden_by_env,
                            single_copy_supported)
from tests.transport_peer import pattern

KIB, MIB = 1024, 1024 * 1024


# ---------------------------------------------------------------- plan_messages (pure)

def test_plan_merges_contiguous_slots_into_one_message():
    plan = plan_messages([(0, 100), (100, 50), (150, 10)], 1000, 0)
    assert [(m.stream_offset, m.nbytes, m.pieces) for m in plan] == [(0, 160, ((0, 160),))]


def test_plan_cuts_runs_at_max_message_bytes():
    plan = plan_messages([(0, 250)], 100, 0)
    assert [(m.index, m.stream_offset, m.nbytes, m.pieces[0][0]) for m in plan] == [
        (0, 0, 100, 0), (1, 100, 100, 100), (2, 200, 50, 200)]


def test_plan_packs_small_noncontiguous_runs_up_to_max():
    slots = [(i * 100, 10) for i in range(25)]  # 25 runs of 10 B, not contiguous
    plan = plan_messages(slots, 100, 50)
    assert [m.nbytes for m in plan] == [100, 100, 50]
    assert all(m.packed for m in plan)
    assert plan[0].pieces == tuple(slots[:10])
    assert plan[2].stream_offset == 200


def test_plan_keeps_large_runs_direct_between_packs():
    slots = [(0, 10), (100, 10), (1000, 500), (2000, 10)]
    plan = plan_messages(slots, 1000, 100)
    assert [(m.packed, m.nbytes) for m in plan] == [(True, 20), (False, 500), (False, 10)]
    assert [m.stream_offset for m in plan] == [0, 20, 520]


def test_plan_empty_and_zero_length_slots():
    assert plan_messages([], 100, 10) == []
    assert plan_messages([(5, 0), (7, 0)], 100, 10) == []


def test_plan_is_deterministic():
    rng = np.random.default_rng(3)
    slots = [(int(o), int(n)) for o, n in
             zip(rng.integers(0, 10**9, 500), rng.integers(1, 10**5, 500), strict=True)]
    assert plan_messages(slots, 1 << 20, 1 << 16) == plan_messages(list(slots), 1 << 20, 1 << 16)


def test_plan_rejects_bad_input():
    with pytest.raises(InvalidArgument):
        plan_messages([(-1, 10)], 100, 10)
    with pytest.raises(InvalidArgument):
        plan_messages([(0, 10)], 0, 10)


@settings(max_examples=200, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=60),
       max_bytes=st.integers(1, 700), pack_below=st.integers(0, 800))
def test_plan_properties(runs, max_bytes, pack_below):
    slots, pos = [], 0
    for gap, n in runs:  # non-overlapping slots in increasing order, some contiguous
        pos += gap
        slots.append((pos, n))
        pos += n
    plan = plan_messages(slots, max_bytes, pack_below)
    covered = [b for m in plan for off, n in m.pieces for b in range(off, off + n)]
    wanted = [b for off, n in slots for b in range(off, off + n)]
    assert covered == wanted  # every slot byte exactly once, in stream order
    assert sum(m.nbytes for m in plan) == sum(n for _, n in slots)
    stream = 0
    for i, m in enumerate(plan):
        assert m.index == i and m.stream_offset == stream and 0 < m.nbytes <= max_bytes
        assert m.nbytes == sum(n for _, n in m.pieces)
        stream += m.nbytes


def _reference_plan(slots, limit, pack_below):
    """The slot-by-slot planner the numpy one replaced (kept here, verbatim in effect): a
    node of the previous release must cut every transfer into the same messages and tags."""
    runs, start, end = [], -1, -1
    for off, n in slots:
        if n == 0:
            continue
        if off == end:
            end += n
            continue
        if end > start:
            runs.append((start, end - start))
        start, end = off, off + n
    if end > start:
        runs.append((start, end - start))
    runs = [(off + cut, min(limit, n - cut)) for off, n in runs for cut in range(0, n, limit)]
    plan, pos, i = [], 0, 0
    while i < len(runs):
        j, total = i, 0
        while j < len(runs) and runs[j][1] < pack_below and total + runs[j][1] <= limit:
            total += runs[j][1]
            j += 1
        if j == i:
            total, j = runs[i][1], i + 1
        plan.append((len(plan), pos, total, tuple(runs[i:j])))
        pos += total
        i = j
    return plan


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(-300, 300), st.integers(0, 300)), max_size=80),
       max_bytes=st.integers(1, 700), pack_below=st.integers(0, 800))
def test_plan_cuts_exactly_as_the_slot_by_slot_planner(runs, max_bytes, pack_below):
    slots, pos = [], 1000
    for jump, n in runs:   # any order, backwards jumps and contiguous neighbours included
        pos = max(0, pos + jump)
        slots.append((pos, n))
        pos += n
    got = [(m.index, m.stream_offset, m.nbytes, m.pieces)
           for m in plan_messages(slots, max_bytes, pack_below)]
    assert got == _reference_plan(slots, max_bytes, pack_below)
    assert all(type(x) is int for m in got for p in m[3] for x in p)


def test_tags_and_transfer_ids():
    ids = TransferIdSource()
    a, b = ids.next(), ids.next()
    assert a != b and 0 < a <= MAX_TRANSFER_ID and 0 < b <= MAX_TRANSFER_ID
    assert make_tag(b, 5) >> INDEX_BITS == b and make_tag(b, 5) < 1 << 64
    for bad in (0, -1, MAX_TRANSFER_ID + 1, "7"):
        with pytest.raises(InvalidArgument):
            check_transfer_id(bad)
    draws = iter([1, 1, 2])
    wrapping = TransferIdSource(randbits=lambda bits: next(draws))
    wrapping._counter = (1 << 24) - 1
    assert wrapping.next() == (2 << 24) | 1  # new epoch, different from the old one


def test_staging_pool_first_fit_and_coalescing():
    freed = []
    pool = StagingPool(16 * KIB, align=4 * KIB, on_free=lambda: freed.append(1))
    a, b, c = pool.try_alloc(1), pool.try_alloc(5000), pool.try_alloc(4096)
    assert (a, b, c) == (0, 4096, 12288) and pool.try_alloc(1) is None
    pool.free(b)
    pool.free(a)
    assert pool.try_alloc(12 * KIB) == 0 and pool.in_use == 16 * KIB and len(freed) == 2
    with pytest.raises(InvalidArgument):
        pool.try_alloc(17 * KIB)


def test_source_map_single_and_gather():
    data = pattern(1, 1000)
    views = [data[:10], data[10:10], data[10:600], data[600:]]
    src = SourceMap(views)
    assert src.nbytes == 1000
    assert np.array_equal(src.single(20, 100), data[20:120])
    assert src.single(590, 20) is None
    out = np.empty(700, np.uint8)
    src.gather_into(out, 5)
    assert np.array_equal(out, data[5:705])


def test_hello_round_trip_and_plan_check():
    hello = TransferHello(1, "node-a", "127.0.0.1", 4000, 16 * MIB, 256 * KIB)
    frame = encode_hello(hello)
    assert frame.nbytes == HELLO_BYTES and decode_hello(frame) == hello
    check_same_plan(hello, decode_hello(frame))
    with pytest.raises(ProtocolError, match="plans messages differently"):
        check_same_plan(hello, TransferHello(1, "node-b", "h", 1, 16 * MIB, 0))
    with pytest.raises(ProtocolError):
        decode_hello(np.full(HELLO_BYTES, 255, np.uint8))


def test_hello_carries_single_copy_fields_and_stays_compatible():
    old = TransferHello(1, "a", "127.0.0.1", 4000, 16 * MIB, 256 * KIB)
    new = TransferHello(1, "b", "127.0.0.1", 4001, 16 * MIB, 256 * KIB, b"\x01" * 200, "h/1/2")
    assert decode_hello(encode_hello(new)) == new
    # a peer without the trailing fields decodes ours, and we decode its hello
    legacy = np.zeros(HELLO_BYTES, np.uint8)
    body = msgspec.msgpack.encode([1, "a", "127.0.0.1", 4000, 16 * MIB, 256 * KIB])
    legacy[:2] = np.frombuffer(len(body).to_bytes(2, "little"), np.uint8)
    legacy[2:2 + len(body)] = np.frombuffer(body, np.uint8)
    assert decode_hello(legacy) == old and not single_copy_link(new, old)
    assert single_copy_link(new, msgspec.structs.replace(old, worker_address=b"x", host_id="h/1/2"))
    assert not single_copy_link(new, msgspec.structs.replace(old, worker_address=b"x", host_id="o"))
    huge = msgspec.structs.replace(new, worker_address=b"\x02" * HELLO_BYTES)
    assert fit_hello(huge).worker_address == b"" and fit_hello(new) == new
    encode_hello(fit_hello(huge))  # fits one frame
    assert COMMIT_INDEX == MAX_MESSAGES and make_tag(1, COMMIT_INDEX) >> INDEX_BITS == 1


def test_single_copy_supported_rules(tmp_path):
    yama = tmp_path / "ptrace_scope"
    yama.write_text("0\n")
    on = {"DUALPATH_UCX_SINGLE_COPY": "1"}
    ok, reason = single_copy_supported("tcp,sm,self", {}, str(yama))
    assert not ok and "off by default" in reason and "abort" in reason   # opt-in only
    assert single_copy_supported("tcp,sm,self", on, str(yama))[0]
    assert single_copy_supported(None, on, str(yama))[0]                 # UCX default: all
    assert single_copy_supported("tcp,cma", on, str(yama))[0]
    assert not single_copy_supported("tcp,self", on, str(yama))[0]
    assert not single_copy_supported("^sm", on, str(yama))[0]
    assert not single_copy_supported("tcp,sm", {**on, "UCX_TLS": "tcp"}, str(yama))[0]  # env wins
    assert not single_copy_supported("sm", {"DUALPATH_UCX_SINGLE_COPY": "0"}, str(yama))[0]
    assert not single_copy_supported("tcp,sm,cuda_copy,cuda_ipc", on, str(yama))[0]
    yama.write_text("1\n")
    ok, reason = single_copy_supported("sm", on, str(yama))
    assert not ok and "ptrace" in reason
    assert single_copy_supported("sm", on, str(tmp_path / "absent"))[0]   # no Yama
    assert local_host_id() == local_host_id() and local_host_id().count("/") == 2


def test_ucx_env_defaults_never_override_the_user():
    env = {"UCX_POSIX_ERROR_HANDLING": "n"}
    applied = apply_ucx_env(True, env)
    assert env["UCX_POSIX_ERROR_HANDLING"] == "n" and "UCX_POSIX_ERROR_HANDLING" not in applied
    assert env["UCX_SYSV_ERROR_HANDLING"] == "y" and env["UCX_WARN_UNUSED_ENV_VARS"] == "n"
    assert "UCX_SYSV_ERROR_HANDLING" not in apply_ucx_env(False, {})
    assert options_overridden_by_env({"TLS": "tcp", "IB_SL": "1"}, {"UCX_TLS": "tcp"}) == ["TLS"]
