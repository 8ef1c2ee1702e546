"""Every client respects the limits its gateway states (issue #16): reads and writes far above
``gateway_service.max_batch_bytes`` are split into batches and calls under them.

The issue: hits of 4,352–6,848 tokens failed with "batch 0: 4390912 B above
gateway_service.max_batch_bytes (4194304 B)" because node services read with their own
``read_batch_bytes`` (8 MiB). Here the node services keep that default while the gateway
allows far less; hits and write-backs are >= 10x the limit, for the test spec and for
DeepSeek-V3.2 (one Full Block = 2.44 MiB, so a 4 MiB limit means one block per batch). Bytes
are checked end to end (the engine emulator verifies KV; the write-back is read back), and
the gateway's counters show it was asked in many batches and never refused one.
"""

from __future__ import annotations

import numpy as np
import pytest

from common import faults
from common.config import TransportConfig
from common.kv import PRESETS, KVSpec, block_keys_from_tokens
from common.shm import ShmSegment
from common.protocol import Endpoint, GatewayLimits, ReadBlocksReply, RequestPlan
from common.transport import PageTransport
from storage_gateway.client import (GatewayClient, block_slots, combine_reads, layout_slots,
                                    plan_batches, read_calls, write_call_blocks)
from storage_gateway.config import GatewayConfig, GatewayNodeConfig, GatewayServiceConfig
from storage_gateway.service import GatewayService
from tools.cluster.inprocess import local_datapath
from tools.engine_sim.kv_pattern import full_block
from tests.helpers import until

MiB = 1 << 20
SMALL = PRESETS["test-small"]              # 64 KiB Full Blocks
DSV32 = PRESETS["deepseek-v3.2"]           # 61 layers x 656 B x 64 tokens: 2.44 MiB
# (preset, gateway max_batch_bytes, node buffer bytes): hits of >= 10x the limit fit the buffers
SPECS = {"test-small": (SMALL, 4 * SMALL.full_block_bytes, 16 * MiB),
         "deepseek-v3.2": (DSV32, 4 * MiB, 64 * MiB)}


