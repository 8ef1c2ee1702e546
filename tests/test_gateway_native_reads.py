"""The gateway's compiled GIL-free block read (storage_gateway/native/blockread.c) against its
Python path: the same bytes, the same xxh3, the same verdict on every kind of damaged file, and
reads from several threads at once. The native module is built by the install (setup.py);
where it was not (no C compiler) these tests skip loudly — and fail under CI=true."""

from __future__ import annotations

import os
import threading

import msgspec
import numpy as np
import pytest
import xxhash

from common.kv import full_block_view, request_kv_view
from storage_gateway import backend_fs
from storage_gateway.backends import ReadStatus
from storage_gateway.block_format import HEADER_SIZE, encode_header
from storage_gateway.destinations import normalize_destinations, scatter_views
from storage_gateway.store import GatewayStore
from tests.helpers import skip_or_fail
from tests.test_gateway_storage import BB, SPEC, T, empty_dests, make_cfg, rand_blocks, rand_keys


@pytest.fixture
def blockread():
    if backend_fs._blockread is None:
        skip_or_fail("storage_gateway._blockread was not built (pip install needs a C compiler "
                     "and Python headers; setup.py)")
    return backend_fs._blockread


def test_digest_and_bytes_match_xxhash_for_any_chunk_and_views(tmp_path, blockread):
    rng = np.random.default_rng(1)
    payload = rng.integers(0, 256, 300_001, np.uint8).tobytes()
    head_bytes = rng.integers(0, 256, 4096, np.uint8).tobytes()
    path = tmp_path / "block"
    path.write_bytes(head_bytes + payload)
    arena = np.zeros(400_000, np.uint8)
    cuts = [0, 1, 1, 4096, 70_000, 70_001, 250_000, 300_001]     # an empty view, odd lengths
    for chunk in (1, 4095, 65_536, 1 << 20):
        arena[:] = 0
        views = [memoryview(arena[a + 7 * i:b + 7 * i]) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        head = bytearray(4096)
        head_n, got, digest = blockread.read_block(str(path), os.O_RDONLY, head, views, chunk)
        assert (head_n, got) == (4096, len(payload)) and bytes(head) == head_bytes
        assert digest == xxhash.xxh3_64_intdigest(payload)
        assert b"".join(bytes(v) for v in views) == payload
    # a file shorter than asked: the counts say so, the hash covers what was read
    path.write_bytes(head_bytes + payload[:1234])
    head_n, got, digest = blockread.read_block(os.fsencode(path), os.O_RDONLY, bytearray(4096),
                                               [memoryview(arena[:300_001])], 65_536)
    assert (head_n, got, digest) == (4096, 1234, xxhash.xxh3_64_intdigest(payload[:1234]))
    path.write_bytes(head_bytes[:100])
    assert blockread.read_block(str(path), os.O_RDONLY, bytearray(4096), [], 4096)[:2] == (100, 0)


def test_runs_of_one_arena_read_like_views(tmp_path, blockread):
    """``read_block_runs`` (an ``ArenaRuns`` destination: per-layer runs of the requester's
    arena, no view per run) lands the same bytes and digest as the views do, and refuses a run
    outside the arena before reading anything."""
    rng = np.random.default_rng(2)
    payload = rng.integers(0, 256, 61 * 4096 + 17, np.uint8).tobytes()
    path = tmp_path / "block"
    path.write_bytes(bytes(4096) + payload)
    arena = np.zeros(1 << 20, np.uint8)
    lengths = [4096] * 61 + [17]
    offsets = [300_000 - 4096 * i for i in range(61)] + [900_000]    # backwards, as layers may lie
    head_n, got, digest = blockread.read_block_runs(str(path), os.O_RDONLY, bytearray(4096),
                                                    memoryview(arena), offsets, lengths, 10_000)
    assert (head_n, got, digest) == (4096, len(payload), xxhash.xxh3_64_intdigest(payload))
    assert b"".join(arena[o:o + n].tobytes() for o, n in zip(offsets, lengths)) == payload
    head = bytearray(4096)
    for offs, lens in (([len(arena) - 10], [11]), ([-1], [5]), ([0], [-5]), ([0, 1], [5])):
        arena[:] = 7
        with pytest.raises(ValueError):
            blockread.read_block_runs(str(path), os.O_RDONLY, head, arena, offs, lens, 4096)
        assert (arena == 7).all()                                    # nothing was read
    with pytest.raises(TypeError):
        blockread.read_block_runs(str(path), os.O_RDONLY, head, arena, ["0"], [5], 4096)
    with pytest.raises(BufferError):
        blockread.read_block_runs(str(path), os.O_RDONLY, head, bytes(10), [0], [5], 4096)


def test_bad_arguments_raise_typed_errors(tmp_path, blockread):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    head, dest = bytearray(16), np.zeros(100, np.uint8)
    with pytest.raises(FileNotFoundError):
        blockread.read_block(str(tmp_path / "absent"), os.O_RDONLY, head, [dest], 64)
    with pytest.raises(IsADirectoryError):
        blockread.read_block(str(tmp_path), os.O_RDONLY, head, [dest], 64)
    with pytest.raises(BufferError):                                # read-only destination
        blockread.read_block(str(path), os.O_RDONLY, b"0" * 16, [dest], 64)
    with pytest.raises((BufferError, ValueError)):                 # not contiguous
        blockread.read_block(str(path), os.O_RDONLY, head, [np.zeros(100, np.uint8)[::2]], 64)
    with pytest.raises(ValueError):
        blockread.read_block(str(path), os.O_RDONLY, head, [dest], 0)
    with pytest.raises(TypeError):
        blockread.read_block(str(path), os.O_RDONLY, head, 5, 64)


def damage(backend, keys: list[str], blocks) -> dict[str, ReadStatus]:
    """Give each key but the first a different fault; the verdict each one must get."""
    path = backend.path_for
    want = {keys[0]: ReadStatus.OK}

    def rewrite(k, fn):
        data = bytearray(open(path(k), "rb").read())
        fn(data)
        with open(path(k), "wb") as f:
            f.write(data)

    def flip(at):
        def fn(data):
            data[at] ^= 0xFF
        return fn

    rewrite(keys[1], flip(HEADER_SIZE + BB - 1))                  # last payload byte
    want[keys[1]] = ReadStatus.CORRUPT
    rewrite(keys[2], flip(3))                                     # header bit rot
    want[keys[2]] = ReadStatus.CORRUPT
    os.truncate(path(keys[3]), HEADER_SIZE + BB - 5000)           # payload cut short
    want[keys[3]] = ReadStatus.CORRUPT
    os.truncate(path(keys[4]), HEADER_SIZE - 1)                   # header cut short
    want[keys[4]] = ReadStatus.CORRUPT
    with open(path(keys[5]), "r+b") as f:                         # another block's file here
        f.write(encode_header(keys[0], backend.fingerprint, BB,
                              xxhash.xxh3_64_intdigest(blocks[5].tobytes())))
    want[keys[5]] = ReadStatus.CORRUPT
    with open(path(keys[6]), "r+b") as f:                         # another model's KV
        f.write(encode_header(keys[6], "f" * 16, BB, xxhash.xxh3_64_intdigest(blocks[6].tobytes())))
    want[keys[6]] = ReadStatus.FOREIGN
    os.unlink(path(keys[7]))
    want[keys[7]] = ReadStatus.MISSING
    os.unlink(path(keys[8]))
    os.mkdir(path(keys[8]))                                       # open works, read fails
    want[keys[8]] = ReadStatus.ERROR
    return want


@pytest.mark.parametrize("native", [True, False])
async def test_both_paths_give_the_same_verdicts(tmp_path, native, request):
    if native:
        request.getfixturevalue("blockread")
    n = 9
    keys, blocks = rand_keys(n, seed=5), rand_blocks(n, seed=5)
    cfg = msgspec.structs.replace(make_cfg(tmp_path), native_reads=native)
    async with GatewayStore(cfg, SPEC) as store:
        assert store.backend.native_reads is native
        assert store.backend.counters()["native_reads"] == int(native)
        await store.write_blocks(keys, blocks)
        want = damage(store.backend, keys, blocks)
        out = empty_dests(n)
        got = await store.backend.read(keys, normalize_destinations(out, n, BB))
        assert dict(zip(keys, got)) == want
        assert np.array_equal(out[0], blocks[0])
        stats = store.backend.counters()
        assert (stats["checksum_failures"], stats["foreign_blocks"], stats["read_io_errors"]) == (5, 1, 1)
        assert stats["quarantined"] == 5
        for k, status in want.items():                            # corrupt files moved aside
            assert os.path.exists(store.backend.path_for(k)) == (status in (ReadStatus.OK,
                                                                            ReadStatus.FOREIGN,
                                                                            ReadStatus.ERROR))


async def test_native_reads_from_many_threads_at_once_are_byte_exact(tmp_path, blockread):
    """The GIL is released for the whole read: 4 threads each read every block into its own
    per-layer region at once; all of them land byte-exact."""
    n = 16
    keys, blocks = rand_keys(n, seed=9), rand_blocks(n, seed=9)
    async with GatewayStore(make_cfg(tmp_path), SPEC) as store:
        store.backend.read_chunk = 16_384              # 4 steps per 64 KiB block
        await store.write_blocks(keys, blocks)
        regions = [request_kv_view(np.zeros(SPEC.bytes_per_token * n * T, np.uint8), SPEC, n * T)
                   for _ in range(4)]
        results: list[list[ReadStatus]] = [[] for _ in regions]

        def reader(i: int) -> None:
            dests = normalize_destinations(scatter_views(regions[i], SPEC, n), n, BB)
            results[i] = store.backend._read_batch(keys, dests)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(len(regions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        for region, statuses in zip(regions, results):
            assert statuses == [ReadStatus.OK] * n
            for i, block in enumerate(blocks):
                assert np.array_equal(region[:, i * T:(i + 1) * T], full_block_view(block, SPEC))


async def test_native_reads_off_or_unbuilt_takes_the_python_path(tmp_path, monkeypatch):
    """``native_reads = false``, or a module that was not built, reads through Python, and the
    backend says which path it takes (the gateway's status shows the counter)."""
    keys, blocks = rand_keys(2, seed=3), rand_blocks(2, seed=3)
    monkeypatch.setattr(backend_fs, "_blockread", None)
    async with GatewayStore(make_cfg(tmp_path), SPEC) as store:
        assert store.backend.native_reads is False
        await store.write_blocks(keys, blocks)
        out = empty_dests(2)
        assert (await store.read_blocks(keys, out)).found == [True, True]
        assert all(np.array_equal(o, b) for o, b in zip(out, blocks))
