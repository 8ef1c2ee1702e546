"""``dualpath bench gpu``: KV pages to and from GPU memory through the transport, two processes.

The GPU check of docs/performance.md ("GPU memory"): this process receives and times, a child
(``--child``) sends, both over a ``PageTransport`` whose KV lane lists UCX's CUDA transports
(``cuda_copy``: host <-> device copies; ``cuda_ipc``: device memory of another process on the
same node). A transfer is ``PAGES`` pages of 1 MiB into slots with a 4 KiB gap (every page its
own message, as pool pages are); ``LANES`` transfers are in flight at once, each into its own
region. Rows, by where the sender's pages are and where the receiver's arena is:

* ``gpu->gpu``  — a device source (cupy) into a device arena: the PE's region on the GPU fed by
  a decode node's GPU;
* ``host->gpu`` — pageable host memory (numpy) into a device arena;
* ``pinned->gpu`` — page-locked host memory (cupy's pinned allocator) into a device arena: what
  a node's pinned host arena gives the H2D copy engines;
* ``gpu->host`` — a device source into a host arena (a write-back leaving the GPU);
* ``host->gpu unstaged`` — the ``host->gpu`` bytes received straight into the device arena
  (UCX's own cuda_copy pipeline, the path before pinned staging), for comparison;
* ``gpu->gpu runs`` and ``host->gpu runs`` — the same pages in contiguous slots (no gap), as a
  request's pages are when the pool hands out one extent: the transport coalesces a run into
  messages of up to ``transport.max_message_bytes`` (16 MiB), so these rows show what the
  per-message cost of the gapped rows becomes with fewer, larger messages.

The child runs two transports, as nodes do: one whose hello says its pages come from device
memory (``device_sources``: a pool on the GPU; the ``gpu->*`` rows, and the unstaged row, whose
host pages it then sends as if they were device ones) and one that says host memory (a gateway,
a pool on the host: ``host->gpu``, ``pinned->gpu``). A device arena receives from the second
through the transport's pinned staging and one H2D copy per message
(``common.transport.device_staging``); each row reports the messages staged
(``staged_messages``: every message of the staged rows, none of the others).

Baseline, in the same run: ``cudaMemcpy`` (``cupy.cuda.runtime.memcpy``) of the same bytes in
the same direction in this process — device to device, pageable and pinned host to device,
device to pageable host — timed with a device synchronize, best of the reps. Each row's
``vs_memcpy`` is the transport's GB/s ÷ that memcpy's.

``verified``: after each row every received byte is compared with the bytes the sender sent
(both generated from the same seed on the side that holds them); a mismatch fails the run.

Headline ``gpu_to_gpu_vs_memcpy`` (goal 0.5: two processes and a UCX rendezvous per 1 MiB page
against one in-process copy). Without cupy or a CUDA device it says why and exits 2.
``--host-dry-run`` runs the same phases with host arrays in place of device ones (what CI and a
machine without a GPU can check of this script; no GPU number comes of it).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import bench_parser, headline, print_table, write_results
from common.config import TrafficClassConfig, TransportConfig
from common.logging import configure_logging

MIB, KIB = 1024 * 1024, 1024
PAGE, GAP = MIB, 4 * KIB
LANES = 4                      # transfers in flight (each into its own region)
ROOT = Path(__file__).resolve().parents[1]
# the KV lane with UCX's CUDA transports (tests/test_transport.py's device test uses the same)
UCX_OPTIONS = {"TLS": "tcp,sm,self,cuda_copy,cuda_ipc", "NET_DEVICES": "lo"}
DRY_UCX_OPTIONS = {"TLS": "tcp,sm,self", "NET_DEVICES": "lo"}
# (row, source kind, arena kind, the sending transport: says "device" or "host" sources,
# the gap between slots: GAP = every page its own message, 0 = contiguous runs)
ROWS = (("gpu->gpu", "device", "device", "device", GAP),
        ("host->gpu", "host", "device", "host", GAP),
        ("pinned->gpu", "pinned", "device", "host", GAP),
        ("gpu->host", "device", "host", "device", GAP),
        ("host->gpu unstaged", "host", "device", "device", GAP),
        ("gpu->gpu runs", "device", "device", "device", 0),
        ("host->gpu runs", "host", "device", "host", 0))


def slots_of(count: int, gap: int = GAP) -> list[tuple[int, int]]:
    return [(i * (PAGE + gap), PAGE) for i in range(count)]


def received(arena: Any, count: int, gap: int) -> Any:
    """The pages of ``arena`` (slots ``slots_of(count, gap)``), concatenated."""
    return arena[:count * (PAGE + gap)].reshape(count, PAGE + gap)[:, :PAGE].reshape(-1)


def region_bytes(count: int) -> int:
    return count * (PAGE + GAP)


class Memory:
    """Allocates ``device`` / ``host`` / ``pinned`` buffers and fills them with seeded bytes;
    with ``dry`` every kind is a host array (the script's plumbing, checked without a GPU)."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.cp: Any = None
        self._pinned: list[Any] = []                 # keeps page-locked blocks alive
        if not dry:
            import cupy
            self.cp = cupy

    def empty(self, kind: str, nbytes: int) -> Any:
        if self.dry or kind == "host":
            return np.zeros(nbytes, np.uint8)
        if kind == "device":
            return self.cp.zeros(nbytes, dtype=self.cp.uint8)
        block = self.cp.cuda.alloc_pinned_memory(nbytes)
        self._pinned.append(block)
        return np.frombuffer(block, np.uint8, nbytes)

    def pattern(self, kind: str, seed: int, nbytes: int) -> Any:
        """Bytes that depend on seed and position, made where ``kind`` lives (no RNG: both
        processes regenerate them)."""
        xp = self.cp if (kind == "device" and not self.dry) else np
        x = xp.arange(nbytes, dtype=xp.uint32)
        out = ((x * xp.uint32(2654435761) + xp.uint32(seed * 97 + 13)) >> xp.uint32(11))
        out = out.astype(xp.uint8)
        if kind == "pinned" and not self.dry:
            buf = self.empty("pinned", nbytes)
            buf[:] = out
            return buf
        return out

    def equal(self, a: Any, b: Any) -> bool:
        if self.cp is not None and (isinstance(a, self.cp.ndarray) or isinstance(b, self.cp.ndarray)):
            return bool(self.cp.array_equal(self.cp.asarray(a), self.cp.asarray(b)))
        return bool(np.array_equal(a, b))

    def sync(self) -> None:
        if self.cp is not None:
            self.cp.cuda.Device().synchronize()


def ucx_options(dry: bool, extra: list[str] | None = None) -> dict[str, str]:
    """The KV lane's UCX options (``UCX_`` dropped), ``KEY=VALUE`` overrides applied."""
    out = dict(DRY_UCX_OPTIONS if dry else UCX_OPTIONS)
    for kv in extra or []:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"--ucx-opt wants KEY=VALUE (UCX_ dropped), got {kv!r}")
        out[key.removeprefix("UCX_")] = value
    return out


