"""Storage gateway as a service: RPC + UCX + store, in one process and across processes.

In-process tests run a GatewayService and a requester (its own PageTransport, arena and
GatewayClient) in the same event loop over real UCX on loopback. Multi-process tests run the
gateway as ``dualpath serve gateway`` or a bare receiver (``tests/gateway_proc.py``) that is
SIGKILLed part-way. Every process started here is stopped or killed by the end of its test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from common.config import RpcConfig, TransportConfig
from common.errors import (DeadlineExceeded, InvalidArgument, PeerFailed, Unavailable,
                           UnknownMessage)
from common.kv import PRESETS, KVSpec, block_keys_from_tokens, full_block_view
from common.protocol import (GatewayReply, GatewayRequest, LookupPrefix, ReadBatch, ReadBlocks,
                             WriteBlocks, union_members)
from common.rpc import RpcClient, check_handler_coverage
from common.service import Status
from common.transport import PageTransport
from tools.cluster.launcher import proc_cpu_seconds
from storage_gateway.block_format import HEADER_SIZE, QUARANTINE_DIR
from storage_gateway.client import GatewayClient, block_slots, layout_slots, plan_batches
from storage_gateway.config import GatewayConfig, GatewayServiceConfig
from storage_gateway.request_checks import check_read
from storage_gateway.service import GatewayNodeConfig, GatewayService
from tests.helpers import reap, until

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
SPEC = PRESETS["test-small"]          # 4 layers x 64 tokens x 256 B: 64 KiB Full Blocks
BB = SPEC.full_block_bytes
TCFG = TransportConfig(staging_bytes=16 * MiB)


def node_cfg(tmp_path: Path, gateway: dict | None = None, service: dict | None = None) -> GatewayNodeConfig:
    gw = {"root": str(tmp_path / "store"), "io_threads": 2, **(gateway or {})}
    svc = {"staging_bytes": 8 * MiB, "max_batch_bytes": 2 * MiB, **(service or {})}
    return GatewayNodeConfig(gateway=GatewayConfig(**gw), transport=TCFG,
                             gateway_service=GatewayServiceConfig(**svc))


def blocks(n: int, seed: int = 0, spec: KVSpec = SPEC) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, spec.full_block_bytes, dtype=np.uint8) for _ in range(n)]


def chain(n: int, start: int = 0, spec: KVSpec = SPEC) -> list[str]:
    return block_keys_from_tokens(np.arange(start, start + n * spec.block_tokens), spec.block_tokens)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*")}


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, spec: KVSpec = SPEC, **kw):
    """A gateway and one requester (transport, 8 MiB arena, client) in this event loop."""
    cfg = node_cfg(tmp_path, **kw)
    async with GatewayService(cfg, "gw0", spec=spec) as gw, PageTransport(TCFG, "req") as tr:
        arena = np.zeros(8 * MiB, np.uint8)
        client = GatewayClient.connect(cfg.rpc, "127.0.0.1", gw.rpc_port, tr, arena, spec,
                                       node_id="req")
        try:
            yield SimpleNamespace(gw=gw, tr=tr, arena=arena, client=client, cfg=cfg)
        finally:
            await client.close()
        assert gw.staging.pool.used_pages == 0, "staging leaked"
        gw.staging.pool.check_invariants()


def raw_client(c: SimpleNamespace, node_id: str = "raw") -> RpcClient:
    return RpcClient(c.cfg.rpc, "127.0.0.1", c.gw.rpc_port, role="test", node_id=node_id,
                     reply_type=GatewayReply)


# ---------------------------------------------------------------- pure parts

def test_every_gateway_request_has_a_handler(tmp_path):
    handlers = GatewayService(node_cfg(tmp_path), spec=SPEC).handlers()
    assert check_handler_coverage(handlers, GatewayRequest) == []
    assert set(handlers) == set(union_members(GatewayRequest))


def test_check_read_rejects_inconsistent_batches():
    svc = GatewayServiceConfig(staging_bytes=8 * MiB, max_batch_bytes=4 * BB)
    keys = chain(3)

    def check(batches, keys=keys, port=1234):
        return check_read(ReadBlocks("r", keys, "127.0.0.1", port, batches), SPEC, svc,
                          max_keys=8, max_bytes=6 * BB, max_message_bytes=MiB,
                          pack_below_bytes=256 * 1024)

    ok = check([ReadBatch(7, 2, [(0, 2 * BB)]), ReadBatch(8, 1, [(BB * 4, BB)])])
    assert [(p.first, p.keys, p.nbytes) for p in ok] == [(0, keys[:2], 2 * BB), (2, keys[2:], BB)]
    bad = [
        [ReadBatch(7, 2, [(0, 2 * BB)])],                                  # keys left over
        [ReadBatch(7, 3, [(0, 3 * BB - 1)])],                              # slots short
        [ReadBatch(7, 3, [(-4096, 3 * BB)])],                              # negative offset
        [ReadBatch(7, 0, []), ReadBatch(8, 3, [(0, 3 * BB)])],            # empty batch
        [ReadBatch(0, 3, [(0, 3 * BB)])],                                  # transfer id 0
        [ReadBatch(7, 1, [(0, BB)]), ReadBatch(7, 2, [(BB, 2 * BB)])],    # id reused
    ]
    for batches in bad:
        with pytest.raises(InvalidArgument):
            check(batches)
    with pytest.raises(InvalidArgument):                                   # above max_batch_bytes
        check([ReadBatch(7, 5, [(0, 5 * BB)])], keys=chain(5))
    with pytest.raises(InvalidArgument):                                   # above max_bytes
        check([ReadBatch(7, 4, [(0, 4 * BB)]), ReadBatch(8, 3, [(0, 3 * BB)])], keys=chain(7))
    with pytest.raises(InvalidArgument):                                   # bad requester port
        check([ReadBatch(7, 3, [(0, 3 * BB)])], port=0)
    with pytest.raises(InvalidArgument):                                   # malformed key
        check([ReadBatch(7, 3, [(0, 3 * BB)])], keys=[*keys[:2], "../" + keys[2][3:]])


def test_plan_batches_block_and_layer_major():
    slots = layout_slots(SPEC, 0, 4 * SPEC.block_tokens, 3)
    lb, row = SPEC.layer_block_bytes, 4 * SPEC.block_tokens * SPEC.kv_bytes_per_token_per_layer
    block_major = plan_batches(SPEC, slots, batch_bytes=2 * BB)
    assert [n for n, _ in block_major] == [2, 1]
    assert block_major[0][1][:2] == [(0, lb), (row, lb)]          # block 0: layer 0, layer 1
    layer_major = plan_batches(SPEC, slots, batch_bytes=2 * BB, layer_major=True)
    assert layer_major[0][1][:3] == [(0, lb), (lb, lb), (row, lb)]  # layer 0 of blocks 0, 1
    with pytest.raises(InvalidArgument):
        plan_batches(SPEC, [[(0, BB - 1)]], BB)


# ---------------------------------------------------------------- in-process, real UCX

async def test_write_read_round_trip_and_duplicates(tmp_path):
    async with cluster(tmp_path) as c:
        keys, data = chain(10), blocks(10)
        done = await c.client.write_blocks("w1", keys[:6] + keys[:1], data[:6] + data[:1], 10.0)
        assert (done.written, done.duplicates, done.nbytes) == (6, 1, 6 * BB)
        done = await c.client.write_blocks("w2", keys, data, 10.0)     # 6 stored: no-ops
        assert (done.written, done.duplicates) == (4, 6)
        before = tree(tmp_path / "store")
        done = await c.client.write_blocks("w3", keys, data, 10.0)
        assert (done.written, done.duplicates, done.nbytes) == (0, 10, 0)
        assert tree(tmp_path / "store") == before                    # nothing rewritten
        reply = await c.client.read_blocks("r1", keys, block_slots(4096, BB, 10), 10.0,
                                           batch_bytes=3 * BB)
        assert reply.found == [True] * 10 and reply.prefix_blocks == 10
        assert reply.nbytes == 10 * BB and reply.corrupt == 0
        for i in range(10):
            assert np.array_equal(c.arena[4096 + i * BB:4096 + (i + 1) * BB], data[i])
        dup = await c.client.read_blocks("r2", [keys[3], keys[3]], block_slots(0, BB, 2), 10.0)
        assert dup.found == [True, True] and np.array_equal(c.arena[BB:2 * BB], data[3])
        stats = await c.client.stats()
        assert stats["read_batches"] == 5 and stats["staging_pages_used"] == 0
        assert stats["blocks_written"] == 10 and stats["write_duplicates"] == 17


@pytest.mark.parametrize("layer_major", [False, True])
async def test_scatter_into_request_layout(tmp_path, layer_major):
    tokens = 12 * SPEC.block_tokens                       # request region [L, 12 x 64, B]
    async with cluster(tmp_path) as c:
        keys, data = chain(10), blocks(10, seed=3)
        await c.client.write_blocks("w", keys, data, 10.0)
        c.arena[:] = 0xAB
        base = 1000                                      # unaligned on purpose
        dests = layout_slots(SPEC, base, tokens, 10, first_block=1)
        reply = await c.client.read_blocks("r", keys, dests, 10.0, batch_bytes=4 * BB,
                                           layer_major=layer_major)
        assert reply.prefix_blocks == 10
        region = c.arena[base:base + SPEC.bytes_per_token * tokens].reshape(
            SPEC.num_layers, tokens, SPEC.kv_bytes_per_token_per_layer)
        t = SPEC.block_tokens
        for i in range(10):
            assert np.array_equal(region[:, (i + 1) * t:(i + 2) * t], full_block_view(data[i], SPEC))
        assert (region[:, :t] == 0xAB).all() and (region[:, 11 * t:] == 0xAB).all()
        assert c.tr.stats()["packed_messages"] >= 1       # small per-layer runs were packed


async def test_prefix_lookup_on_chained_keys(tmp_path):
    async with cluster(tmp_path) as c:
        keys, data = chain(8), blocks(8)
        await c.client.write_blocks("w", keys[:3] + keys[4:], data[:3] + data[4:], 10.0)
        assert (await c.client.lookup_prefix(keys)).hit_blocks == 3   # block 3 is a hole
        assert (await c.client.lookup_prefix(keys[:2])).hit_blocks == 2
        other = chain(8, start=1)                         # another prompt: other keys
        assert (await c.client.lookup_prefix(other)).hit_blocks == 0
        assert (await c.client.lookup_prefix([])).hit_blocks == 0
        await c.client.write_blocks("w2", keys[3:4], data[3:4], 10.0)
        reply = await c.client.lookup_prefix(keys)
        assert reply.hit_blocks == 8 and reply.read_q_tokens == 0


async def test_missing_and_corrupt_blocks_are_zero_filled_and_flagged(tmp_path):
    async with cluster(tmp_path) as c:
        keys, data = chain(6), blocks(6)
        await c.client.write_blocks("w", keys[:4] + keys[5:], data[:4] + data[5:], 10.0)
        path = Path(c.gw.store.backend.path_for(keys[1]))
        with open(path, "r+b") as f:                      # flip one payload byte
            f.seek(HEADER_SIZE + 1234)
            byte = f.read(1)[0]
            f.seek(HEADER_SIZE + 1234)
            f.write(bytes([byte ^ 0x40]))
        c.arena[:] = 0xAB
        reply = await c.client.read_blocks("r", keys, block_slots(0, BB, 6), 10.0, batch_bytes=2 * BB)
        assert reply.found == [True, False, True, True, False, True]
        assert (reply.prefix_blocks, reply.corrupt, reply.nbytes) == (1, 1, 4 * BB)
        for i in (1, 4):                                  # corrupt + never written: zeros
            assert not c.arena[i * BB:(i + 1) * BB].any()
        for i in (0, 2, 3, 5):
            assert np.array_equal(c.arena[i * BB:(i + 1) * BB], data[i])
        assert not path.exists() and list((tmp_path / "store" / QUARANTINE_DIR).glob(f"{keys[1]}.*"))
        stats = await c.client.stats()
        assert stats["checksum_failures"] == 1 and stats["quarantined"] == 1
        assert stats["blocks_zero_filled"] == 2
        assert (await c.client.lookup_prefix(keys)).hit_blocks == 1
        again = await c.client.read_blocks("r2", keys[:2], block_slots(0, BB, 2), 10.0)
        assert again.found == [True, False] and again.corrupt == 0   # now simply missing


async def test_invalid_input_gets_typed_errors_and_touches_nothing(tmp_path):
    gateway = {"max_keys_per_request": 16, "max_bytes_per_request": 12 * BB}
    async with cluster(tmp_path, gateway=gateway, service={"max_batch_bytes": 8 * BB}) as c:
        keys, data = chain(4), blocks(4)
        await c.client.write_blocks("w", keys, data, 10.0)
        before = tree(tmp_path / "store")
        host, port = c.tr.address
        good = keys[0]
        malformed = [good[:-1], good.upper(), "../" + good[3:], good[:16] + "/" + good[17:],
                     good[:-1] + "\x00", ""]
        requests = [LookupPrefix([good, k]) for k in malformed]
        requests += [ReadBlocks("r", [k], host, port, [ReadBatch(5, 1, [(0, BB)])]) for k in malformed]
        requests += [WriteBlocks("w", [k], host, port) for k in malformed]
        requests += [
            LookupPrefix(chain(17)),                                        # keys above limit
            ReadBlocks("r", chain(13), host, port,                           # bytes above limit
                       [ReadBatch(5 + i, 1, [(0, BB)]) for i in range(13)]),
            ReadBlocks("r", keys, host, port, [ReadBatch(5, 3, [(0, 3 * BB)])]),      # n_keys
            ReadBlocks("r", keys[:1], host, port, [ReadBatch(5, 1, [(0, BB + 1)])]),  # bytes
            ReadBlocks("r", keys[:1], host, port, [ReadBatch(0, 1, [(0, BB)])]),      # id
            ReadBlocks("r", keys, host, port, [ReadBatch(5, 4, [(0, 4 * BB)])] * 0),  # none
            WriteBlocks("w", chain(17, start=64), host, port),             # above 16 keys
            WriteBlocks("w", chain(12, start=64), host, port),             # > max_batch_bytes
        ]
        async with raw_client(c) as rpc:
            for msg in requests:
                with pytest.raises(InvalidArgument):
                    if isinstance(msg, WriteBlocks):
                        async for _ in rpc.stream(msg, 5.0):
                            pass
                    else:
                        await rpc.call(msg, 5.0)
            bad_body = msgspec.msgpack.encode({"t": "gw.lookup", "keys": 5})
            with pytest.raises(InvalidArgument):
                await rpc.call(msgspec.Raw(bad_body), 5.0)
            with pytest.raises(UnknownMessage):
                await rpc.call(msgspec.Raw(msgspec.msgpack.encode({"t": "gw.nope"})), 5.0)
            assert (await rpc.call(LookupPrefix(keys), 5.0)).hit_blocks == 4  # connection lives
        with pytest.raises(InvalidArgument):               # checked in the client, nothing posted
            await c.client.read_blocks("r", [good, "zz"], block_slots(0, BB, 2), 5.0)
        assert tree(tmp_path / "store") == before
        assert c.gw.status is Status.RUNNING
        async with PageTransport(TCFG, "req2") as tr2:     # a second requester is unaffected
            arena2 = np.zeros(4 * BB, np.uint8)
            other = GatewayClient.connect(c.cfg.rpc, "127.0.0.1", c.gw.rpc_port, tr2, arena2,
                                          SPEC, node_id="req2")
            async with other:
                reply = await other.read_blocks("ok", keys, block_slots(0, BB, 4), 10.0)
                assert reply.prefix_blocks == 4 and np.array_equal(arena2[BB:2 * BB], data[1])
        reply = await c.client.read_blocks("ok2", keys, block_slots(0, BB, 4), 10.0)
        assert reply.prefix_blocks == 4


async def test_telemetry_shows_read_q_during_a_shaped_read(tmp_path):
    shaped = {"link_rate_bytes_per_s": 2e6, "link_burst_bytes": BB, "link_chunk_bytes": BB}
    async with cluster(tmp_path, gateway=shaped) as c:
        keys = chain(12)
        await c.client.write_blocks("w", keys, blocks(12), 30.0)   # 768 KiB at 2 MB/s: ~0.4 s
        seen: list[int] = []

        async def watch() -> None:
            async for event in c.client.watch_telemetry(0.02):
                assert event.node_id == "gw0"
                seen.append(event.read_q_tokens)

        watcher = asyncio.create_task(watch())
        await until(lambda: seen, what="first telemetry event")
        reply = await c.client.read_blocks("r", keys, block_slots(0, BB, 12), 20.0, batch_bytes=3 * BB)
        assert reply.prefix_blocks == 12
        await until(lambda: seen[-1] == 0, what="read_q back to 0")
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        assert max(seen) > 0 and max(seen) <= 12 * SPEC.block_tokens
        stats = await c.client.stats()
        assert stats["telemetry_events"] >= len(seen) and stats["read_q_tokens"] == 0


async def test_deadline_and_cancelled_requester_free_staging(tmp_path):
    shaped = {"link_rate_bytes_per_s": 1e6, "link_burst_bytes": BB, "link_chunk_bytes": BB}
    async with cluster(tmp_path, gateway=shaped) as c:
        keys = chain(8)
        await c.client.write_blocks("w", keys, blocks(8), 30.0)     # 512 KiB at 1 MB/s
        with pytest.raises(DeadlineExceeded):
            await c.client.read_blocks("late", keys, block_slots(0, BB, 8), 0.2, batch_bytes=BB)
        await until(lambda: c.gw.staging.pool.used_pages == 0, what="staging freed (deadline)")
        sent = c.gw.counters()["read_batches"]
        task = asyncio.create_task(c.client.read_blocks("gone", keys, block_slots(0, BB, 8), 20.0,
                                                        batch_bytes=BB))
        await until(lambda: c.gw.counters()["read_batches"] >= sent + 2, what="two batches sent")
        task.cancel()                                    # the requester leaves mid-read
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: c.gw.counters()["reads_failed"] == 2, what="read cancelled")
        await until(lambda: c.gw.staging.pool.used_pages == 0, what="staging freed (cancel)")
        assert c.gw.read_q == 0 and c.tr.stats()["transfers_active"] == 0
        reply = await c.client.read_blocks("after", keys[:2], block_slots(0, BB, 2), 10.0)
        assert reply.prefix_blocks == 2


# ---------------------------------------------------------------- multiple processes

@contextlib.contextmanager
def gateway_process(tmp_path: Path, preset: str):
    """``dualpath serve gateway`` for ``preset`` on a store under ``tmp_path``."""
    with run_gateway(tmp_path, f'[kv]\npreset = "{preset}"\n[gateway]\n'
                     f'root = "{tmp_path / "pstore"}"\nio_threads = 2\n[gateway_service]\n'
                     f'staging_bytes = {64 * MiB}\n[transport]\nstaging_bytes = {16 * MiB}\n'
                     '[logging]\nlevel = "warning"\n', "gwp") as out:
        yield out


@contextlib.contextmanager
def run_gateway(tmp_path: Path, config_toml: str, node: str):
    """A gateway process with this config; yields ``(proc, ready line)``, killed at exit.
    Its log is appended to ``tmp_path/gateway.log`` (restarts keep the earlier lines)."""
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(config_toml)
    with open(tmp_path / "gateway.log", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tools.cluster.serve", "gateway", "-c",
                                 str(cfg), "--node", node, "--port", "0"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        assert ready.get("event") == "ready", (tmp_path / "gateway.log").read_text()
        yield proc, ready
    finally:
        reap(proc)


@pytest.mark.slow
async def test_round_trip_with_gateway_process(tmp_path):
    spec = PRESETS["deepseek-v3.2"]                      # 2.56 MB Full Blocks
    with gateway_process(tmp_path, "deepseek-v3.2") as (proc, ready):
        async with PageTransport(TCFG, "req") as tr:
            arena = np.zeros(8 * spec.full_block_bytes, np.uint8)
            client = GatewayClient.connect(RpcConfig(), "127.0.0.1", ready["rpc_port"], tr, arena,
                                           spec, node_id="req")
            async with client:
                assert (await client.gateway_ucx())[1] == ready["ucx_port"]
                keys, data = chain(6, spec=spec), blocks(6, seed=9, spec=spec)
                done = await client.write_blocks("w", keys, data, 20.0)
                assert done.written == 6
                tokens = 8 * spec.block_tokens
                reply = await client.read_blocks("r", keys, layout_slots(spec, 0, tokens, 6), 20.0,
                                                 batch_bytes=2 * spec.full_block_bytes,
                                                 layer_major=True)
                assert reply.prefix_blocks == 6
                region = arena[:spec.bytes_per_token * tokens].reshape(spec.num_layers, tokens, -1)
                t = spec.block_tokens
                for i in range(6):
                    assert np.array_equal(region[:, i * t:(i + 1) * t], full_block_view(data[i], spec))
                arena[:] = 0
                reply = await client.read_blocks("r2", keys, block_slots(0, spec.full_block_bytes, 6),
                                                 20.0, batch_bytes=3 * spec.full_block_bytes)
                assert np.array_equal(arena[:6 * spec.full_block_bytes], np.concatenate(data))
                stats = await client.stats()
                assert stats["staging_pages_used"] == 0 and stats["reads_ok"] == 2
                cpu0, t0 = proc_cpu_seconds(proc.pid), time.monotonic()
                await asyncio.sleep(1.0)                  # time passes: idle gateway, live connections
                assert (proc_cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0) < 0.10
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


class Receiver:
    """``tests/gateway_proc.py``: the UCX side of a requester, in a process we can kill."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.gateway_proc"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.read()
        self.address = tuple(ready["address"])

    def read(self) -> dict:
        return json.loads(self.proc.stdout.readline() or "{}")

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.mark.slow
async def test_requester_killed_mid_read_fails_send_and_frees_staging(tmp_path):
    shaped = {"link_rate_bytes_per_s": 1e6, "link_burst_bytes": BB, "link_chunk_bytes": BB}
    async with cluster(tmp_path, gateway=shaped) as c:
        keys = chain(8)
        await c.client.write_blocks("w", keys, blocks(8), 30.0)
        receiver = Receiver()
        try:
            receiver.send(op="new_ids", n=len(keys))
            tids = await asyncio.to_thread(lambda: receiver.read()["tids"])
            batches = [ReadBatch(tid, 1, [(i * BB, BB)]) for i, tid in enumerate(tids)]
            receiver.send(op="expect", peer=list(c.gw.ucx_address), arena_bytes=len(keys) * BB,
                          batches=[[b.transfer_id, b.slots] for b in batches], deadline=30.0)
            assert (await asyncio.to_thread(receiver.read))["event"] == "posted"
            async with raw_client(c) as rpc:
                read = asyncio.create_task(rpc.call(
                    ReadBlocks("doomed", keys, *receiver.address, batches), 20.0))
                await until(lambda: c.gw.counters()["read_batches"] >= 2, what="batches sent")
                receiver.kill()
                # The send of the next batch fails: endpoint down (PeerFailed) or, once the
                # transport dropped it, no way to reconnect (Unavailable).
                with pytest.raises((PeerFailed, Unavailable)):
                    await read
            await until(lambda: c.gw.staging.pool.used_pages == 0, what="staging freed")
            assert c.gw.counters()["reads_failed"] == 1
            assert c.gw.read_q == 0 and c.gw.status is Status.RUNNING
        finally:
            receiver.kill()
        reply = await c.client.read_blocks("next", keys[:3], block_slots(0, BB, 3), 10.0)
        assert reply.prefix_blocks == 3                  # the gateway serves others
