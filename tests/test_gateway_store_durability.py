"""Durability of the gateway's store in one process: a restart rebuilds the index and cleans temp
files, kill -9 mid-write leaves no torn block, corrupt payloads and headers are quarantined,
a full disk fails cleanly. Across processes: ``test_durability.py``. Helpers:
``test_gateway_storage.py``."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.errors import StorageError
from common.kv import KVSpec, full_block_view, request_kv_view
from storage_gateway import backend_fs
from storage_gateway.block_format import (HEADER_SIZE, QUARANTINE_DIR, BadHeader, decode_header,
                                          encode_header, parse_temp_name, temp_name)
from storage_gateway.config import GatewayConfig
from storage_gateway.destinations import scatter_views
from storage_gateway.store import GatewayStore
from tests.test_gateway_storage import (BB, SPEC, T, empty_dests, files, make_cfg, rand_blocks,
                                        rand_keys, tree)

REPO = Path(__file__).resolve().parents[1]


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


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


async def test_a_temp_file_another_gateway_removed_first_is_not_counted(tmp_path, monkeypatch):
    """Gateways sharing a root scan it at once at a cluster start: both may see one torn temp
    file, and only the one whose unlink removed it counts it (once 3 were counted for 2)."""
    cfg = make_cfg(tmp_path)
    keys = rand_keys(2)
    async with GatewayStore(cfg, SPEC) as store:
        await store.write_blocks(keys, rand_blocks(2))
        host, shard = store.backend.host, Path(store.backend.path_for(keys[0])).parent
    mine, theirs = (shard / temp_name(k, host, 999_999_990 + i, 0) for i, k in enumerate(keys))
    mine.write_bytes(b"torn")
    theirs.write_bytes(b"torn")
    real_unlink = os.unlink

    def raced(path, *args, **kw):            # the other gateway's scan got there first
        if os.fspath(path) == str(theirs):
            real_unlink(path)
        return real_unlink(path, *args, **kw)

    monkeypatch.setattr(os, "unlink", raced)
    async with GatewayStore(cfg, SPEC) as store:
        assert not mine.exists() and not theirs.exists()
        assert store.stats()["temp_files_cleaned"] == 1


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


def test_read_chunks_keep_order_and_size():
    data = np.arange(100_000, dtype=np.uint8)
    views = [memoryview(data[a:b]) for a, b in ((0, 10), (10, 10), (10, 9000), (9000, 9001),
                                                   (9001, 100_000))]
    for chunk in (1, 4096, 5000, 1 << 20):
        runs = backend_fs.read_chunks(views, chunk)
        assert b"".join(bytes(b) for run in runs for b in run) == data.tobytes()
        assert all(len(b) for run in runs for b in run)              # empty views dropped
        sizes = [sum(len(b) for b in run) for run in runs]
        assert all(chunk <= s < 2 * chunk for s in sizes[:-1]) and 0 < sizes[-1] < 2 * chunk


@pytest.mark.parametrize("chunk", [backend_fs.READ_CHUNK, 4096, 3000])
async def test_chunked_reads_are_byte_exact_and_verify_every_chunk(tmp_path, chunk):
    """A read copies and hashes a block chunk by chunk (a 64 KiB block is one chunk by default,
    16 or 22 here, across per-layer views): the data lands byte-exact, a flipped last byte and
    a file cut short while the gateway runs are both corrupt, the blocks around them served."""
    n = 4
    keys, blocks = rand_keys(n), rand_blocks(n)
    region = request_kv_view(np.zeros(SPEC.bytes_per_token * n * T, np.uint8), SPEC, n * T)
    async with GatewayStore(make_cfg(tmp_path), SPEC) as store:
        store.backend.read_chunk = chunk
        await store.write_blocks(keys, blocks)
        assert all((await store.read_blocks(keys, scatter_views(region, SPEC, n))).found)
        for i, block in enumerate(blocks):
            assert np.array_equal(region[:, i * T:(i + 1) * T], full_block_view(block, SPEC))
        flip_byte(store.backend.path_for(keys[1]), HEADER_SIZE + BB - 1)
        os.truncate(store.backend.path_for(keys[2]), HEADER_SIZE + BB - 5000)
        out = empty_dests(n)
        res = await store.read_blocks(keys, out)
        assert res.found == [True, False, False, True] and res.corrupt == keys[1:3]
        assert np.array_equal(out[0], blocks[0]) and np.array_equal(out[3], blocks[3])
        assert store.stats()["checksum_failures"] == 2


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
