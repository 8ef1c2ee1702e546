"""``dualpath bench kvpath``: the KV page path between two processes vs a memcpy from memory.

Two processes on one host: this one receives (and times), a child (``--child``) sends, both
over a ``PageTransport`` (the sender with ``kv_mode = "rma"``, else the production defaults).
Three receivers, three rows: ``shm``, the production default between processes of one host (the receiver's arena
is a ``/dev/shm`` segment, as node pools are: the sender copies each page straight into it,
one memcpy in a worker thread, one COMMIT per transfer), ``tag`` (a receiver with
``same_host = "ucx"`` and a private arena: UCX tag messages over UCX shared memory, two copies;
the opt-in single-copy endpoint off) and ``rma`` (a receiver with ``same_host = "ucx"``,
``kv_mode = "rma"`` and a private arena registered with UCX: the sender puts each page into
it, one-sided, then flushes and commits; here the puts go over tcp/lo — no verbs in the PyPI
UCX — docs/datapath.md "One-sided RMA"). A transfer is ``PAGES`` pages of 1 MiB (8 in flight on
``tag``) into slots with a 4 KiB gap between pages (so no two pages merge into one message:
every page is its own UCX message or copy, as pool pages are). The receiver expects every
transfer of a phase at once and the sender has ``SEND_LANES`` transfers in flight, as a node
forwarding several requests does; ``sender_cpu_s_per_gb`` is what the bytes cost the sender.

Baseline, measured in the same run and interleaved with the page phases: ``np.copyto`` of the
same bytes, 1 MiB at a time, between two buffer sets four times the last-level cache, visited
in rotation so neither side is cache-resident (what a page really costs: the sender's source
and the receiver's pool are main memory; a re-copied warm buffer measures the cache instead).
Sender and receiver rotate over as many regions, for the same reason.

``verified``: after each timed phase, every destination region is compared (xxh3) with the
source the sender last put there; the bytes so checked are reported, and a mismatch fails the
run. Rows ``shm``, ``tag`` and ``rma``; again with a third process busy on one core (``busy``). Also
4 KiB pages/s (``tag`` packs small non-contiguous pages; ``shm`` copies each one).

The peer row ``nixl`` (idle only, where ``make nixl`` installed it): the same pages, regions
and checks moved by NIXL's UCX backend WRITE between two processes of its own
(``bench.nixl_peer``); without NIXL the JSON says why there is no row.

Headline ``kv_path_vs_memcpy``: the ``shm`` row (the production default path where it
applies): the median of the per-rep ratios page path ÷ memcpy (paired,
so a noisy moment on this shared 2-core host hits both sides of a pair); goal 0.80, and 0.60
with the busy core (reported beside it, against the memcpy measured under the same load).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import xxhash

from bench.report import (Spinner, bench_parser, headline, print_table, read_json, send_json,
                          write_results)
from common.config import TransportConfig
from common.logging import configure_logging
from common.service import run
from common.shm import ShmSegment
from common.transport import PageTransport
from tools.cluster.launcher import proc_cpu_seconds

KIB, MIB = 1024, 1024 * 1024
PAGE = MIB
SMALL = 4 * KIB
INFLIGHT = 8
SEND_LANES = 2                 # transfers the sender has in flight at once
GAP = 4 * KIB
PAGES = 32                     # pages per transfer (32 MiB)
REGIONS = 4                    # regions rotated on each side: 4 x 32 MiB = 4x a 32 MiB LLC
SMALL_PAGES = 1024             # 4 KiB pages per small transfer
SMALL_TRANSFERS = 16           # transfers per 4 KiB phase
COPY_SET = REGIONS * PAGES * PAGE
ROOT = Path(__file__).resolve().parents[1]


def slots_of(size: int, count: int) -> list[tuple[int, int]]:
    """``count`` pages of ``size`` with a gap after each: never merged into one message."""
    return [(i * (size + GAP), size) for i in range(count)]


def region_bytes(size: int, count: int) -> int:
    return count * (size + GAP)


def source_region(r: int, nbytes: int) -> np.ndarray:
    """The sender's region ``r``: seeded random bytes both processes can regenerate."""
    return np.random.default_rng(1000 + r).integers(0, 256, nbytes, dtype=np.uint8)


# ---------------------------------------------------------------- child (sender)