def tenfold(spec: KVSpec, max_batch: int) -> int:
    """Blocks of at least 10x ``max_batch`` bytes."""
    return -(-10 * max_batch // spec.full_block_bytes)


def overrides(preset: str, shm: bool = True) -> dict:
    spec, max_batch, buf = SPECS[preset]
    return {"kv": {"preset": preset}, "scheduler": {"model": preset},
            "gateway": {"shm": shm},
            "gateway_service": {"staging_bytes": 16 * MiB, "max_batch_bytes": max_batch},
            "pe_receiver": {"buffer_bytes": buf}, "de_loader": {"buffer_bytes": buf}}


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


def plan(c, rid: str, toks: list[int], hit_blocks: int, read_side: str) -> RequestPlan:
    bt = c.spec.block_tokens
    keys = block_keys_from_tokens(toks, bt)
    de = c.de["d0"]
    read_node = {"pe": "p0", "de": "d0"}.get(read_side, "")
    return RequestPlan(rid, 0, "sess", "p0.e0", "p0", "d0.e0", "d0", read_side, read_node,
                       hit_blocks * bt, len(toks) - hit_blocks * bt, 3, 1 << 20,
                       keys[:hit_blocks], keys[hit_blocks:],
                       Endpoint(de.node_id, de.name, "127.0.0.1", de.rpc_port, *de.ucx_address),
                       None, 60.0, toks[len(toks) // bt * bt:])


def finished(svc, rid: str) -> bool:
    return any(r.request_id == rid and r.stage == "finished" for r in svc.reports)


def failed(c, rid: str) -> list:
    return [r for svc in (*c.pe.values(), *c.de.values()) for r in svc.reports
            if r.request_id == rid and r.stage == "failed"]


async def run_plan(c, p: RequestPlan) -> None:
    c.pe["p0"].submit_plan(p)
    await until(lambda: finished(c.de["d0"], p.request_id) or failed(c, p.request_id),
                timeout=120, what=f"{p.request_id} finished")
    assert not failed(c, p.request_id), failed(c, p.request_id)


# ---------------------------------------------------------------- pure splitting

def test_plan_batches_obeys_a_slot_limit_and_shrinks_where_slots_are_fragmented():
    bb, lb = SMALL.full_block_bytes, SMALL.layer_block_bytes
    tokens_ = 9 * SMALL.block_tokens                 # a region with room for one more block
    dest = layout_slots(SMALL, 0, tokens_, 8)        # 4 slots per block (one per layer)
    plain = plan_batches(SMALL, dest, 8 * bb, max_slots=10)
    assert [n for n, _ in plain] == [2, 2, 2, 2] and all(len(s) <= 10 for _, s in plain)
    # layer-major and coalesced: a [L, tokens, B] region needs one slot per layer per batch
    merged = plan_batches(SMALL, dest, 8 * bb, layer_major=True, coalesce=True, max_slots=4)
    assert merged == [(8, [(layer * tokens_ * SMALL.kv_bytes_per_token_per_layer, 8 * lb)
                           for layer in range(SMALL.num_layers)])]
    # fragmented: block 2 comes in 12 pieces, so it travels alone
    frag = list(dest)
    frag[2] = [(off + i * (lb // 3), lb // 3 + (lb % 3 if i == 2 else 0))
               for off, _ in dest[2] for i in range(3)]
    shrunk = plan_batches(SMALL, frag, 8 * bb, max_slots=12)
    assert [n for n, _ in shrunk] == [2, 1, 3, 2]
    assert all(len(s) <= 12 for _, s in shrunk)
    assert sum(n for _, n in [p for _, s in shrunk for p in s]) == 8 * bb
    with pytest.raises(Exception, match="one Full Block in 12 slots"):
        plan_batches(SMALL, frag, 8 * bb, max_slots=8)


def test_coalesced_batches_carry_the_same_bytes_to_the_same_places():
    dest = layout_slots(SMALL, 4096, 9 * SMALL.block_tokens, 7, first_block=1)
    for lm in (False, True):
        for (n, s), (m, t) in zip(plan_batches(SMALL, dest, 3 * SMALL.full_block_bytes, lm),
                                  plan_batches(SMALL, dest, 3 * SMALL.full_block_bytes, lm,
                                               coalesce=True)):
            assert n == m and len(t) <= len(s)
            assert np.array_equal(np.concatenate([np.arange(o, o + k) for o, k in s]),
                                  np.concatenate([np.arange(o, o + k) for o, k in t]))


def limits(**kw) -> GatewayLimits:
    base = {"block_bytes": SMALL.full_block_bytes, "max_batch_bytes": 4 * SMALL.full_block_bytes,
            "max_slots_per_batch": 64, "max_keys_per_request": 16384,
            "max_bytes_per_request": 1 << 34, "max_frame_bytes": 4 * MiB}
    return GatewayLimits(**{**base, **kw})


def test_read_calls_stay_under_keys_bytes_and_frame_per_request():
    bb = SMALL.full_block_bytes
    plan = plan_batches(SMALL, block_slots(0, bb, 40), 4 * bb)
    assert [len(c) for c in read_calls(plan, limits(), 100)] == [10]
    by_keys = read_calls(plan, limits(max_keys_per_request=9), 100)
    assert [sum(n for n, _ in c) for c in by_keys] == [8] * 5
    by_bytes = read_calls(plan, limits(max_bytes_per_request=12 * bb), 100)
    assert [sum(n for n, _ in c) for c in by_bytes] == [12, 12, 12, 4]
    by_frame = read_calls(plan, limits(max_frame_bytes=1024), 100)
    assert len(by_frame) == 40 // 4 and all(len(c) == 1 for c in by_frame)


def test_write_calls_count_every_block_as_new():
    bb = SMALL.full_block_bytes
    assert write_call_blocks(limits(), 40) == 4
    assert write_call_blocks(limits(max_bytes_per_request=2 * bb), 40) == 2
    assert write_call_blocks(limits(max_keys_per_request=3), 40) == 3
    assert write_call_blocks(limits(max_frame_bytes=512 + 40 + 34 * 2), 40) == 2
    assert write_call_blocks(limits(max_batch_bytes=bb), 40) == 1


def test_replies_of_several_calls_combine_in_key_order():
    a = ReadBlocksReply("r", [True, True], 2, 0, 2, 0.1, 0.2, 5)
    b = ReadBlocksReply("r", [True, False, True], 1, 1, 2, 0.1, 0.2, 3)
    got = combine_reads("r", [a, b])
    assert got.found == [True, True, True, False, True] and got.prefix_blocks == 3
    assert (got.corrupt, got.nbytes, got.read_q_tokens) == (1, 4, 3)
    assert combine_reads("r", [a]) is a


# ---------------------------------------------------------------- one gateway, one client

@pytest.mark.parametrize("shm", [False, True])
async def test_client_splits_reads_and_writes_under_every_stated_limit(tmp_path, shm):
    """A gateway with tight limits of every kind: a 48-block write and read in one call each
    reach it as many requests and batches, none refused, bytes intact."""
    bb, n = SMALL.full_block_bytes, 48
    cfg = GatewayNodeConfig(
        gateway=GatewayConfig(root=str(tmp_path / "store"), io_threads=2, shm=shm,
                              max_keys_per_request=20, max_bytes_per_request=16 * bb),
        transport=TransportConfig(staging_bytes=16 * MiB),
        gateway_service=GatewayServiceConfig(staging_bytes=8 * MiB, max_batch_bytes=3 * bb,
                                             max_slots_per_batch=6))
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, bb, dtype=np.uint8) for _ in range(n)]
    keys = block_keys_from_tokens(np.arange(n * SMALL.block_tokens), SMALL.block_tokens)
    seg = ShmSegment.create(n * bb + MiB) if shm else None
    arena = seg.array if seg is not None else np.zeros(n * bb + MiB, np.uint8)
    try:
        async with GatewayService(cfg, "gw0", spec=SMALL) as gw, \
                PageTransport(cfg.transport, "req") as tr:
            async with GatewayClient.connect(cfg.rpc, "127.0.0.1", gw.rpc_port, tr, arena, SMALL,
                                             node_id="req", shm=shm) as client:
                done = await client.write_blocks("w", keys, data, 30.0)
                assert (done.written, done.duplicates, done.nbytes) == (n, 0, n * bb)
                again = await client.write_blocks("w2", keys[:7], data[:7], 30.0)
                assert (again.written, again.duplicates) == (0, 7)
                dest = layout_slots(SMALL, 0, n * SMALL.block_tokens, n)   # 4 slots a block
                reply = await client.read_blocks("r", keys, dest, 30.0, batch_bytes=64 * MiB)
                assert reply.prefix_blocks == n and all(reply.found) and reply.nbytes == n * bb
                got = arena[:n * bb].reshape(SMALL.num_layers, n, -1)
                want = np.stack(data).reshape(n, SMALL.num_layers, -1).transpose(1, 0, 2)
                assert np.array_equal(got, want)
                assert await client.limits() is await client.limits()      # asked once
            stats = gw.counters()
        assert stats["writes_ok"] >= n // 3 and stats["writes_failed"] == 0
        assert stats["reads_ok"] >= n / 16 and stats["reads_failed"] == 0
        batches = stats["shm_batches"] if shm else stats["read_batches"]
        assert batches >= n // 3
    finally:
        if seg is not None:
            seg.close()                       # unlinks it too


# ---------------------------------------------------------------- the data path, end to end

@pytest.mark.parametrize("path", ["shm", "ucx"])
@pytest.mark.parametrize("side", ["pe", "de"])
@pytest.mark.parametrize("preset", list(SPECS))
async def test_hits_of_ten_times_max_batch_bytes_load_on_both_paths(tmp_path, preset, side,
                                                                   path):
    spec, max_batch, _ = SPECS[preset]
    async with local_datapath(tmp_path, scheduler=False,
                              overrides=overrides(preset, shm=path == "shm")) as c:
        hit = tenfold(spec, max_batch)
        toks = tokens(hit * spec.block_tokens + 10, 7)
        keys = block_keys_from_tokens(toks, spec.block_tokens)
        await c.store_blocks(keys[:hit])
        assert c.pe["p0"].settings.read_batch_bytes > max_batch      # the client must shrink
        await run_plan(c, plan(c, "big", toks, hit, side))
        counters = c.engine_counters()
        assert counters["verified_requests"] == 1 and counters.get("prompt_mismatches", 0) == 0
        assert counters["verified_layers"] > 0 and counters.get("hit_mismatches", 0) == 0
        reader = c.de["d0"] if side == "de" else c.pe["p0"]
        assert reader.counters.get("hit_shortened", 0) == 0
        stats = c.gateways["d0" if side == "de" else "p0"].counters()
        assert stats["reads_failed"] == 0 and stats["reads_ok"] >= 1
        batches = stats["shm_batches"] if path == "shm" else stats["read_batches"]
        assert batches >= 10 * max_batch // (max_batch // spec.full_block_bytes
                                             * spec.full_block_bytes)


@pytest.mark.parametrize("preset", list(SPECS))
async def test_write_back_of_ten_times_max_batch_bytes_is_stored_whole(tmp_path, preset):
    spec, max_batch, _ = SPECS[preset]
    async with local_datapath(tmp_path, scheduler=False,
                              overrides={**overrides(preset),
                                         "de_loader": {"buffer_bytes": SPECS[preset][2],
                                                       "writeback_batch_blocks": 1000}}) as c:
        n = tenfold(spec, max_batch)
        toks = tokens(n * spec.block_tokens + 10, 11)
        keys = block_keys_from_tokens(toks, spec.block_tokens)
        await run_plan(c, plan(c, "wb", toks, 0, "none"))
        await until(lambda: _stored(c, keys, n), timeout=60, what="all blocks written back")
        counters = c.engine_counters()
        assert counters["verified_requests"] == 1 and counters.get("prompt_mismatches", 0) == 0
        gw = c.gateways["d0"]
        for k in keys[:n]:                                   # byte for byte what was computed
            out = np.zeros(spec.full_block_bytes, np.uint8)
            assert (await gw.store.read_blocks([k], [out])).found == [True]
            assert np.array_equal(out, full_block(spec, k))
        stats = gw.counters()
        assert stats["writes_failed"] == 0 and stats["writes_ok"] >= 10
        assert c.de["d0"].counters.get("writeback_failed", 0) == 0


async def _stored(c, keys: list[str], n: int) -> bool:
    return await c.stored_prefix(keys) >= n


async def test_a_write_back_that_fails_retryably_is_tried_again_and_stored(tmp_path):
    """ci103: a gateway's UCX connect back to the DE loader timed out on the loaded host and
    the turn's write-back was lost (``writeback_failed``); a retryable failure is now tried
    again while the write-back's budget lasts."""
    spec = PRESETS["test-small"]
    faults.arm("de.writeback=error@1")                # the first write-back call fails
    try:
        async with local_datapath(tmp_path, scheduler=False) as c:
            toks = tokens(3 * spec.block_tokens + 10, 12)
            keys = block_keys_from_tokens(toks, spec.block_tokens)
            await run_plan(c, plan(c, "wb-retry", toks, 0, "none"))
            await until(lambda: _stored(c, keys, 3), what="the write-back stored after a retry")
            assert faults.fired("de.writeback") == 1
            assert c.de["d0"].counters["writeback_retries"] == 1
            assert c.de["d0"].counters.get("writeback_failed", 0) == 0
    finally:
        faults.arm("")
