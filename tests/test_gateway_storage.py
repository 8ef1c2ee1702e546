"""Storage core of the gateway: block format, fs/memory backends, index, eviction, read queue,
link shaping — driven in-process, no network."""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from common.buffers import PagePool
from common.config import build_config
from common.errors import (ConfigError, DeadlineExceeded, InvalidArgument, Overloaded,
                           ResourceExhausted, StorageError, Unavailable)
from common.kv import PRESETS, KVSpec, block_keys_from_tokens, full_block_view, request_kv_view
from storage_gateway import backend_fs
from storage_gateway.backends import run_io
from storage_gateway.block_format import (HEADER_SIZE, QUARANTINE_DIR, BadHeader, decode_header,
                                          encode_header, parse_temp_name, temp_name)
from storage_gateway.block_index import BlockIndex, measure_bytes_per_block
from storage_gateway.config import GatewayConfig
from storage_gateway.destinations import allocation_scatter_views, scatter_views
from common.rate import TokenBucket
from storage_gateway.link_shaper import LinkShaper
from storage_gateway.read_queue import ReadQueue
from storage_gateway import link_shaper as link_shaper_mod
from storage_gateway import store as store_mod
from storage_gateway.store import GatewayStore
from tests.helpers import VirtualTime, until

REPO = Path(__file__).resolve().parents[1]
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


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


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


# ----------------------------------------------------------------------------- durability

async def test_restart_rebuilds_index_and_cleans_temp_files(tmp_path):
    cfg = make_cfg(tmp_path)
    keys, blocks = rand_keys(4), rand_blocks(4)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks(keys, blocks)
        host, paths = store.backend.host, [store.backend.path_for(k) for k in keys]
    for i, path in enumerate(paths):                     # LRU order across restart = mtime order
        os.utime(path, ns=(0, (10 - i) * 10**9))
    shard = Path(paths[0]).parent
    dead = shard / temp_name(keys[0], host, 999_999_999, 0)
    dead.write_bytes(b"torn")
    foreign = shard / temp_name(keys[1], "otherhost", 42, 0)
    foreign.write_bytes(b"in progress on another node")
    async with GatewayStore(cfg, SPEC) as store:
        assert not dead.exists() and foreign.exists()        # another host's write may be live
        assert store.stats()["temp_files_cleaned"] == 1
        assert list(store.index.keys_lru()) == keys[::-1]
        assert await store.lookup_prefix(keys) == 4
        out = empty_dests(4)
        assert all((await store.read_blocks(keys, out)).found)
        assert all(np.array_equal(a, b) for a, b in zip(out, blocks))
    async with GatewayStore(make_cfg(tmp_path, temp_max_age_s=0), SPEC) as store:
        assert not foreign.exists() and store.stats()["temp_files_cleaned"] == 1


def test_kill9_mid_write_leaves_no_torn_block(tmp_path):
    root = tmp_path / "store"
    spec = KVSpec("crash-test", 16, 4096)                 # 4 MiB blocks: kills land mid-write
    acked: list[str] = []
    for _round in range(2):
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "gateway_crash_writer.py"),
                                 str(root), "16", "4096"], stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert proc.stdout.readline().strip() == "ready"
            for _ in range(2):
                acked.append(proc.stdout.readline().strip())
            time.sleep(random.uniform(0, 0.03))     # kill at a random point of a write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        acked.extend(line.strip() for line in proc.stdout.read().splitlines() if line.strip())
        proc.stdout.close()
    assert len(acked) >= 4

    async def reopen() -> None:
        async with GatewayStore(GatewayConfig(root=str(root), io_threads=2), spec) as store:
            s = store.stats()
            assert s["quarantined"] == 0                       # no torn file under a block name
            visible = list(store.index.keys_lru())
            assert set(acked) <= set(visible)                  # acknowledged = durable
            out = [np.zeros(spec.full_block_bytes, np.uint8) for _ in visible]
            res = await store.read_blocks(visible, out)
            assert all(res.found) and store.stats()["checksum_failures"] == 0
        assert not files(root, ".tmp-*")

    asyncio.run(reopen())


async def test_corrupt_payload_is_reported_missing_and_quarantined(tmp_path):
    keys, blocks = rand_keys(3), rand_blocks(3)
    async with GatewayStore(make_cfg(tmp_path), SPEC) as store:
        await store.write_blocks(keys, blocks)
        flip_byte(store.backend.path_for(keys[1]), HEADER_SIZE + 1234)
        out = empty_dests(3)
        res = await store.read_blocks(keys, out)
        assert res.found == [True, False, True] and res.corrupt == [keys[1]]
        assert res.missing_keys == [keys[1]] and res.prefix_read == 1
        s = store.stats()
        assert s["checksum_failures"] == 1 and s["quarantined"] == 1
        assert not store.contains(keys[1]) and not os.path.exists(store.backend.path_for(keys[1]))
        assert len(list((tmp_path / "store" / QUARANTINE_DIR).iterdir())) == 1
        assert await store.lookup_prefix(keys) == 1
        res = await store.read_blocks(keys[1:2], out[:1])      # never served afterwards either
        assert res.found == [False] and res.corrupt == []
        assert await store.write_block(keys[1], blocks[1])     # the caller recomputes and rewrites
        assert (await store.read_blocks(keys[1:2], out[:1])).found == [True]


