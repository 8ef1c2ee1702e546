"""Closed-form read destinations (``storage_gateway.destinations.block_runs``, ``ArenaRuns``):
the runs match a byte-by-byte walk of the batch stream for any slot layout, are checked before
any I/O, and the store reads and verifies blocks through them on both backends. And the
requester's closed-form batch plan: the same batches as the block-by-block loop."""

from __future__ import annotations

import random

import numpy as np
import pytest

from common.errors import InvalidArgument
from common.kv import PRESETS
from storage_gateway.client import (_plan_block_by_block, _plan_closed_form, block_slots,
                                    layout_slots, plan_batches)
from storage_gateway.destinations import ArenaRuns, as_views, block_runs, normalize_destinations
from storage_gateway.store import GatewayStore
from tests.test_gateway_storage import make_cfg, rand_blocks, rand_keys

SPEC = PRESETS["test-small"]
BB, LB = SPEC.full_block_bytes, SPEC.layer_block_bytes


def reference(slots, n, layer_major) -> list[np.ndarray]:
    """Per block, the arena offset of each of its bytes, walking the stream byte by byte."""
    where = np.concatenate([np.arange(o, o + k) for o, k in slots if k])
    if not layer_major:
        return [where[i * BB:(i + 1) * BB] for i in range(n)]
    return [np.concatenate([where[(layer * n + i) * LB:(layer * n + i + 1) * LB]
                            for layer in range(SPEC.num_layers)]) for i in range(n)]


def random_slots(rng: random.Random, total: int) -> list[tuple[int, int]]:
    """Cut ``total`` stream bytes into runs of random length (some empty) at random, gapped,
    sometimes adjacent offsets."""
    slots, pos, off = [], 0, rng.randrange(64)
    while pos < total:
        k = min(total - pos, rng.choice([0, 1, 7, 100, LB - 1, LB, LB + 3, BB, 3 * LB]))
        slots.append((off, k))
        pos += k
        off += k + rng.choice([0, 0, 1, 4096])
    return slots


@pytest.mark.parametrize("layer_major", [False, True])
def test_block_runs_match_a_byte_walk_of_the_stream(layer_major):
    rng = random.Random(5)
    for _ in range(60):
        n = rng.randint(1, 6)
        slots = random_slots(rng, n * BB)
        arena = memoryview(bytearray(max(o + k for o, k in slots)))
        runs = block_runs(arena, slots, n, SPEC, layer_major)
        assert len(runs) == n
        for i, r in enumerate(runs):
            got = np.concatenate([np.arange(o, o + k) for o, k in zip(r.offsets, r.lengths)])
            assert np.array_equal(got, reference(slots, n, layer_major)[i])
            assert all(k > 0 for k in r.lengths)
            ends = [o + k for o, k in zip(r.offsets, r.lengths)]
            assert all(e != o for e, o in zip(ends, r.offsets[1:]))     # adjacent runs merged


def test_one_slot_per_block_gives_one_run_per_block():
    arena = memoryview(bytearray(10 * BB))
    runs = block_runs(arena, [(BB, 8 * BB)], 8, SPEC, layer_major=False)
    assert [(r.offsets, r.lengths) for r in runs] == [([(i + 1) * BB], [BB]) for i in range(8)]


def test_arena_runs_are_checked_before_any_io():
    arena = memoryview(bytearray(2 * BB))
    ok = ArenaRuns(arena, [0], [BB])
    assert normalize_destinations([ok], 1, BB) == [ok]
    bad = {"runs hold": ArenaRuns(arena, [0], [BB - 1]),
           "outside": ArenaRuns(arena, [BB + 1], [BB]),
           "outside the": ArenaRuns(arena, [-1, 0], [1, BB - 1]),
           "writable": ArenaRuns(memoryview(bytes(2 * BB)), [0], [BB])}
    for error, runs in bad.items():
        with pytest.raises(InvalidArgument, match=error):
            normalize_destinations([runs], 1, BB)


