"""Storage core of the gateway: fs/memory backends, index, eviction, bad input — driven
in-process, no network. Its helpers are shared with ``test_gateway_store_durability.py``
(restart, kill -9, corruption, disk full) and ``test_gateway_flow_control.py`` (read queue,
link shaping)."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from common.buffers import PagePool
from common.config import build_config
from common.errors import ConfigError, InvalidArgument, ResourceExhausted, Unavailable
from common.kv import PRESETS, block_keys_from_tokens, full_block_view, request_kv_view
from storage_gateway import backend_fs
from storage_gateway.backends import run_io
from storage_gateway.block_format import HEADER_SIZE, QUARANTINE_DIR
from storage_gateway.block_index import BlockIndex, measure_bytes_per_block
from storage_gateway.config import GatewayConfig
from storage_gateway.destinations import allocation_scatter_views, scatter_views
from storage_gateway.store import GatewayStore
from tests.helpers import until

SPEC = PRESETS["test-small"]          # 4 layers x 64 tokens x 256 B = 64 KiB Full Blocks
BB = SPEC.full_block_bytes
T = SPEC.block_tokens


def make_cfg(tmp_path, backend="fs", **kw) -> GatewayConfig:
    return GatewayConfig(backend=backend, root=str(tmp_path / "store"), io_threads=2, **kw)


def rand_keys(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.randbytes(16).hex() for _ in range(n)]


def rand_blocks(n: int, seed: int = 0, nbytes: int = BB) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def empty_dests(n: int) -> list[np.ndarray]:
    return [np.zeros(BB, np.uint8) for _ in range(n)]


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.rglob(pattern) if QUARANTINE_DIR not in p.parts)


def gate_reads(store: GatewayStore):
    """Hold every backend read until ``gate`` is set; ``started`` lists the batches in order."""
    gate, started, orig = asyncio.Event(), [], store.backend.read

    async def read(keys, dests):
        started.append(list(keys))
        await gate.wait()
        return await orig(keys, dests)

    store.backend.read = read
    return gate, started


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("backend", ["fs", "memory"])
async def test_write_read_roundtrip_byte_exact(tmp_path, backend):
    keys, blocks = rand_keys(5), rand_blocks(5)
    async with GatewayStore(make_cfg(tmp_path, backend), SPEC) as store:
        assert await store.write_blocks(keys, blocks) == [True] * 5
        out = empty_dests(6)
        res = await store.read_blocks(keys + [rand_keys(1, seed=9)[0]], out)
        assert res.found == [True] * 5 + [False] and res.prefix_read == 5
        for got, want in zip(out, blocks):
            assert np.array_equal(got, want)
        s = store.stats()
        assert (s["blocks_written"], s["blocks_read"], s["hits"], s["misses"]) == (5, 5, 5, 1)
        assert s["bytes_read"] == s["bytes_written"] == 5 * BB and s["read_q"] == 0
        assert {"checksum_failures", "evictions", "quarantined", "temp_files_cleaned",
                "blocks_stored", "link_bytes_charged"} <= set(s)


@pytest.mark.parametrize("backend", ["fs", "memory"])
async def test_scatter_read_into_per_layer_destinations(tmp_path, backend):
    n = 3
    tokens = n * T + 17                                  # a partial tail the store never fills
    keys, blocks = rand_keys(n), rand_blocks(n)
    region = request_kv_view(np.zeros(SPEC.bytes_per_token * tokens, np.uint8), SPEC, tokens)
    async with GatewayStore(make_cfg(tmp_path, backend), SPEC) as store:
        await store.write_blocks(keys, blocks)
        res = await store.read_blocks(keys, scatter_views(region, SPEC, n))
        assert all(res.found)
    for i, block in enumerate(blocks):
        full = full_block_view(block, SPEC)
        for layer in range(SPEC.num_layers):
            assert np.array_equal(region[layer, i * T:(i + 1) * T], full[layer])
    assert not region[:, n * T:].any()


async def test_scatter_read_into_split_pool_allocation(tmp_path):
    pool = PagePool(page_bytes=16 * 1024, num_pages=32)
    a1, _a2, a3, _a4 = (pool.alloc(k * 16 * 1024, "x") for k in (8, 1, 8, 15))
    pool.free(a1)
    pool.free(a3)
    n, tokens = 3, 3 * T
    alloc = pool.alloc(SPEC.bytes_per_token * tokens, "req")
    assert not alloc.contiguous
    keys, blocks = rand_keys(n), rand_blocks(n)
    async with GatewayStore(make_cfg(tmp_path), SPEC) as store:
        await store.write_blocks(keys, blocks)
        res = await store.read_blocks(keys, allocation_scatter_views(alloc, SPEC, tokens, n))
        assert all(res.found)
    region = request_kv_view(np.concatenate(alloc.views()), SPEC, tokens)
    for i, block in enumerate(blocks):
        assert np.array_equal(region[:, i * T:(i + 1) * T], full_block_view(block, SPEC))


async def test_prefix_lookup_on_chained_keys(tmp_path):
    toks = np.arange(6 * T) % 1000
    keys = block_keys_from_tokens(toks, T)
    other = block_keys_from_tokens(np.concatenate([toks[:3 * T], toks[3 * T:] + 1]), T)
    assert other[:3] == keys[:3] and other[3] != keys[3]
    async with GatewayStore(make_cfg(tmp_path), SPEC) as store:
        blocks = rand_blocks(6)
        await store.write_blocks(keys[:3] + [keys[4]], blocks[:4])
        assert await store.lookup_prefix(keys) == 3          # block 3 missing: the chain stops
        assert await store.lookup_prefix(other) == 3
        assert await store.lookup_prefix([]) == 0
        await store.write_block(keys[3], blocks[5])
        assert await store.lookup_prefix(keys) == 5


async def test_probe_on_miss_sees_blocks_written_by_another_node(tmp_path):
    keys, blocks = rand_keys(3), rand_blocks(3)
    async with GatewayStore(make_cfg(tmp_path), SPEC) as a, \
            GatewayStore(make_cfg(tmp_path, probe_on_miss=True), SPEC) as b, \
            GatewayStore(make_cfg(tmp_path), SPEC) as c:
        await a.write_blocks(keys, blocks)
        assert await c.lookup_prefix(keys) == 0               # own index only
        assert await b.lookup_prefix(keys) == 3
        out = empty_dests(3)
        assert all((await c.read_blocks(keys, out)).found) is False
        assert all((await b.read_blocks(keys, out)).found)
        assert np.array_equal(out[2], blocks[2])


async def test_a_probing_lookup_never_waits_behind_the_bulk_io_threads(tmp_path):
    """The scheduler's hit lookup has a 1 s budget: with every I/O thread of the gateway held
    (bulk reads of large hits), a lookup that probes the shared root still answers at once."""
    keys, blocks = rand_keys(3), rand_blocks(3)
    async with GatewayStore(make_cfg(tmp_path), SPEC) as a, \
            GatewayStore(make_cfg(tmp_path, probe_on_miss=True), SPEC) as b:
        await a.write_blocks(keys, blocks)
        release = threading.Event()
        held = [asyncio.get_running_loop().run_in_executor(b._executor, release.wait, 30.0)
                for _ in range(b.cfg.io_threads)]
        try:
            assert await asyncio.wait_for(b.lookup_prefix(keys), 5.0) == 3
        finally:
            release.set()
            await asyncio.gather(*held)


# ----------------------------------------------------------------------------- eviction

async def test_eviction_is_lru_by_access_and_deletes_files(tmp_path):
    cfg = make_cfg(tmp_path, capacity_bytes=3 * (HEADER_SIZE + BB))
    a, b, c, d = keys = rand_keys(4)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks([a, b, c], rand_blocks(3))
        await store.read_blocks([a], empty_dests(1))             # a is now more recent than b
        assert not await store.write_block(c, rand_blocks(1)[0])  # duplicate write counts as access
        await store.write_block(d, rand_blocks(1)[0])
        assert list(store.index.keys_lru()) == [a, c, d]
        assert not os.path.exists(store.backend.path_for(b))
        s = store.stats()
        assert s["evictions"] == 1 and s["bytes_stored"] <= cfg.capacity_bytes
        assert len(files(tmp_path / "store", "*.kvb")) == 3
        assert await store.lookup_prefix(keys) == 1


async def test_pinned_block_survives_eviction_pressure(tmp_path):
    cfg = make_cfg(tmp_path, "memory", capacity_bytes=3 * BB)
    keys = rand_keys(7)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks(keys[:3], rand_blocks(3))
        gate, started = gate_reads(store)
        reader = asyncio.create_task(store.read_blocks([keys[0]], empty_dests(1)))
        await until(lambda: started)
        assert store.index.pin_count(keys[0]) == 1
        for k in keys[3:6]:                                        # pushes keys[0] to the LRU end
            await store.write_block(k, rand_blocks(1)[0])
        assert list(store.index.keys_lru()) == [keys[0], keys[4], keys[5]]
        gate.set()
        assert (await reader).found == [True]
        assert store.stats()["pinned_blocks"] == 0
        await store.write_block(keys[6], rand_blocks(1)[0])       # unpinned: now it is the victim
        assert not store.contains(keys[0])


async def test_write_fails_retryably_when_only_pinned_blocks_could_make_room(tmp_path):
    cfg = make_cfg(tmp_path, capacity_bytes=HEADER_SIZE + BB)
    x, y = rand_keys(2)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_block(x, rand_blocks(1)[0])
        gate, started = gate_reads(store)
        reader = asyncio.create_task(store.read_blocks([x], empty_dests(1)))
        await until(lambda: started)
        with pytest.raises(ResourceExhausted) as e:
            await store.write_block(y, rand_blocks(1)[0])
        assert e.value.retryable and store.index.reserved_bytes == 0
        gate.set()
        assert (await reader).found == [True]
        assert await store.write_block(y, rand_blocks(1)[0])
        assert not store.contains(x) and store.stats()["evictions"] == 1


def test_index_sans_io_lru_pins_reserve():
    idx = BlockIndex(block_bytes=10, capacity_bytes=30)
    a, b, c, d = rand_keys(4)
    for k in (a, b, c):
        assert idx.reserve() == []
        idx.add(k, reserved=True)
    idx.touch(a)
    idx.pin(b)
    assert idx.reserve() == [c] and c not in idx            # b pinned, a recent → c goes
    idx.add(d, reserved=True)
    assert idx.lookup_prefix([b, a, c]) == 2
    idx.pin(a), idx.pin(d)
    with pytest.raises(ResourceExhausted):
        idx.reserve()
    idx.unpin(b)
    assert idx.reserve() == [b]
    with pytest.raises(InvalidArgument):
        idx.unpin(b)
    with pytest.raises(InvalidArgument):
        BlockIndex(block_bytes=10, capacity_bytes=5)


def test_index_memory_per_block_is_small():
    per_block = measure_bytes_per_block(20_000)
    assert per_block < 300, per_block


# ----------------------------------------------------------------------------- bad input

BAD_KEYS = ["../x", "0" * 31, "0" * 33, "A" * 32, "g" * 32, "../" + "0" * 29, "0" * 31 + "\x00",
            "/" + "0" * 31, "0" * 15 + "/" + "0" * 16, "", b"0" * 32, 12, None]


async def test_invalid_keys_touch_no_file(tmp_path):
    good, block = rand_keys(1)[0], rand_blocks(1)[0]
    async with GatewayStore(make_cfg(tmp_path), SPEC) as store:
        await store.write_block(good, block)
        before = tree(tmp_path)
        for bad in BAD_KEYS:
            with pytest.raises(InvalidArgument):
                await store.write_block(bad, block)
            with pytest.raises(InvalidArgument):
                await store.write_blocks([rand_keys(1, seed=5)[0], bad], [block, block])
            with pytest.raises(InvalidArgument):
                await store.read_blocks([good, bad], empty_dests(2))
            with pytest.raises(InvalidArgument):
                await store.delete(bad)
            with pytest.raises(InvalidArgument):
                await store.lookup_prefix([good, bad])
            with pytest.raises(InvalidArgument):
                store.contains(bad)
        assert tree(tmp_path) == before
        s = store.stats()
        assert s["blocks_written"] == 1 and s["read_requests"] == 0


async def test_limits_and_buffer_sizes_are_checked_before_io(tmp_path):
    cfg = make_cfg(tmp_path, "memory", max_keys_per_request=4, max_bytes_per_request=3 * BB)
    keys, blocks = rand_keys(5), rand_blocks(5)
    async with GatewayStore(cfg, SPEC) as store:
        with pytest.raises(InvalidArgument, match="too many block keys"):
            await store.read_blocks(keys, empty_dests(5))
        with pytest.raises(InvalidArgument, match="max_bytes_per_request"):
            await store.read_blocks(keys[:4], empty_dests(4))
        with pytest.raises(InvalidArgument, match="max_bytes_per_request"):
            await store.write_blocks(keys[:4], blocks[:4])
        with pytest.raises(InvalidArgument, match="too many"):
            await store.lookup_prefix(keys)
        with pytest.raises(InvalidArgument, match="Full Block"):
            await store.write_block(keys[0], blocks[0][:-1])
        with pytest.raises(InvalidArgument, match="Full Block"):
            await store.read_blocks(keys[:1], [np.zeros(BB - 1, np.uint8)])
        with pytest.raises(InvalidArgument, match="one destination per key"):
            await store.read_blocks(keys[:2], empty_dests(1))
        with pytest.raises(InvalidArgument, match="read-only"):
            await store.read_blocks(keys[:1], [bytes(BB)])
        with pytest.raises(InvalidArgument, match="contiguous"):
            await store.read_blocks(keys[:1], [np.zeros(2 * BB, np.uint8)[::2]])
        assert store.stats()["blocks_written"] == 0 and store.read_q == 0


@pytest.mark.parametrize("backend", ["fs", "memory"])
async def test_duplicate_write_is_a_noop(tmp_path, backend):
    key, (b1, b2) = rand_keys(1)[0], rand_blocks(2)
    async with GatewayStore(make_cfg(tmp_path, backend), SPEC) as store:
        results = await asyncio.gather(*(store.write_block(key, b1) for _ in range(3)))
        assert sorted(results) == [False, False, True]
        snap = tree(tmp_path)
        assert await store.write_block(key, b2) is False
        assert tree(tmp_path) == snap                              # no rewrite, same inode
        out = empty_dests(1)
        await store.read_blocks([key], out)
        assert np.array_equal(out[0], b1)
        s = store.stats()
        assert s["blocks_written"] == 1 and s["duplicate_writes"] == 3


# ----------------------------------------------------------------------------- misc

async def test_o_direct_reads_or_clean_fallback(tmp_path, monkeypatch):
    keys, blocks = rand_keys(2), rand_blocks(2)
    async with GatewayStore(make_cfg(tmp_path, o_direct=True), SPEC) as store:
        out = [[np.zeros(SPEC.layer_block_bytes, np.uint8) for _ in range(SPEC.num_layers)] for _ in keys]
        await store.write_blocks(keys, blocks)
        assert all((await store.read_blocks(keys, out)).found)
        assert all(np.array_equal(np.concatenate(o), b) for o, b in zip(out, blocks))
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    async with GatewayStore(make_cfg(tmp_path, o_direct=True), SPEC) as store:
        assert store.backend.o_direct is False and store.stats()["o_direct"] == 0
        out = empty_dests(2)
        assert all((await store.read_blocks(keys, out)).found)
        assert np.array_equal(out[1], blocks[1])


async def test_delete_close_and_config(tmp_path):
    key = rand_keys(1)[0]
    store = GatewayStore(make_cfg(tmp_path), SPEC)
    with pytest.raises(Unavailable):
        await store.write_block(key, rand_blocks(1)[0])
    async with store:
        await store.write_block(key, rand_blocks(1)[0])
        assert await store.delete(key) and not await store.delete(key)
        assert not os.path.exists(store.backend.path_for(key))
    with pytest.raises(Unavailable):
        await store.read_blocks([key], empty_dests(1))
    assert GatewayConfig().backend == "fs" and GatewayConfig().link_rate_bytes_per_s == 0
    with pytest.raises(ConfigError, match="backend"):
        build_config({"backend": "s3"}, GatewayConfig, environ={})
    with pytest.raises(ConfigError, match="capcity_bytes"):
        build_config({"capcity_bytes": 1}, GatewayConfig, environ={})
    with pytest.raises(ConfigError, match="capacity_bytes"):
        GatewayStore(make_cfg(tmp_path, capacity_bytes=10), SPEC)
    assert backend_fs.IOV_MAX >= 16


async def test_cancelled_io_returns_only_after_the_thread_stopped():
    started, release, finished = threading.Event(), threading.Event(), []

    def job() -> None:
        started.set()
        release.wait(5)
        finished.append(True)

    with ThreadPoolExecutor(1) as ex:
        task = asyncio.create_task(run_io(ex, job))
        await until(started.is_set)
        task.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not task.done()                  # the thread may still write into caller buffers
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [True]