async def child_main() -> None:
    configure_logging("warning", json=False)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    # kv_mode "rma": the rma receiver gets puts; the others still choose shm / tags (their
    # hellos do not offer RMA)
    transport = PageTransport(TransportConfig(kv_mode="rma"), "bench-kvpath-sender")
    await transport.start()
    sources = [source_region(r, PAGES * PAGE) for r in range(REGIONS)]
    print(json.dumps({"address": list(transport.address)}), flush=True)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            await send_phase(transport, sources, cmd)
            print(json.dumps({"done": len(cmd["tids"])}), flush=True)
    finally:
        await transport.stop()


async def send_phase(transport: PageTransport, sources: list[np.ndarray], cmd: dict) -> None:
    """Send one phase's transfers, ``SEND_LANES`` at a time, as a node forwarding several
    requests does: the next one's set-up overlaps this one's copy."""
    peer, size, count = tuple(cmd["peer"]), cmd["size"], cmd["count"]
    slots = slots_of(size, count)
    lanes = asyncio.Semaphore(SEND_LANES)

    async def send(k: int, tid: int) -> None:
        async with lanes:
            src = sources[(cmd["first"] + k) % REGIONS][:size * count]
            await transport.send(peer, tid, [src], slots, 60.0, inflight=INFLIGHT)

    await asyncio.gather(*(send(k, tid) for k, tid in enumerate(cmd["tids"])))


# ---------------------------------------------------------------- parent (receiver)

