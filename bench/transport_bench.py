"""``dualpath bench transport``: our page path vs raw ucxx tag messages vs memcpy.

Two processes on loopback: this one receives (and times), a child (``--child``) sends. Both
run two PageTransports: ``direct`` (``pack_below_bytes = 0``: one message per page, the
per-size comparison) and ``packed`` (the defaults: small non-contiguous pages packed).

* raw ucxx: ``Endpoint.send/recv(force_tag=True)`` on the same endpoint and progress driver,
  into the same preposted arena views, ``inflight`` messages per lock-step batch;
* page path: ``PageTransport.expect`` / ``send`` over gapped slots (no merging possible);
* memcpy: ``np.copyto`` into a warm destination (the single-thread ceiling).

Raw and page phases alternate (drift hits both); GB/s columns are the best of ``reps``, the
``ratio`` is the median of the per-rep page/raw ratios (paired, so a noisy moment on this
shared 2-core host hits both sides of a pair). Headline: that ratio at 1 MiB pages, 8 in
flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

from common.service import run
from bench.report import (bench_parser, headline, print_table, read_json, send_json,
                          write_results)
from common.config import TransportConfig
from common.logging import configure_logging
from common.transport import PageTransport

KIB, MIB = 1024, 1024 * 1024
LAYER_BLOCK = 41_984              # DeepSeek-V3.2 Layer Block: 64 tokens x 656 B
REQUEST = (61, 128)               # DeepSeek-V3.2, 8,192 tokens: 61 layers x 128 blocks
SIZES = [4 * KIB, LAYER_BLOCK, 256 * KIB, MIB, 4 * MIB, 16 * MIB]
GAP = 4096
CONFIGS = {"direct": {"pack_below_bytes": 0}, "packed": {}}
ROOT = Path(__file__).resolve().parents[1]


HOST_ENV = "DUALPATH_BENCH_TRANSPORT_HOST"   # bench multihost: this namespace host's address


def transport_config(kind: str) -> TransportConfig:
    host = os.environ.get(HOST_ENV, "127.0.0.1")
    return TransportConfig(max_inflight_messages=8, host=host, **CONFIGS[kind])


def layout(kind: str, size: int, count: int) -> list[tuple[int, int]]:
    """``gapped``: pages with a gap between (never merged); ``request``: layer-major, contiguous."""
    if kind == "request":
        return [(i * size, size) for i in range(count)]
    return [(i * (size + GAP), size) for i in range(count)]


def span(slots: list[tuple[int, int]]) -> int:
    return max(o + n for o, n in slots)


# ---------------------------------------------------------------- child (sender)

class Sender:
    def __init__(self, transports: dict[str, PageTransport]) -> None:
        self.t = transports
        self.src = np.empty(0, np.uint8)

    def source(self, nbytes: int) -> np.ndarray:
        if self.src.nbytes < nbytes:
            self.src = np.full(nbytes, 7, np.uint8)
        return self.src[:nbytes]

    async def raw(self, cmd: dict) -> None:
        ep = await self.t[cmd["cls"]].endpoint(tuple(cmd["peer"]))
        size, count, inflight, base = cmd["size"], cmd["count"], cmd["inflight"], cmd["tid"] << 20
        src = self.source(size * cmd["cycle"])  # as much source memory as the page path reads
        views = [src[j * size:(j + 1) * size] for j in range(cmd["cycle"])]
        for start in range(0, count, inflight):
            n = min(inflight, count - start)
            await asyncio.gather(*(ep.send(views[(start + j) % len(views)], tag=base | (start + j),
                                           force_tag=True) for j in range(n)))

    async def page(self, cmd: dict) -> None:
        slots = layout(cmd["layout"], cmd["size"], cmd["count"])
        src = [self.source(sum(n for _, n in slots))]
        transport, peer = self.t[cmd["cls"]], tuple(cmd["peer"])
        for tid in cmd["tids"]:
            await transport.send(peer, tid, src, slots, 60.0, inflight=cmd["inflight"])


async def child_main() -> None:
    configure_logging("warning", json=False)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transports = {k: PageTransport(transport_config(k), f"bench-sender-{k}") for k in CONFIGS}
    for t in transports.values():
        await t.start()
    sender = Sender(transports)
    sender.source(REQUEST[0] * REQUEST[1] * LAYER_BLOCK)  # the largest stream, warm
    print(json.dumps({k: list(t.address) for k, t in transports.items()}), flush=True)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            await getattr(sender, cmd["op"])(cmd)
            print(json.dumps({"done": cmd["op"]}), flush=True)
    finally:
        for t in transports.values():
            await t.stop()


# ---------------------------------------------------------------- parent (receiver)

class Bench:
    def __init__(self, quick: bool, child_prefix: list[str] | None = None) -> None:
        self.quick = quick
        self.child_prefix = child_prefix or []     # bench multihost: run the sender elsewhere
        self.reps = 3 if quick else 9
        self.t: dict[str, PageTransport] = {}
        self.child: subprocess.Popen | None = None
        self.peer: dict[str, tuple[str, int]] = {}
        self.arena = np.empty(0, np.uint8)

    async def __aenter__(self) -> Bench:
        self.child = subprocess.Popen([*self.child_prefix, sys.executable, "-m",
                                       "bench.transport_bench", "--child"],
                                      cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        for kind in CONFIGS:
            self.t[kind] = PageTransport(transport_config(kind), f"bench-receiver-{kind}")
            await self.t[kind].start()
        self.peer = {k: tuple(v) for k, v in (await self._reply()).items()}
        layers, blocks = REQUEST
        self.arena_for(layers * blocks * (LAYER_BLOCK + GAP))  # the largest layout used
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.child.poll() is None:
                self._command({"op": "exit"})
                self.child.wait(timeout=20)
        finally:
            if self.child.poll() is None:
                self.child.kill()
                self.child.wait()
            for t in self.t.values():
                await t.stop()

    def _command(self, cmd: dict) -> None:
        send_json(self.child, cmd)

    async def _reply(self) -> dict:
        return await read_json(self.child, "sender")

    def arena_for(self, nbytes: int) -> np.ndarray:
        if self.arena.nbytes < nbytes:  # a registered pool is allocated once and warm
            self.arena = np.empty(nbytes, np.uint8)
            self.arena[::4096] = 0
        return self.arena

    async def raw(self, cls: str, slots: list[tuple[int, int]], inflight: int, count: int) -> float:
        """GB/s of ``count`` raw tag messages into the slots (cycled), lock-step batches."""
        t, size = self.t[cls], slots[0][1]
        ep = await t.endpoint(self.peer[cls])
        arena, tid = self.arena_for(span(slots)), t.new_transfer_id()
        views = [arena[o:o + n] for o, n in slots]
        start = time.perf_counter()
        self._command({"op": "raw", "cls": cls, "peer": list(t.address), "size": size,
                       "count": count, "inflight": inflight, "tid": tid, "cycle": len(slots)})
        base = tid << 20
        for first in range(0, count, inflight):
            n = min(inflight, count - first)
            await asyncio.gather(*(ep.recv(views[(first + j) % len(views)], tag=base | (first + j),
                                           force_tag=True) for j in range(n)))
        elapsed = time.perf_counter() - start
        await self._reply()
        return size * count / elapsed / 1e9

    async def page(self, cls: str, kind: str, size: int, count: int, inflight: int,
                   transfers: int) -> float:
        """GB/s of ``transfers`` page-path transfers of ``count`` slots each."""
        t = self.t[cls]
        slots = layout(kind, size, count)
        arena, tids = self.arena_for(span(slots)), [t.new_transfer_id() for _ in range(transfers)]
        start = time.perf_counter()
        self._command({"op": "page", "cls": cls, "peer": list(t.address), "layout": kind,
                       "size": size, "count": count, "inflight": inflight, "tids": tids})
        for tid in tids:
            handle = await t.expect(self.peer[cls], tid, arena, slots, 60.0)
            await handle.wait()
        elapsed = time.perf_counter() - start
        await self._reply()
        return size * count * transfers / elapsed / 1e9

    async def best(self, *phases) -> list[dict]:
        """Warm up, then run the phases alternately ``reps`` times; GB/s of every rep."""
        for phase in phases:
            await phase()
        runs: list[list[float]] = [[] for _ in phases]
        for _ in range(self.reps):
            for i, phase in enumerate(phases):
                runs[i].append(await phase())
        return [{"best": max(r), "median": statistics.median(r), "runs": r} for r in runs]


def compare(raw: dict, page: dict) -> dict:
    """Columns of one page-vs-raw row: best GB/s of each, median of the paired ratios."""
    pairs = [p / r for p, r in zip(page["runs"], raw["runs"], strict=True)]
    return {"raw_gbps": raw["best"], "page_gbps": page["best"],
            "ratio": statistics.median(pairs), "ratio_of_best": page["best"] / raw["best"],
            "raw_median": raw["median"], "page_median": page["median"]}


def memcpy_gbps(size: int, quick: bool) -> float:
    src, dst = np.full(size, 3, np.uint8), np.zeros(size, np.uint8)
    reps = max(4, min(2000, (64 if quick else 256) * MIB // size))
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            np.copyto(dst, src)
        best = max(best, size * reps / (time.perf_counter() - start) / 1e9)
    return best


def per_size_plan(size: int, inflight: int, quick: bool) -> tuple[int, int]:
    """(messages per transfer, transfers per phase) for one page size."""
    per_phase = max(64, min(4096, 256 * MIB // size)) // (4 if quick else 1)
    per_transfer = max(inflight, min(1024, 64 * MIB // size))
    return per_transfer, max(1, per_phase // per_transfer)


async def run_sizes(b: Bench, quick: bool) -> list[dict]:
    rows = []
    for size in SIZES:
        copy = memcpy_gbps(size, quick)
        for inflight in (1, 8):
            if quick and size >= 4 * MIB and inflight == 1:
                continue
            count, transfers = per_size_plan(size, inflight, quick)
            slots = layout("gapped", size, count)
            raw, page = await b.best(
                partial(b.raw, "direct", slots, inflight, count * transfers),
                partial(b.page, "direct", "gapped", size, count, inflight, transfers))
            row = {"case": "pages", "page_bytes": size, "inflight": inflight,
                   **compare(raw, page), "memcpy_gbps": copy,
                   "msgs_per_s_page": page["best"] * 1e9 / size}
            if size < 256 * KIB and inflight == 8:
                packed, = await b.best(partial(b.page, "packed", "gapped", size, count, 8,
                                               transfers))
                row["packed_gbps"] = packed["best"]
            rows.append(row)
            print_table([row], COLUMNS)
    return rows


async def run_request(b: Bench) -> list[dict]:
    """A DeepSeek-V3.2 request (8,192 tokens) of Layer Blocks: page API vs raw 4 MiB."""
    layers, blocks = REQUEST
    count, total = layers * blocks, layers * blocks * LAYER_BLOCK
    raw_slots = [(o, 4 * MIB) for o in range(0, total - 4 * MIB + 1, 4 * MIB)]
    raw, contiguous, packed = await b.best(
        partial(b.raw, "packed", raw_slots, 8, len(raw_slots)),
        partial(b.page, "packed", "request", LAYER_BLOCK, count, 8, 1),
        partial(b.page, "packed", "gapped", LAYER_BLOCK, count, 8, 1))
    rows = []
    for name, r in (("request, contiguous slots", contiguous),
                    ("request, gapped slots (packed)", packed)):
        rows.append({"case": name, "page_bytes": LAYER_BLOCK, "inflight": 8,
                     **compare(raw, r)})
    return rows


COLUMNS = ["case", "page_bytes", "inflight", "raw_gbps", "page_gbps", "ratio", "memcpy_gbps",
           "packed_gbps"]


async def bench_main(quick: bool) -> tuple[list[dict], float]:
    async with Bench(quick) as b:
        rows = await run_sizes(b, quick)
        rows += await run_request(b)
    head = next(r for r in rows if r["case"] == "pages" and r["page_bytes"] == MIB
                and r["inflight"] == 8)
    return rows, head["ratio"]



def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("transport", __doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.child:
        run(child_main())
        return 0
    configure_logging("warning", json=False)
    start, load_before = time.perf_counter(), os.getloadavg()
    rows, ratio = run(bench_main(args.quick))
    print()
    print_table(rows, COLUMNS)
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"\n{time.perf_counter() - start:.1f} s, load average {load} — on a busy host both "
          "paths collapse (the spinning raw one first): compare runs from an idle host")
    write_results(args.out, "transport",
                  headline("page_path_vs_raw_ucxx", ratio, 0.90, higher_is_better=True),
                  {"rows": rows, "quick": args.quick, "loadavg": load})
    return 0


def argparse_hidden() -> str:
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