def transport_config(dry: bool, extra: list[str] | None = None) -> TransportConfig:
    options = ucx_options(dry, extra)
    return TransportConfig(traffic_classes={"kv": TrafficClassConfig(options=options)},
                           staging_bytes=32 * MIB)


def read_reply(stream: Any) -> dict:
    """The child's next JSON line (UCX prints its warnings on stdout too: skipped, echoed)."""
    while line := stream.readline():
        if line.startswith("{"):
            return json.loads(line)
        print(f"  child: {line.rstrip()}", file=sys.stderr)
    raise SystemExit("bench gpu: the sending child exited early (its errors above)")


# ---------------------------------------------------------------- child (sender)

async def child_main(dry: bool, pages: int, extra: list[str]) -> None:
    from common.transport import PageTransport
    configure_logging("warning", json=False)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    mem = Memory(dry)
    nbytes = pages * PAGE
    sources = {kind: [mem.pattern(kind, 100 + lane, nbytes) for lane in range(LANES)]
               for kind in ("device", "host", "pinned")}
    mem.sync()
    cfg = transport_config(dry, extra)
    async with PageTransport(cfg, "bench-gpu-host-sender") as host, \
            PageTransport(cfg, "bench-gpu-device-sender", device_sources=True) as device:
        senders = {"host": host, "device": device}
        print(json.dumps({"address": {k: list(t.address) for k, t in senders.items()}}),
              flush=True)
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            peer, transport = tuple(cmd["peer"]), senders[cmd["via"]]
            slots = slots_of(pages, cmd["gap"])
            await asyncio.gather(*(
                transport.send(peer, tid, [sources[cmd["src"]][lane]], slots, 120.0)
                for lane, tid in enumerate(cmd["tids"])))
            print(json.dumps({"done": len(cmd["tids"])}), flush=True)


# ---------------------------------------------------------------- parent (receiver)

