"""Same-host shared-memory reads: the gateway preads straight into the requester's segment.

Unit parts (segment names, sweep of dead owners, the gateway's mapping checks, stream → block
mapping) run in-process; the end-to-end cases run the gateway as ``dualpath serve gateway``
and this process as the requester with its arena in a ``/dev/shm/dualpath-*`` segment, so the
bytes really cross processes through shared memory (and not UCX: the gateway's transport
counters are checked). Every segment and process made here is removed by the end of its test.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common import shm
from common.buffers import PagePool
from common.config import RpcConfig
from common.errors import DeadlineExceeded, InvalidArgument
from common.kv import PRESETS, full_block_view
from common.protocol import GatewayReply, ReadBatch, ReadBlocks, ShmFence, ShmUnavailable
from common.rpc import RpcClient
from common.service import Status
from common.transport import PageTransport
from storage_gateway.block_format import HEADER_SIZE
from storage_gateway.client import GatewayClient, block_slots, layout_slots, plan_batches
from storage_gateway.destinations import block_runs
from tests.helpers import until
from tests.test_gateway_service import (BB, SPEC, TCFG, blocks, chain, cluster, gateway_process,
                                        tree)

MiB = 1 << 20


@pytest.fixture
def segments():
    """Segments made by the test; closed (unlinked) at the end, checked gone."""
    made: list[shm.ShmSegment] = []
    yield made
    for seg in made:
        seg.close()
        assert not os.path.exists(seg.path)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---------------------------------------------------------------- pure parts

@pytest.mark.parametrize("layer_major", [False, True])
def test_block_runs_match_the_wire_order(layer_major):
    """Per-block runs (closed form) put each byte where the UCX stream would have put it."""
    tokens = 9 * SPEC.block_tokens
    dest = layout_slots(SPEC, 777, tokens, 7, first_block=1)
    for n, slots in plan_batches(SPEC, dest[:5], 3 * BB, layer_major) + \
            plan_batches(SPEC, dest, 8 * BB, layer_major):
        arena_stream = np.zeros(777 + SPEC.bytes_per_token * tokens, np.int64)
        pos = 0
        for off, k in slots:                          # stream byte s → arena offset
            arena_stream[off:off + k] = np.arange(pos, pos + k)
            pos += k
        lb, bb = SPEC.layer_block_bytes, BB
        arena = memoryview(bytearray(len(arena_stream)))
        for i, runs in enumerate(block_runs(arena, slots, n, SPEC, layer_major)):
            pieces = list(zip(runs.offsets, runs.lengths))
            got = np.concatenate([arena_stream[o:o + k] for o, k in pieces])
            if layer_major:
                want = np.concatenate([np.arange((layer * n + i) * lb, (layer * n + i + 1) * lb)
                                       for layer in range(SPEC.num_layers)])
            else:
                want = np.arange(i * bb, (i + 1) * bb)
            assert np.array_equal(got, want)
            assert len(pieces) <= SPEC.num_layers       # per-layer runs, merged when adjacent


def test_segment_name_pattern_owner_and_close(segments):
    seg = shm.ShmSegment.create(3 * 4096)
    segments.append(seg)
    assert shm.NAME_RE.match(seg.name) and os.path.exists(seg.path)
    assert shm.owner_of(seg.name)[0] == os.getpid()
    assert os.stat(seg.path).st_mode & 0o777 == 0o600
    seg.array[:] = 7
    assert shm.segment_of(seg.array[4096:8192]) == (seg, 4096)
    assert shm.segment_of(np.zeros(8, np.uint8)) is None
    pool = PagePool(4096, 4, name="p", shm=True)
    assert pool.shm is not None and shm.segment_of(pool.arena)[0] is pool.shm
    pool.close()
    assert not os.path.exists(pool.shm.path) and shm.segment_of(pool.arena) is None
    for bad in ("dualpath-" + "A" * 32, "dualpath-" + "0" * 31, "../dualpath-" + "0" * 32,
                "dualpath-" + "0" * 32 + "/x", "psm_0000", ""):
        assert not shm.valid_name(bad)


def test_sweep_removes_only_dead_owners_of_this_namespace(tmp_path):
    tag = shm.owner_of(shm.make_name())[1]
    dead = _dead_pid()
    names = {"dead_here": f"dualpath-{dead:08x}{tag}{'1' * 16}",
             "alive_here": f"dualpath-{os.getppid():08x}{tag}{'2' * 16}",
             "dead_elsewhere": f"dualpath-{dead:08x}{'f' * 8 if tag != 'f' * 8 else '0' * 8}{'3' * 16}",
             "not_ours": "notdualpath-1234"}
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    removed = shm.sweep_stale(str(tmp_path))
    assert removed == [names["dead_here"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        v for k, v in names.items() if k != "dead_here")


def test_gateway_mapping_checks_touch_nothing_outside(tmp_path, reliability):
    maps = shm.ShmMappings(max_mappings=2, directory=str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 8192)
    good = f"dualpath-{'a' * 32}"
    for name in ("../victim", "victim", f"dualpath-{'A' * 32}", f"dualpath-{'a' * 31}/",
                 "/etc/passwd", good + "\x00"):
        with pytest.raises(InvalidArgument):
            maps.get(name, 8192)
    os.symlink(victim, tmp_path / good)                       # a link under a good name
    with pytest.raises(InvalidArgument):
        maps.get(good, 8192)
    os.unlink(tmp_path / good)
    os.link(victim, tmp_path / good)                          # a second name of another file
    with pytest.raises(InvalidArgument):
        maps.get(good, 8192)
    os.unlink(tmp_path / good)
    with pytest.raises(shm.ShmUnavailable):                   # not there (other host)
        maps.get(good, 8192)
    assert victim.read_bytes() == b"v" * 8192 and len(maps) == 0
    segs = [shm.ShmSegment.create(8192, directory=str(tmp_path)) for _ in range(3)]
    try:
        with pytest.raises(InvalidArgument):                  # size must be what was declared
            maps.get(segs[0].name, 4096)
        a = maps.get(segs[0].name, 8192)
        a[:4] = 9
        assert (segs[0].array[:4] == 9).all()                 # really the same memory
        assert maps.get(segs[0].name, 8192) is a and maps.stats["shm_map_hits"] == 1
        maps.get(segs[1].name, 8192)
        maps.get(segs[2].name, 8192)                          # LRU bound: 2 mappings
        assert len(maps) == 2 and maps.stats["shm_maps_dropped"] == 1
        segs[1].close()                                       # owner left: never used again
        with pytest.raises(shm.ShmUnavailable):
            maps.get(segs[1].name, 8192)
    finally:
        for s in segs:
            s.close()
    reliability.record("security", "shm segment names/links/sizes outside the pattern",
                       "INVALID_ARGUMENT, no file outside dualpath-* opened or written")


# ---------------------------------------------------------------- in-process gateway

async def test_shm_read_fence_after_requester_deadline(tmp_path):
    """A requester that gives up mid-read waits (ShmFence) until the gateway stopped writing."""
    shaped = {"link_rate_bytes_per_s": 1e6, "link_burst_bytes": BB, "link_chunk_bytes": BB}
    async with cluster(tmp_path, gateway=shaped) as c:
        keys = chain(8)
        await c.client.write_blocks("w", keys, blocks(8), 30.0)
        pool = PagePool(64 * 1024, 16, name="req", shm=True)
        try:
            client = GatewayClient.connect(c.cfg.rpc, "127.0.0.1", c.gw.rpc_port, c.tr, pool.arena,
                                           SPEC, node_id="shm-req")
            async with client:
                with pytest.raises(DeadlineExceeded):
                    await client.read_blocks("late", keys, block_slots(0, BB, 8), 0.2)
                assert client.counts["shm_fences"] == 1
                assert not c.gw._shm_running                 # nothing writes into our pages now
                assert c.gw.counters()["shm_fences"] == 1
                task = asyncio.create_task(client.read_blocks("gone", keys, block_slots(0, BB, 8), 20.0))
                await until(lambda: c.gw._shm_running, what="shm read running")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert client.counts["shm_fences"] == 2 and not c.gw._shm_running
                reply = await client.read_blocks("after", keys[:2], block_slots(0, BB, 2), 10.0)
                assert reply.prefix_blocks == 2 and client.counts["shm_reads"] == 1
                assert c.gw.read_q == 0
        finally:
            pool.close()


# ---------------------------------------------------------------- across processes

@pytest.mark.slow
@pytest.mark.reliability
async def test_shm_round_trip_with_gateway_process(tmp_path, reliability):
    spec = PRESETS["deepseek-v3.2"]                      # 2.56 MB Full Blocks
    bb = spec.full_block_bytes
    with gateway_process(tmp_path, "deepseek-v3.2") as (proc, ready):
        pool = PagePool(bb, 8, name="req", shm=True)
        arena = pool.arena
        try:
            async with PageTransport(TCFG, "req") as tr:
                client = GatewayClient.connect(RpcConfig(), "127.0.0.1", ready["rpc_port"], tr,
                                               arena, spec, node_id="req")
                async with client:
                    assert client.shm_active
                    keys, data = chain(6, spec=spec), blocks(6, seed=5, spec=spec)
                    assert (await client.write_blocks("w", keys[:5], data[:5], 30.0)).written == 5
                    sent0 = (await client.stats())["transport_bytes_sent"]
                    tokens = 8 * spec.block_tokens
                    arena[:] = 0xAB
                    reply = await client.read_blocks("r", keys[:5], layout_slots(spec, 0, tokens, 5),
                                                     30.0, batch_bytes=2 * bb, layer_major=True)
                    assert reply.prefix_blocks == 5 and reply.nbytes == 5 * bb
                    region = arena[:spec.bytes_per_token * tokens].reshape(spec.num_layers, tokens, -1)
                    t = spec.block_tokens
                    for i in range(5):
                        assert np.array_equal(region[:, i * t:(i + 1) * t], full_block_view(data[i], spec))
                    assert (region[:, 5 * t:] == 0xAB).all()             # untouched beyond
                    # missing + corrupt: zero-filled in place and flagged
                    path = tmp_path / "pstore" / keys[2][0:2] / keys[2][2:4] / f"{keys[2]}.kvb"
                    with open(path, "r+b") as f:
                        f.seek(HEADER_SIZE + 4321)
                        byte = f.read(1)[0]
                        f.seek(HEADER_SIZE + 4321)
                        f.write(bytes([byte ^ 1]))
                    arena[:] = 0xAB
                    reply = await client.read_blocks("r2", keys, block_slots(bb, bb, 6), 30.0,
                                                     batch_bytes=3 * bb)
                    assert reply.found == [True, True, False, True, True, False]
                    assert (reply.prefix_blocks, reply.corrupt) == (2, 1)
                    for i in range(6):
                        got = arena[(i + 1) * bb:(i + 2) * bb]
                        assert np.array_equal(got, data[i]) if reply.found[i] else not got.any()
                    assert (arena[:bb] == 0xAB).all()
                    stats = await client.stats()
                    assert stats["transport_bytes_sent"] == sent0        # nothing went over UCX
                    assert stats["shm_reads"] == 2 and stats["blocks_zero_filled"] == 2
                    assert stats["checksum_failures"] == 1 and stats["shm_mapped_segments"] == 1
                    assert stats["staging_pages_used"] == 0 and client.counts["ucx_reads"] == 0
                    await _bad_shm_requests(ready["rpc_port"], spec, keys, client, pool, tmp_path)
        finally:
            pool.close()
        assert proc.poll() is None
    reliability.record("security", "shm ReadBlocks: bad segment names, slots out of bounds",
                       "INVALID_ARGUMENT before any I/O; arena and store untouched; gateway alive")
    reliability.record("fault", "shm read: corrupt + missing block",
                       "zero-filled in the requester's segment and flagged", lost=0)


async def _bad_shm_requests(port: int, spec, keys: list[str], client: GatewayClient,
                            pool: PagePool, tmp_path: Path) -> None:
    seg, bb = pool.shm, spec.full_block_bytes
    before = tree(tmp_path / "pstore")
    pool.arena[:] = 0x5A
    host, uport = client.transport.address
    batch = [ReadBatch(1, 1, [(0, bb)])]
    bad = [
        ReadBlocks("b", keys[:1], host, uport, [ReadBatch(1, 1, [(seg.nbytes - bb + 1, bb)])],
                   seg.name, seg.nbytes),                                  # slot past the end
        ReadBlocks("b", keys[:1], host, uport, batch, seg.name, seg.nbytes - 4096),  # size lies
        ReadBlocks("b", keys[:1], host, uport, batch, seg.name, 0),
        ReadBlocks("b", keys[:1], host, uport, batch, "../../etc/passwd", seg.nbytes),
        ReadBlocks("b", keys[:1], host, uport, batch, "dualpath-" + "Z" * 32, seg.nbytes),
        ReadBlocks("b", keys[:1], host, uport, batch, seg.name.upper(), seg.nbytes),
    ]
    async with RpcClient(RpcConfig(), "127.0.0.1", port, role="test", node_id="bad",
                         reply_type=GatewayReply, kv_fingerprint=spec.fingerprint()) as rpc:
        for msg in bad:
            with pytest.raises(InvalidArgument):
                await rpc.call(msg, 10.0)
        with pytest.raises(InvalidArgument):
            await rpc.call(ShmFence("/dev/shm/x", "b"), 10.0)
        absent = "dualpath-" + "0" * 32                  # well-formed, not there: not ours
        reply = await rpc.call(ReadBlocks("b", keys[:1], host, uport, batch, absent, seg.nbytes), 10.0)
        assert isinstance(reply, ShmUnavailable) and "does not exist" in reply.reason
        assert (await rpc.call(ShmFence(seg.name, "nothing"), 10.0)).waited == 0
    with pytest.raises(InvalidArgument):                 # checked in the client too
        await client.read_blocks("b", keys[:1], [[(pool.arena.nbytes - 10, bb)]], 10.0)
    assert (pool.arena == 0x5A).all() and tree(tmp_path / "pstore") == before
    reply = await client.read_blocks("ok", keys[:1], block_slots(0, bb, 1), 10.0)
    assert reply.prefix_blocks == 1 and client.shm_active     # the gateway serves on


@pytest.mark.slow
@pytest.mark.reliability
async def test_falls_back_to_ucx_when_the_gateway_cannot_see_the_segment(tmp_path, reliability):
    """A segment outside the gateway's /dev/shm (another container): ShmUnavailable → UCX."""
    spec = PRESETS["test-small"]
    with gateway_process(tmp_path, "test-small") as (proc, ready):
        hidden = tmp_path / "private-shm"                # stands for another container's /dev/shm
        hidden.mkdir()
        seg = shm.ShmSegment.create(16 * BB, directory=str(hidden), sweep=False)
        try:
            async with PageTransport(TCFG, "req") as tr:
                client = GatewayClient.connect(RpcConfig(), "127.0.0.1", ready["rpc_port"], tr,
                                               seg.array, spec, node_id="req")
                async with client:
                    keys, data = chain(6), blocks(6, seed=2)
                    await client.write_blocks("w", keys, data, 20.0)
                    seg.array[:] = 0xAB
                    for rid in ("r1", "r2"):
                        reply = await client.read_blocks(rid, keys, block_slots(BB, BB, 6), 20.0,
                                                         batch_bytes=2 * BB)
                        assert reply.prefix_blocks == 6
                        assert np.array_equal(seg.array[BB:7 * BB], np.concatenate(data))
                        assert (seg.array[:BB] == 0xAB).all()
                    assert not client.shm_active
                    assert client.counts == {"shm_reads": 0, "ucx_reads": 2, "shm_fallbacks": 1,
                                             "shm_fences": 0}
                    stats = await client.stats()
                    assert stats["shm_unavailable"] == 1 and stats["reads_ok"] == 2
                    assert stats["transport_bytes_sent"] >= 12 * BB
        finally:
            seg.close()
        assert proc.poll() is None
    reliability.record("fault", "shm segment not reachable from the gateway",
                       "ShmUnavailable, client falls back to UCX once and remembers", lost=0)


async def test_shm_disabled_on_the_gateway_falls_back(tmp_path):
    async with cluster(tmp_path, gateway={"shm": False}) as c:
        keys, data = chain(3), blocks(3, seed=4)
        await c.client.write_blocks("w", keys, data, 10.0)
        pool = PagePool(64 * 1024, 8, name="req", shm=True)
        try:
            client = GatewayClient.connect(c.cfg.rpc, "127.0.0.1", c.gw.rpc_port, c.tr, pool.arena,
                                           SPEC, node_id="r")
            async with client:
                reply = await client.read_blocks("r", keys, block_slots(0, BB, 3), 10.0)
                assert reply.prefix_blocks == 3 and client.counts["shm_fallbacks"] == 1
                assert np.array_equal(pool.arena[:3 * BB], np.concatenate(data))
            forced = GatewayClient.connect(c.cfg.rpc, "127.0.0.1", c.gw.rpc_port, c.tr, pool.arena,
                                           SPEC, node_id="r2", shm=False)
            assert not forced.shm_active
            await forced.close()
        finally:
            pool.close()
        assert c.gw.status is Status.RUNNING and c.gw.counters()["shm_reads"] == 0