class Sender:
    """The child process that sends (one transport, to either receiver)."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.peer: tuple[str, int] = ("", 0)

    async def __aenter__(self) -> Sender:
        self.child = subprocess.Popen([sys.executable, "-m", "bench.kvpath_bench", "--child"],
                                      cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        self.peer = tuple((await read_json(self.child, "sender"))["address"])
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.child is None:
            return
        try:
            if self.child.poll() is None:
                send_json(self.child, {"op": "exit"})
                self.child.wait(timeout=20)
        finally:
            if self.child.poll() is None:
                self.child.kill()
                self.child.wait()


class Receiver:
    """One receiving transport of this process and its REGIONS destination regions: ``shm``
    (a /dev/shm arena the sender copies into), ``tag`` (private memory, UCX messages) or
    ``rma`` (private memory registered with UCX, the sender puts into it)."""

    def __init__(self, path: str, sender: Sender, expected: list[int]) -> None:
        self.path, self.sender, self.expected = path, sender, expected
        self.span = region_bytes(PAGE, PAGES)
        self.segment = ShmSegment.create(REGIONS * self.span) if path == "shm" else None
        self.arena = self.segment.array if self.segment is not None \
            else np.zeros(REGIONS * self.span, np.uint8)
        cfg = {"shm": TransportConfig(),
               "tag": TransportConfig(same_host="ucx", kv_mode="tag"),
               "rma": TransportConfig(same_host="ucx", kv_mode="rma")}[path]
        self.transport = PageTransport(cfg, f"bench-kvpath-receiver-{path}",
                                       shm_arena=self.arena if path != "tag" else None)
        self.sent = 0                      # transfers so far: region of the next = sent % REGIONS
        self.last: dict[int, int] = {}     # destination region → source region last put there
        self.verified = 0

    async def __aenter__(self) -> Receiver:
        await self.transport.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.transport.stop()
        if self.segment is not None:
            self.segment.close()

    @property
    def child(self) -> subprocess.Popen:
        assert self.sender.child is not None
        return self.sender.child

    @property
    def peer(self) -> tuple[str, int]:
        return self.sender.peer

    async def transfers(self, size: int, count: int, n: int) -> float:
        """Seconds for ``n`` transfers of ``count`` pages of ``size``, each into the next region."""
        slots = slots_of(size, count)
        tids = [self.transport.new_transfer_id() for _ in range(n)]
        first = self.sent
        t0 = time.perf_counter()
        send_json(self.child, {"op": "send", "peer": list(self.transport.address), "size": size,
                               "count": count, "tids": tids, "first": first})
        # every transfer of the phase is expected at once, as a node with several requests in
        # flight does (each lands in its own region); the sender still sends them one by one
        handles = []
        for k, tid in enumerate(tids):
            region = (first + k) % REGIONS
            base = region * self.span
            handles.append(await self.transport.expect(
                self.peer, tid, self.arena[base:base + self.span], slots, 60.0))
            self.last[region] = (first + k) % REGIONS if size * count == PAGES * PAGE else -1
        for handle in handles:
            await handle.wait()
        elapsed = time.perf_counter() - t0
        await read_json(self.child, "sender")
        self.sent += n
        return elapsed

    def verify(self) -> int:
        """Compare each destination region with the source last sent into it; bytes checked."""
        checked = 0
        for region, src in self.last.items():
            if src < 0:
                continue
            base = region * self.span
            pages = [self.arena[base + o:base + o + n] for o, n in slots_of(PAGE, PAGES)]
            h = xxhash.xxh3_64()
            for p in pages:
                h.update(p)
            if h.intdigest() != self.expected[src]:
                raise RuntimeError(f"kvpath: region {region} does not hold source {src}: "
                                   "the page path delivered wrong bytes")
            checked += PAGES * PAGE
        self.verified += checked
        return checked


class Memcpy:
    """1 MiB copies between two buffer sets of 4x the LLC, visited in rotation."""

    def __init__(self) -> None:
        self.src = np.random.default_rng(7).integers(0, 256, COPY_SET, dtype=np.uint8)
        self.dst = np.zeros(COPY_SET, np.uint8)
        self.pos = 0

    def seconds(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        for _ in range(nbytes // PAGE):
            s = self.pos % COPY_SET
            d = (self.pos + COPY_SET // 2) % COPY_SET   # not the same offset as the source
            np.copyto(self.dst[d:d + PAGE], self.src[s:s + PAGE])
            self.pos += PAGE
        return time.perf_counter() - t0


async def paired(reps: int, page: Callable[[], Awaitable[float]], copy: Callable[[], float],
                 nbytes: int) -> dict:
    """Warm-up, then ``reps`` page/memcpy pairs (order alternating); GB/s and the ratio."""
    await page()
    copy()
    pages, copies = [], []
    for r in range(reps):
        if r % 2:
            copies.append(copy())
            pages.append(await page())
        else:
            pages.append(await page())
            copies.append(copy())
    return {"gbps": nbytes / min(pages) / 1e9, "memcpy_gbps": nbytes / min(copies) / 1e9,
            "vs_memcpy": statistics.median(c / p for p, c in zip(pages, copies)),
            "runs_gbps": [nbytes / p / 1e9 for p in pages]}


async def measure(quick: bool) -> list[dict]:
    reps = 5 if quick else 11
    n = REGIONS * (1 if quick else 2)            # transfers per phase
    nbytes = n * PAGES * PAGE
    copy = Memcpy()
    expected = [xxhash.xxh3_64_intdigest(source_region(r, PAGES * PAGE)) for r in range(REGIONS)]
    rows = []
    async with Sender() as sender, Receiver("shm", sender, expected) as shm, \
            Receiver("tag", sender, expected) as tag, Receiver("rma", sender, expected) as rma:
        for load in ("idle", "busy"):
            with Spinner() if load == "busy" else contextlib.nullcontext():
                await asyncio.sleep(0.2 if load == "busy" else 0)
                for rx in (shm, tag, rma):
                    rows.append(await measure_row(rx, load, reps, n, nbytes, copy, quick))
                    print_table([rows[-1]], COLUMNS)
        for rx in (shm, tag, rma):
            stats = rx.transport.stats()
            row = next(r for r in rows if r["path"] == rx.path)
            for key in ("shm_links", "shm_bytes_received", "single_copy_links", "rma_links",
                        "rma_bytes_received", "messages_received"):
                row[key] = stats[key]
        for rx, key in ((shm, "shm_transfers_received"), (rma, "rma_transfers_received")):
            if rx.transport.stats()[key] == 0:
                raise RuntimeError(f"kvpath: the {rx.path} receiver got no transfer by "
                                   f"{rx.path}: that path did not apply between these processes")
    return rows


async def measure_row(rx: Receiver, load: str, reps: int, n: int, nbytes: int, copy: Memcpy,
                      quick: bool) -> dict:
    """One row: ``n`` transfers of 32 MiB per rep against memcpy, then 4 KiB pages/s."""
    checked = 0

    async def page() -> float:
        nonlocal checked
        s = await rx.transfers(PAGE, PAGES, n)
        checked += rx.verify()           # outside the timed window
        return s

    sender_cpu0 = proc_cpu_seconds(rx.child.pid)
    row = await paired(reps, page, lambda: copy.seconds(nbytes), nbytes)
    # what the bytes cost in CPU: the sending process's CPU seconds per GB over the page
    # phases (warm-up included; the one-copy path copies with two threads) beside the
    # memcpy's (one thread: its CPU is its time)
    moved_gb = (reps + 1) * nbytes / 1e9
    row["sender_cpu_s_per_gb"] = (proc_cpu_seconds(rx.child.pid) - sender_cpu0) / moved_gb
    row["memcpy_cpu_s_per_gb"] = 1 / row["memcpy_gbps"]
    # 16 transfers in both modes: a phase is timed from the command to the sender (a pipe
    # round trip and the child's wake-up) to the last commit, and with 4 transfers (5 ms)
    # that fixed part was a fifth of it and the spread 0.73–1.18M pages/s between phases
    small_pages = SMALL_PAGES * SMALL_TRANSFERS
    small = min([await rx.transfers(SMALL, SMALL_PAGES, small_pages // SMALL_PAGES)
                 for _ in range(3)])
    return {"path": rx.path, "load": load, "page_bytes": PAGE, "inflight": INFLIGHT, **row,
            "verified": checked, "pages_per_s_4k": small_pages / small,
            "loadavg_1m": os.getloadavg()[0]}


def nixl_row(quick: bool, idle_memcpy_gbps: float) -> dict | str:
    """The ``nixl`` row (``bench.nixl_peer``, its own two processes), or why there is none.
    Its ``vs_memcpy`` is paired with memcpys in the NIXL initiator, which runs beside the
    target's spinning progress thread; ``vs_idle_memcpy`` divides by the ``shm`` row's idle
    memcpy instead (the fair anchor on this 2-core host)."""
    from bench.nixl_peer import MARK, NIXL_MODULE
    if importlib.util.find_spec(NIXL_MODULE) is None:
        return f"{NIXL_MODULE} not installed (make nixl)"
    n = REGIONS * (1 if quick else 2)
    proc = subprocess.run([sys.executable, "-m", "bench.nixl_peer", "--reps",
                           str(5 if quick else 11), "--transfers", str(n), "--small-pages",
                           str(SMALL_PAGES * SMALL_TRANSFERS)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"kvpath: the nixl row failed ({proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    row = json.loads(lines[-1][len(MARK):])
    row["vs_idle_memcpy"] = row["gbps"] / idle_memcpy_gbps
    return row


COLUMNS = ["path", "load", "page_bytes", "inflight", "gbps", "memcpy_gbps", "vs_memcpy",
           "sender_cpu_s_per_gb", "memcpy_cpu_s_per_gb", "verified", "pages_per_s_4k",
           "loadavg_1m"]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("kvpath", __doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.child:
        run(child_main())
        return 0
    configure_logging("warning", json=False)
    start, load_before = time.perf_counter(), os.getloadavg()
    rows = run(measure(args.quick))
    print()
    print_table(rows, COLUMNS)
    idle = next(r for r in rows if r["load"] == "idle" and r["path"] == "shm")
    busy = next(r for r in rows if r["load"] == "busy" and r["path"] == "shm")
    tag = {r["load"]: r["vs_memcpy"] for r in rows if r["path"] == "tag"}
    rma = {r["load"]: r["vs_memcpy"] for r in rows if r["path"] == "rma"}
    nixl = nixl_row(args.quick, idle["memcpy_gbps"])
    if isinstance(nixl, dict):
        print_table([nixl], [*COLUMNS, "target_cpu_s_per_gb", "vs_idle_memcpy"])
        rows.append(nixl)
    else:
        print(f"\nno nixl row: {nixl}")
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"\n{time.perf_counter() - start:.1f} s, load average {load}; busy: "
          f"kv_path_vs_memcpy {busy['vs_memcpy']:.3g} (goal >= 0.60) — this host is shared: "
          "compare runs from an idle host")
    results = {"rows": rows, "kv_path_vs_memcpy_busy": busy["vs_memcpy"],
               "tag_vs_memcpy": tag["idle"], "tag_vs_memcpy_busy": tag["busy"],
               "rma_vs_memcpy": rma["idle"], "rma_vs_memcpy_busy": rma["busy"],
               "nixl": nixl if isinstance(nixl, str) else {
                   "gbps": nixl["gbps"], "vs_idle_memcpy": nixl["vs_idle_memcpy"],
                   "pages_per_s_4k": nixl["pages_per_s_4k"]},
               "pages_per_s_4k": idle["pages_per_s_4k"], "quick": args.quick, "loadavg": load,
               "settings": {"page_bytes": PAGE, "inflight": INFLIGHT, "pages_per_transfer": PAGES,
                            "regions": REGIONS, "copy_set_bytes": COPY_SET,
                            "transport": "TransportConfig() defaults: shm (headline), "
                                         "and tag with same_host = 'ucx'",
                            "cpus": os.cpu_count()}}
    write_results(args.out, "kvpath", headline("kv_path_vs_memcpy", idle["vs_memcpy"], 0.80),
                  results)
    return 0


def argparse_hidden() -> str:
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
