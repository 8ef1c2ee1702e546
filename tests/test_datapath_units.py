"""Data path, pure parts: KV patterns, the request model, KV regions, the engine API ports."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common.buffers import PagePool
from common.errors import DeadlineExceeded, InvalidArgument
from common.kv import PRESETS, ROOT_KEY, block_keys_from_tokens
from common.protocol import DataPathRequest, union_members
from common.rpc import check_handler_coverage
from services.engine_api.kv_region import RegionPool
from services.engine_api.prompt import make_prompt, next_block_key
from tools.engine_sim.kv_pattern import (check_tokens, fill_tokens, full_block, layer_pattern,
                                            synthetic_key, tail_key, token_id)
from tests.helpers import until

SPEC = PRESETS["test-small"]        # 4 layers x 256 B, 64-token blocks
B, BT, L = SPEC.kv_bytes_per_token_per_layer, SPEC.block_tokens, SPEC.num_layers


def keys(n: int, start: int = 0) -> list[str]:
    return block_keys_from_tokens(np.arange(start, start + n * BT), BT)


def prompt(**kw):
    base = dict(request_id="r", attempt=0, session_id="s", prompt_tokens=200, hit_tokens=128,
                gen_tokens=4, hit_keys=keys(2), new_keys=keys(3)[2:], tail_token_ids=list(range(8)),
                read_side="pe", max_prompt_tokens=10_000)
    base.update(kw)
    return make_prompt(SPEC, **base)


# ---------------------------------------------------------------- kv_pattern

def test_pattern_is_deterministic_and_sensitive():
    k1, k2 = keys(2)
    a = layer_pattern(k1, 0, BT * B)
    assert np.array_equal(a, layer_pattern(k1, 0, BT * B))
    assert not np.array_equal(a, layer_pattern(k1, 1, BT * B))
    assert not np.array_equal(a, layer_pattern(k2, 0, BT * B))
    assert not np.array_equal(a[64:], a[:-64])           # a shift by the digest size shows
    out = np.zeros(BT * B, np.uint8)
    layer_pattern(k1, 0, BT * B, out)
    assert np.array_equal(out, a)


@pytest.mark.parametrize("nbytes", [1, 63, 64, 65, 1000, BT * B])
def test_pattern_is_the_documented_digest_tiling_plus_ramp(nbytes):
    """Pinned to the rule in kv_pattern's docstring (stored blocks of earlier runs and every
    check depend on it): BLAKE2b-64 of (key, layer) tiled, plus a ramp of period 251."""
    import hashlib
    k = keys(1)[0]
    digest = hashlib.blake2b(bytes.fromhex(k) + (3).to_bytes(4, "little"), digest_size=64).digest()
    want = bytes((digest[i % 64] + i % 251) % 256 for i in range(nbytes))
    assert layer_pattern(k, 3, nbytes).tobytes() == want
    out = np.zeros(nbytes, np.uint8)
    assert layer_pattern(k, 3, nbytes, out).tobytes() == want and out.tobytes() == want


def test_fill_and_check_tokens_with_tail():
    info = prompt()
    region = np.zeros((info.prompt_tokens - 128) * B, np.uint8)
    fill_tokens(region, SPEC, info.block_keys, info.tail_key, 2, 128, 200)
    assert check_tokens(region, SPEC, info.block_keys, info.tail_key, 2, 128, 200) is None
    region[(195 - 128) * B] ^= 1                           # in the tail (192..200)
    assert check_tokens(region, SPEC, info.block_keys, info.tail_key, 2, 128, 200) == 192
    with pytest.raises(ValueError):
        fill_tokens(region, SPEC, info.block_keys, info.tail_key, 0, 100, 200)


def test_full_block_is_layer_patterns_in_order():
    k = keys(1)[0]
    fb = full_block(SPEC, k).reshape(L, BT * B)
    for layer in range(L):
        assert np.array_equal(fb[layer], layer_pattern(k, layer, BT * B))


def test_token_ids_are_deterministic():
    assert token_id("s", 5) == token_id("s", 5)
    assert len({token_id("s", i) for i in range(50)}) > 40


# ---------------------------------------------------------------- request model

def test_prompt_layout_and_keys():
    info = prompt()
    assert (info.n_full, info.tail_tokens, info.hit_blocks, info.new_tokens) == (3, 8, 2, 72)
    assert info.block_keys == tuple(keys(3)) and info.fully_keyed
    assert info.tail_key == tail_key(keys(3)[2], tuple(range(8)), 8)
    assert info.last_key() == keys(3)[2]


def test_hit_without_keys_is_shortened_and_unkeyed_blocks_are_synthetic():
    info = prompt(hit_keys=keys(1), new_keys=[], hit_tokens=128)
    assert info.hit_tokens == 64 and info.read_side == "pe" and not info.fully_keyed
    assert info.block_keys[1:] == (synthetic_key("s", 1), synthetic_key("s", 2))
    assert prompt(hit_keys=[], new_keys=[], hit_tokens=128).read_side == "none"


@pytest.mark.parametrize("bad", [
    dict(hit_tokens=100), dict(hit_tokens=200), dict(prompt_tokens=0, hit_tokens=0),
    dict(tail_token_ids=[1, 2]), dict(read_side="sideways"), dict(gen_tokens=0),
    dict(new_keys=keys(5)[2:]), dict(hit_keys=["zz"]), dict(prompt_tokens=20_000),
    dict(hit_keys=keys(1), hit_tokens=128),
])
def test_prompt_rejects_bad_plans(bad):
    with pytest.raises(InvalidArgument):
        prompt(**bad)


def test_next_block_key_follows_the_chain():
    toks = list(range(BT * 2))
    k = block_keys_from_tokens(toks, BT)
    assert next_block_key(ROOT_KEY, toks[:BT], BT) == k[0]
    assert next_block_key(k[0], toks[BT:], BT) == k[1]
    with pytest.raises(InvalidArgument):
        next_block_key(k[0], toks[:3], BT)


# ---------------------------------------------------------------- regions

async def test_region_is_layer_major_and_contiguous():
    pool = RegionPool(PagePool(4096, 64))
    r = pool.try_allocate(SPEC, 100, "a")
    assert r.contiguous and r.whole().shape == (L, 100, B)
    off0, n = r.slot(0)
    assert n == 100 * B and r.slot(1)[0] == off0 + 100 * B and r.slot(2, 10, 20) == (
        off0 + 2 * 100 * B + 10 * B, 10 * B)
    r.whole()[3, 64:100] = 7
    assert (r.layer(3, 64, 100) == 7).all()
    with pytest.raises(InvalidArgument):
        r.slot(L)
    with pytest.raises(InvalidArgument):
        r.block_dest(1)                                    # tokens 64..128 of a 100-token region
    r2 = pool.try_allocate(SPEC, 128, "b")
    assert r2.block_dest(1) == [r2.slot(layer, 64, 128) for layer in range(L)]
    assert [v.nbytes for v in r2.block_views(0)] == [BT * B] * L
    pool.free(r2)
    pool.free(r)
    pool.free(r)                                           # idempotent
    assert pool.pool.used_pages == 0 and pool.live == 0


async def test_region_falls_back_to_one_extent_per_layer_then_waits():
    pool = RegionPool(PagePool(4096, 64))
    holes = [pool.try_allocate(SPEC, 16, f"h{i}") for i in range(16)]   # 4 pages each
    for h in holes[::2]:
        pool.free(h)                                       # 8 free holes of 4 pages
    r = pool.try_allocate(SPEC, 32, "split")              # 8 pages: no 8-page run left
    assert r is not None and not r.contiguous and r.whole() is None
    r.layer(2)[:] = 5
    assert (r.flat(2) == 5).all() and not (r.flat(1) == 5).all()
    assert pool.try_allocate(SPEC, 80, "big") is None     # 5 pages per layer: no such run
    with pytest.raises(DeadlineExceeded):
        await pool.allocate(SPEC, 80, "big", 0.05)
    waiter = asyncio.ensure_future(pool.allocate(SPEC, 80, "big", 5.0))
    await until(lambda: pool._freed._waiters, what="the allocation to wait for a free")
    for h in holes[1::2]:
        pool.free(h)
    pool.free(r)
    big = await waiter
    assert big.tokens == 80 and big.contiguous
    pool.free(big)
    pool.pool.check_invariants()
    assert pool.pool.used_pages == 0


async def test_region_too_large_for_the_pool_is_invalid():
    pool = RegionPool(PagePool(4096, 8))
    with pytest.raises(InvalidArgument):
        await pool.allocate(SPEC, 1000, "x", 1.0)


# ---------------------------------------------------------------- services

def test_de_loader_serves_the_whole_data_path_channel():
    from tools.config import DualpathConfig
    from services.de_loader.service import DELoaderService

    svc = DELoaderService(DualpathConfig(), "d0", spec=SPEC, engines=1)
    handlers = svc.handlers()
    assert check_handler_coverage(handlers, DataPathRequest) == []
    assert set(handlers) == set(union_members(DataPathRequest))


def test_scheduler_remembers_generated_blocks_the_decode_side_writes_back():
    """``ReportProgress.output_token_ids`` extends the session's stored keys by exactly the
    blocks the DE loader persists: full blocks of prompt + output[:-1]."""
    from common.protocol import SubmitRequest
    from services.scheduler.shell.request_state import check_submit
    from services.scheduler.shell.lifecycle import _stored_keys
    from services.scheduler.service_config import SchedulerServiceConfig

    prompt = list(range(150))                       # 2 full blocks + 22-token tail
    sub = check_submit(SubmitRequest("r", "s", len(prompt), 60, token_ids=prompt),
                       SchedulerServiceConfig(), BT)
    assert sub.tail_token_ids == tuple(prompt[128:])
    out = list(range(1000, 1060))
    want = block_keys_from_tokens(prompt + out[:-1], BT)     # 150 + 59 = 209 → 3 blocks
    assert _stored_keys(sub, out, BT) == tuple(want) and len(want) == 3
    assert _stored_keys(sub, None, BT) == sub.keys
    keyed = check_submit(SubmitRequest("r", "s", 150, 60, block_keys=keys(2)),
                         SchedulerServiceConfig(), BT)
    assert _stored_keys(keyed, out, BT) == keyed.keys      # tail ids unknown: prompt only