async def test_corrupt_memory_block_is_not_served(tmp_path):
    async with GatewayStore(make_cfg(tmp_path, "memory"), SPEC) as store:
        keys = rand_keys(1)
        await store.write_blocks(keys, rand_blocks(1))
        store.backend.corrupt(keys[0], 77)
        res = await store.read_blocks(keys, empty_dests(1))
        assert res.found == [False] and res.corrupt == keys
        assert store.stats()["checksum_failures"] == 1


async def test_corrupt_headers_are_quarantined_at_scan_and_on_read(tmp_path):
    cfg = make_cfg(tmp_path)
    keys, blocks = rand_keys(4), rand_blocks(4)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks(keys, blocks)
        flip_byte(store.backend.path_for(keys[3]), 40)            # header bit rot while running
        res = await store.read_blocks(keys[3:], empty_dests(1))
        assert res.corrupt == keys[3:]
        paths = [store.backend.path_for(k) for k in keys]
    flip_byte(paths[0], 5)                                        # bad header field
    os.truncate(paths[1], HEADER_SIZE + BB // 2)                  # torn file under a block name
    async with GatewayStore(cfg, SPEC) as store:
        assert store.stats()["quarantined"] == 2
        assert list(store.index.keys_lru()) == [keys[2]]
        assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])
    assert len(list((tmp_path / "store" / QUARANTINE_DIR).iterdir())) == 3


def test_header_roundtrip_and_rejection():
    key, fp = rand_keys(1)[0], SPEC.fingerprint()
    head = encode_header(key, fp, BB, 12345)
    assert len(head) == HEADER_SIZE
    h = decode_header(head)
    assert (h.key, h.fingerprint, h.payload_len, h.payload_checksum) == (key, fp, BB, 12345)
    for offset in (0, 5, 20, 40, 52):
        bad = bytearray(head)
        bad[offset] ^= 1
        with pytest.raises(BadHeader):
            decode_header(bad)
    assert parse_temp_name(temp_name(key, "my.host_1", 77, 3)) == (key, "my.host_1", 77)
    assert parse_temp_name(".tmp-garbage") is None


async def test_disk_full_fails_cleanly(tmp_path, monkeypatch):
    keys, blocks = rand_keys(2), rand_blocks(2)
    real_writev, calls = os.writev, []

    def full_disk(fd, bufs):                      # a short write, then ENOSPC: what a full disk does
        calls.append(fd)
        if len(calls) == 1:
            return real_writev(fd, [memoryview(bufs[0])[:1000]])
        raise OSError(errno.ENOSPC, "No space left on device")

    async with GatewayStore(make_cfg(tmp_path), SPEC) as store:
        await store.write_block(keys[0], blocks[0])
        before = tree(tmp_path / "store")
        monkeypatch.setattr(os, "writev", full_disk)
        with pytest.raises(StorageError, match="disk full"):
            await store.write_block(keys[1], blocks[1])
        monkeypatch.undo()
        after = tree(tmp_path / "store")
        new = [k for k in set(after) - set(before) if not (tmp_path / "store" / k).is_dir()]
        assert new == [] and not files(tmp_path / "store", ".tmp-*")  # only an empty shard dir
        assert not store.contains(keys[1]) and store.index.reserved_bytes == 0
        assert (await store.read_blocks(keys, empty_dests(2))).found == [True, False]
        assert await store.write_block(keys[1], blocks[1])  # space back: the write goes through
        assert (await store.read_blocks(keys, empty_dests(2))).found == [True, True]


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


# ----------------------------------------------------------------------------- read queue

def test_read_queue_fifo_bounded_and_overloaded():
    q = ReadQueue(block_tokens=64, block_bytes=BB, max_concurrent=2, max_queued=2,
                  max_keys=100, max_bytes=100 * BB, retry_after_s=0.2)
    t1, s1 = q.submit(1)
    t2, s2 = q.submit(2)
    t3, s3 = q.submit(3)
    t4, s4 = q.submit(4)
    assert (s1, s2, s3, s4) == (True, True, False, False)
    assert q.read_q == 64 * 10 and q.inflight_tokens == 64 * 3 and q.queued_tokens == 64 * 7
    with pytest.raises(Overloaded) as e:
        q.submit(1)
    assert e.value.retry_after_s == 0.2 and e.value.retryable
    assert q.finish(t2) == [t3]                                  # FIFO: t3 before t4
    assert q.cancel(t4) == [] and q.read_q == 64 * 4
    assert q.finish(t1) == [] and q.finish(t3) == []
    assert q.read_q == 0 and q.n_running == 0
    with pytest.raises(InvalidArgument):
        q.finish(t3)
    with pytest.raises(InvalidArgument):
        q.submit(101)


