"""Storage core of the gateway, in-process (no network): read throughput vs plain pread,
blocks/s per KV spec, O_DIRECT cold reads, index memory per block, shaped-link accuracy.

Baseline, same run, same files, page cache warm: a plain single-threaded loop of
``os.preadv`` (header + payload) into a preallocated numpy buffer — no verification. The store
reads the same blocks through ``GatewayStore.read_blocks`` (queue, pins, xxh3 verification,
thread pool). Headline ``store_vs_pread`` = store GB/s ÷ pread GB/s (goal ≥ 0.80).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import numpy as np

from bench.report import bench_parser, headline, print_table, write_results
from common.kv import PRESETS, KVSpec
from common.logging import configure_logging
from storage_gateway.block_format import HEADER_SIZE
from storage_gateway.block_index import measure_bytes_per_block
from storage_gateway.config import GatewayConfig
from storage_gateway.link_shaper import LinkShaper
from storage_gateway.store import GatewayStore

MiB = 1 << 20
REQUEST_BYTES = 64 * MiB    # one ReadBlocks worth of blocks


async def _fill(store: GatewayStore, spec: KVSpec, n: int) -> list[str]:
    rng = np.random.default_rng(0)
    keys = [rng.bytes(16).hex() for _ in range(n)]
    payload = rng.integers(0, 256, spec.full_block_bytes, dtype=np.uint8)
    for i in range(0, n, 16):   # same payload, distinct keys: fill speed is not what we measure
        await store.write_blocks(keys[i:i + 16], [payload] * len(keys[i:i + 16]))
    return keys


def _request_dests(spec: KVSpec, request_bytes: int) -> list[np.ndarray]:
    """Per-block destinations in one request-sized region (as a requester's buffer would be)."""
    per = max(1, request_bytes // spec.full_block_bytes)
    region = np.ones(per * spec.full_block_bytes, np.uint8)   # touched: no page faults timed
    return [region[i * spec.full_block_bytes:(i + 1) * spec.full_block_bytes] for i in range(per)]


def _pread_gbps(paths: list[str], spec: KVSpec, repeats: int, request_bytes: int = REQUEST_BYTES) -> float:
    dests = _request_dests(spec, request_bytes)
    head = bytearray(HEADER_SIZE)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i, p in enumerate(paths):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.preadv(fd, [head, dests[i % len(dests)]], 0)
            finally:
                os.close(fd)
        best = max(best, len(paths) * spec.full_block_bytes / (time.perf_counter() - t0) / 1e9)
    return best


async def _store_gbps(store: GatewayStore, keys: list[str], spec: KVSpec, repeats: int,
                      request_bytes: int = REQUEST_BYTES) -> float:
    dests = _request_dests(spec, request_bytes)
    per = len(dests)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(keys), per):
            chunk = keys[i:i + per]
            res = await store.read_blocks(chunk, dests[:len(chunk)])
            assert all(res.found)
        best = max(best, len(keys) * spec.full_block_bytes / (time.perf_counter() - t0) / 1e9)
    return best


async def _one_spec(name: str, total_bytes: int, root: str, repeats: int) -> dict:
    spec = PRESETS[name]
    n = max(4, total_bytes // spec.full_block_bytes)
    threads = os.cpu_count() or 2
    cfg = GatewayConfig(root=root, io_threads=threads, max_keys_per_request=1 << 20)
    async with GatewayStore(cfg, spec) as store:
        keys = await _fill(store, spec, n)
        paths = [store.backend.path_for(k) for k in keys]
        _pread_gbps(paths, spec, 1)                                    # warm the page cache
        pread = _pread_gbps(paths, spec, repeats)
        gw = await _store_gbps(store, keys, spec, repeats)
    row = {"spec": name, "block_MB": spec.full_block_bytes / 1e6, "blocks": n,
           "pread_GBps": pread, "store_GBps": gw, "store_vs_pread": gw / pread,
           "store_blocks_per_s": gw * 1e9 / spec.full_block_bytes}
    async with GatewayStore(GatewayConfig(root=root, io_threads=threads, o_direct=True,
                                          max_keys_per_request=1 << 20), spec) as store:
        if store.backend.o_direct:
            row["odirect_cold_GBps"] = await _store_gbps(store, keys, spec, 1)
    shutil.rmtree(root, ignore_errors=True)
    return row


async def _shaped(rate: float, seconds: float, readers: int = 4) -> dict:
    shaper = LinkShaper(rate, burst_bytes=4 * MiB, chunk_bytes=1 * MiB)
    stop = time.monotonic() + seconds
    moved = [0] * readers

    async def reader(i: int) -> None:
        while time.monotonic() < stop:
            await shaper.acquire(4 * MiB)
            moved[i] += 4 * MiB

    t0 = time.monotonic()
    await asyncio.gather(*(reader(i) for i in range(readers)))
    measured = sum(moved) / (time.monotonic() - t0)
    return {"configured_MBps": rate / 1e6, "measured_MBps": measured / 1e6,
            "error_pct": 100 * (measured - rate) / rate, "seconds": seconds,
            "fairness_min_over_max": min(moved) / max(moved)}


async def run(quick: bool) -> tuple[dict, dict]:
    total = 64 * MiB if quick else 512 * MiB
    repeats = 2 if quick else 4
    base = tempfile.mkdtemp(prefix="gw-bench-", dir=".")
    rows = []
    try:
        for name in ("test-small", "deepseek-v3.2", "qwen2.5-32b"):
            rows.append(await _one_spec(name, total, os.path.join(base, name), repeats))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(rows, ["spec", "block_MB", "blocks", "pread_GBps", "store_GBps", "store_vs_pread",
                       "store_blocks_per_s", "odirect_cold_GBps"])
    index_bpb = measure_bytes_per_block(200_000)
    print(f"\nindex memory: {index_bpb:.1f} B per block (200k blocks, tracemalloc)")
    shaped = await _shaped(200e6, 2.0 if quick else 10.0)
    print(f"shaped link: configured {shaped['configured_MBps']:.0f} MB/s, measured "
          f"{shaped['measured_MBps']:.1f} MB/s over {shaped['seconds']:.0f} s "
          f"({shaped['error_pct']:+.2f}%), fairness {shaped['fairness_min_over_max']:.3f}")
    ratio = min(r["store_vs_pread"] for r in rows)
    return headline("store_vs_pread", ratio, 0.80), {
        "specs": rows, "index_bytes_per_block": index_bpb, "shaped_link": shaped}


def main(argv: list[str] | None = None) -> int:
    args = bench_parser("gateway-storage", __doc__.splitlines()[0]).parse_args(argv)
    configure_logging("warning", json=False)
    head, results = asyncio.run(run(args.quick))
    write_results(args.out, "gateway-storage", head, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