def test_views_and_fill_zero_cover_exactly_the_runs():
    buf = bytearray(b"\x07" * 100)
    runs = ArenaRuns(memoryview(buf), [3, 50], [10, 5])
    assert [len(v) for v in as_views(runs)] == [10, 5]
    runs.fill_zero()
    assert buf == b"\x07" * 3 + bytes(10) + b"\x07" * 37 + bytes(5) + b"\x07" * 45
    views = [memoryview(bytearray(4))]
    assert as_views(views) is views


@pytest.mark.parametrize("backend", ["fs", "memory"])
@pytest.mark.parametrize("layer_major", [False, True])
async def test_store_reads_and_verifies_into_arena_runs(tmp_path, backend, layer_major):
    n = 5
    keys, blocks = rand_keys(n), rand_blocks(n)
    slots = random_slots(random.Random(9), n * BB)
    arena = np.zeros(max(o + k for o, k in slots), np.uint8)
    async with GatewayStore(make_cfg(tmp_path, backend), SPEC) as store:
        await store.write_blocks(keys[:4], blocks[:4])
        res = await store.read_blocks(keys, block_runs(memoryview(arena), slots, n, SPEC,
                                                       layer_major))
    assert res.found == [True] * 4 + [False]
    for i, where in enumerate(reference(slots, n, layer_major)[:4]):
        assert np.array_equal(arena[where], blocks[i])
    assert not arena[reference(slots, n, layer_major)[4]].any()   # missing: left untouched


# ---------------------------------------------------------------- requester batch planning

def random_dest(rng: random.Random, n: int) -> list[list[tuple[int, int]]]:
    """``n`` destinations of one Full Block each, cut at random, placed anywhere (some
    adjacent to the previous block, some not)."""
    out, base = [], 0
    for _ in range(n):
        slots = random_slots(rng, BB)
        shift = base + rng.choice([0, 0, 1, 8192]) - slots[0][0]
        out.append([(o + shift, k) for o, k in slots])
        base = max(o + k for o, k in out[-1])
    return out


@pytest.mark.parametrize("layer_major", [False, True])
def test_closed_form_batch_plan_equals_the_block_by_block_plan(layer_major):
    rng = random.Random(11)
    for _ in range(80):
        dest = random_dest(rng, rng.randint(1, 9)) if rng.random() < 0.7 else \
            layout_slots(SPEC, rng.choice([0, 4096]), 12 * SPEC.block_tokens, rng.randint(1, 9))
        per = rng.randint(1, 4)
        max_slots = rng.choice([None, 4, 16, 64, 10_000])
        loop = None
        try:
            loop = _plan_block_by_block(SPEC, dest, per, layer_major, max_slots, True)
        except InvalidArgument:
            pass
        closed = _plan_closed_form(SPEC, dest, per, layer_major, max_slots)
        if closed is not None:                     # the loop runs only where this gave up
            assert closed == loop
        if loop is not None:
            assert plan_batches(SPEC, dest, per * BB, layer_major, max_slots=max_slots,
                                coalesce=True) == loop


def test_closed_form_batch_plan_gives_up_on_malformed_destinations():
    for dest in ([[(0, BB - 1)]], [[(-5, BB)]], [[]], [[(0, BB)], [(BB, BB + 1)]]):
        assert _plan_closed_form(SPEC, dest, 2, False, None) is None
        with pytest.raises(InvalidArgument, match="exactly one Full Block"):
            plan_batches(SPEC, dest, 2 * BB, coalesce=True)


def test_contiguous_blocks_plan_as_one_slot_per_batch():
    plan = plan_batches(SPEC, block_slots(4096, BB, 10), 4 * BB, coalesce=True, max_slots=1)
    assert plan == [(4, [(4096, 4 * BB)]), (4, [(4096 + 4 * BB, 4 * BB)]),
                    (2, [(4096 + 8 * BB, 2 * BB)])]