async def transport_rows(mem: Memory, pages: int, reps: int, extra: list[str]) -> list[dict]:
    from common.transport import PageTransport
    child = subprocess.Popen([sys.executable, "-m", "bench.gpu_bench", "--child",
                              "--pages", str(pages), *(f"--ucx-opt={kv}" for kv in extra)]
                             + (["--host-dry-run"] if mem.dry else []),
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        peers = {k: tuple(v) for k, v in
                 (await asyncio.to_thread(read_reply, child.stdout))["address"].items()}
        nbytes = pages * PAGE
        rows = []
        async with PageTransport(transport_config(mem.dry, extra), "bench-gpu-receiver") as rx:
            arenas = {kind: [mem.empty(kind, region_bytes(pages)) for _ in range(LANES)]
                      for kind in ("device", "host")}
            for name, src, dst, via, gap in ROWS:
                times, peer, slots = [], peers[via], slots_of(pages, gap)
                staged0 = rx.stats()["device_staged_messages"]
                for lane in range(LANES):     # no byte of an earlier row may pass for this one
                    arenas[dst][lane].fill(0)
                mem.sync()     # (the staged copies run on a non-blocking stream)
                for _ in range(reps):
                    tids = [rx.new_transfer_id() for _ in range(LANES)]
                    handles = [await rx.expect(peer, tid, arenas[dst][lane], slots, 120.0)
                               for lane, tid in enumerate(tids)]
                    t0 = time.perf_counter()
                    child.stdin.write(json.dumps({"op": "send", "peer": list(rx.address),
                                                  "tids": tids, "src": src,
                                                  "via": via, "gap": gap}) + "\n")
                    child.stdin.flush()
                    for h in handles:
                        await h.wait()
                    mem.sync()
                    times.append(time.perf_counter() - t0)
                    await asyncio.to_thread(read_reply, child.stdout)
                verified = 0
                for lane in range(LANES):
                    got = received(arenas[dst][lane], pages, gap)
                    want = mem.pattern(dst, 100 + lane, nbytes)
                    if not mem.equal(got, want):
                        raise SystemExit(f"{name}: lane {lane}: received bytes differ from sent")
                    verified += nbytes
                total = LANES * nbytes
                rows.append({"row": name, "src": src, "dst": dst, "sender": via,
                             "slot_gap_bytes": gap, "bytes": total,
                             "gbps_best": total / min(times) / 1e9,
                             "gbps_median": total / statistics.median(times) / 1e9,
                             "verified_bytes": verified,
                             "staged_messages": int(rx.stats()["device_staged_messages"]
                                                    - staged0)})
        child.stdin.write(json.dumps({"op": "exit"}) + "\n")
        child.stdin.flush()
        child.wait(30)
        return rows
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def memcpy_gbps(mem: Memory, src: str, dst: str, nbytes: int, reps: int) -> float | None:
    """``cudaMemcpy`` of ``nbytes`` from a ``src`` buffer to a ``dst`` one, best of ``reps``."""
    if mem.dry:
        return None
    rt = mem.cp.cuda.runtime
    a, b = mem.pattern(src, 7, nbytes), mem.empty(dst, nbytes)
    kinds = {("device", "device"): rt.memcpyDeviceToDevice, ("host", "device"): rt.memcpyHostToDevice,
             ("pinned", "device"): rt.memcpyHostToDevice, ("device", "host"): rt.memcpyDeviceToHost}

    def ptr(x: Any) -> int:
        return int(x.data.ptr) if isinstance(x, mem.cp.ndarray) else int(x.ctypes.data)

    best = float("inf")
    for _ in range(reps + 1):                      # the first one warms up
        mem.sync()
        t0 = time.perf_counter()
        rt.memcpy(ptr(b), ptr(a), nbytes, kinds[(src, dst)])
        mem.sync()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def device_info(mem: Memory) -> dict:
    if mem.dry:
        return {"dry_run": True}
    props = mem.cp.cuda.runtime.getDeviceProperties(0)
    return {"name": props["name"].decode(), "cupy": mem.cp.__version__,
            "total_bytes": int(props["totalGlobalMem"])}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("gpu", __doc__.splitlines()[0])
    p.add_argument("--host-dry-run", action="store_true",
                   help="host arrays in place of device ones: checks the script without a GPU")
    p.add_argument("--ucx-opt", action="append", default=[], metavar="KEY=VALUE",
                   help=f"a UCX option of the KV lane, UCX_ dropped (repeatable; default "
                        f"{UCX_OPTIONS})")
    p.add_argument("--child", action="store_true", help=argparse_hidden())
    p.add_argument("--pages", type=int, default=0, help=argparse_hidden())
    args = p.parse_args(argv)
    pages = args.pages or (16 if args.quick or args.host_dry_run else 64)
    if args.child:
        asyncio.run(child_main(args.host_dry_run, pages, args.ucx_opt))
        return 0
    configure_logging("warning", json=False)
    if not args.host_dry_run:
        from common.transport.plan import cuda_available
        if not cuda_available():
            print("bench gpu: no CUDA device (or no cupy: pip install cupy-cuda12x); "
                  "nothing measured", file=sys.stderr)
            return 2
    mem = Memory(args.host_dry_run)
    reps = 3 if args.quick or args.host_dry_run else 8
    rows = asyncio.run(transport_rows(mem, pages, reps, args.ucx_opt))
    nbytes = LANES * pages * PAGE
    for row in rows:
        base = memcpy_gbps(mem, row["src"], row["dst"], nbytes, reps)
        row["memcpy_gbps"] = base
        row["vs_memcpy"] = None if base is None else row["gbps_best"] / base
    print_table(rows, ["row", "gbps_best", "gbps_median", "memcpy_gbps", "vs_memcpy",
                       "verified_bytes", "staged_messages"])
    g2g = next(r for r in rows if r["row"] == "gpu->gpu")
    value = g2g["vs_memcpy"] if g2g["vs_memcpy"] is not None else 0.0
    write_results(args.out, "gpu", headline("gpu_to_gpu_vs_memcpy", value, 0.5),
                  {"quick": args.quick, "dry_run": args.host_dry_run, "pages": pages,
                   "lanes": LANES, "page_bytes": PAGE,
                   "ucx_options": ucx_options(args.host_dry_run, args.ucx_opt),
                   "device": device_info(mem), "rows": rows})
    return 0


def argparse_hidden() -> str:
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