async def test_store_read_queue_accounting_fifo_and_overload(tmp_path):
    cfg = make_cfg(tmp_path, "memory", max_concurrent_reads=1, max_queued_requests=2)
    keys = rand_keys(6)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks(keys, rand_blocks(6))
        gate, started = gate_reads(store)
        groups = [keys[0:2], keys[2:3], keys[3:6]]
        tasks = [asyncio.create_task(store.read_blocks(g, empty_dests(len(g)), request_id=f"r{i}"))
                 for i, g in enumerate(groups)]
        await until(lambda: store.read_queue.n_waiting == 2 and started)
        assert store.read_q == 6 * T and store.stats()["read_requests_running"] == 1
        with pytest.raises(Overloaded):
            await store.read_blocks(keys[:1], empty_dests(1))
        gate.set()
        results = await asyncio.gather(*tasks)
        assert all(all(r.found) for r in results)
        assert started == groups                                  # served in arrival order
        assert store.read_q == 0 and store.stats()["pinned_blocks"] == 0


async def test_cancelled_and_timed_out_reads_release_queue_and_pins(tmp_path):
    cfg = make_cfg(tmp_path, "memory", max_concurrent_reads=1)
    keys = rand_keys(3)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks(keys, rand_blocks(3))
        gate, started = gate_reads(store)
        with pytest.raises(DeadlineExceeded):
            first = asyncio.create_task(store.read_blocks(keys[:2], empty_dests(2), timeout_s=0.2))
            queued = asyncio.create_task(store.read_blocks(keys[2:], empty_dests(1)))
            await until(lambda: store.read_q == 3 * T)
            queued.cancel()
            await until(lambda: store.read_q == 2 * T)
            await first
        assert store.read_q == 0 and store.stats()["pinned_blocks"] == 0
        gate.set()
        assert all((await store.read_blocks(keys, empty_dests(3))).found)


# ----------------------------------------------------------------------------- link shaping

class _VirtualAsyncio:
    """``asyncio`` as ``storage_gateway.link_shaper`` sees it, its ``sleep`` on virtual time."""

    def __init__(self, vt: VirtualTime) -> None:
        self.sleep = vt.sleep

    def __getattr__(self, name: str):
        return getattr(asyncio, name)


def virtual_link(monkeypatch) -> VirtualTime:
    """Every LinkShaper made from here on (the store's too) runs on one virtual clock."""
    vt = VirtualTime()
    monkeypatch.setattr(link_shaper_mod, "asyncio", _VirtualAsyncio(vt))
    monkeypatch.setattr(store_mod, "LinkShaper", functools.partial(LinkShaper, clock=vt.clock))
    return vt


async def test_link_shaper_rate_and_fair_interleaving(monkeypatch):
    rate, burst = 20e6, 256 * 1024
    vt = virtual_link(monkeypatch)
    shaper = LinkShaper(rate, burst_bytes=burst, chunk_bytes=256 * 1024, clock=vt.clock)
    done: list[float] = []

    async def reader() -> None:
        await shaper.acquire(5_000_000)
        done.append(vt.now)

    await vt.run(asyncio.gather(reader(), reader()))
    assert max(done) == pytest.approx((10_000_000 - burst) / rate, rel=1e-12)   # rate exact
    chunk_s = burst / rate
    # the burst is free; then each reader waits for its chunk and the other's: interleaved
    assert vt.sleeps[:4] == pytest.approx([chunk_s, 2 * chunk_s, 2 * chunk_s, 2 * chunk_s])
    assert min(done) > 0.75 * max(done)                            # interleaved, not one then the other


def test_token_bucket_long_run_rate_is_exact_even_when_woken_late():
    for late in (0.0, 0.01):                       # on time, and every wake-up 10 ms late
        now = [0.0]
        bucket = TokenBucket(1000.0, 100, clock=lambda now=now: now[0])
        waits = []
        for _ in range(50):
            waits.append(bucket.reserve(40))
            now[0] += waits[-1]
            cleared = now[0]                       # when this chunk's debt is paid
            now[0] += late if waits[-1] else 0.0
        assert waits[:4] == pytest.approx([0.0, 0.0, 0.02, 0.04 - late])
        assert cleared == pytest.approx((50 * 40 - 100) / 1000.0)   # burst free, then exact rate


def test_token_bucket_accounts_debt_exactly():
    now = [0.0]
    bucket = TokenBucket(1000.0, 100, clock=lambda: now[0])
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(50) == pytest.approx(0.05)
    assert bucket.reserve(50) == pytest.approx(0.10)               # queued behind the first debt
    now[0] = 10.0
    assert bucket.balance == 100                                    # refill capped at burst
    assert LinkShaper(0).enabled is False


async def test_store_charges_reads_and_writes_to_the_link(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, "memory", link_rate_bytes_per_s=8e6, link_burst_bytes=BB,
                   link_chunk_bytes=BB)
    keys = rand_keys(4)
    vt = virtual_link(monkeypatch)
    async with GatewayStore(cfg, SPEC) as store:
        await vt.run(store.write_blocks(keys, rand_blocks(4)))
        await vt.run(store.read_blocks(keys, empty_dests(4)))
        assert store.stats()["link_bytes_charged"] == 8 * BB
        assert vt.now == pytest.approx((7 * BB) / 8e6, rel=1e-12)   # one burst free, then the rate


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
