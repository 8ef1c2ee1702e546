"""The ``nixl`` row of ``dualpath bench kvpath``: the same pages moved by NIXL, the field's
one-sided KV library (vLLM's NixlConnector uses it), between two processes of this host.

Optional: NIXL is not a dependency (``make nixl`` installs ``nixl-cu12`` without its
dependencies: the wheel imports torch only for type checking, and its declared dependencies
pull ~5.7 GB of CUDA torch). Its wheel bundles its own UCX; both NIXL processes are children
of the bench that never import ucxx, so the two UCX builds never meet in one process.

``python -m bench.nixl_peer --reps R --transfers N --small-pages S`` is the initiator: it
starts the target (``--target``: registers ``REGIONS`` destination regions of the page layout
``bench.kvpath_bench`` uses — 1 MiB pages with a 4 KiB gap — and one for 4 KiB pages, then
prints its agent metadata and region addresses), registers the same seeded source regions
as the kvpath sender, and times ``N`` transfers of ``PAGES`` pages per rep — one NIXL WRITE
per transfer, ``SEND_LANES`` in flight, each polled to DONE (UCX has flushed the puts:
the bytes are in the target's memory) — paired with the same 1-MiB memcpy from main memory
(``kvpath_bench.Memcpy``, order alternating). After each rep the target hashes (xxh3) every
region written and the initiator compares it with the source: a mismatch fails the run. Then
4 KiB pages/s. Prints one JSON row.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import xxhash

from tools.cluster.launcher import proc_cpu_seconds
from bench.kvpath_bench import (INFLIGHT, PAGE, PAGES, REGIONS, SEND_LANES, SMALL, SMALL_PAGES,
                                Memcpy, paired, region_bytes, slots_of, source_region)

NIXL_MODULE = "nixl_cu12"       # what `make nixl` installs (the CUDA 12 build; DRAM here)
MARK = "kvpath-nixl: "          # NIXL logs to stdout too: our JSON lines carry this prefix


def say(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


def heard(stream: Any, who: str, proc: subprocess.Popen) -> dict:
    """The next line of ours on ``stream`` (NIXL's own log lines skipped)."""
    for line in stream:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{who} exited ({proc.wait()}) before answering")


def agent(name: str, progress_thread: bool) -> Any:
    from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
                                              backends=["UCX"]))


def descs(nx: Any, base: int, size: int, count: int) -> Any:
    return nx.get_xfer_descs([(base + off, n, 0) for off, n in slots_of(size, count)], "DRAM")


def digest(buf: np.ndarray, size: int, count: int) -> int:
    h = xxhash.xxh3_64()
    for off, n in slots_of(size, count):
        h.update(buf[off:off + n])
    return h.intdigest()


# ---------------------------------------------------------------- target

def target_main() -> None:
    nx = agent("kvpath-target", True)
    span = region_bytes(PAGE, PAGES)
    regions = [np.zeros(span, np.uint8) for _ in range(REGIONS)]
    small = np.zeros(region_bytes(SMALL, SMALL_PAGES), np.uint8)
    for buf in (*regions, small):
        nx.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    say({"metadata": base64.b64encode(nx.get_agent_metadata()).decode(),
         "regions": [r.ctypes.data for r in regions], "small": small.ctypes.data})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            return
        say({"digests": [digest(regions[r], PAGE, PAGES) for r in cmd["regions"]]})


# ---------------------------------------------------------------- initiator

class Initiator:
    """The sending agent, its target process and the transfer descriptors of each region."""

    def __init__(self) -> None:
        self.target = subprocess.Popen([sys.executable, "-m", "bench.nixl_peer", "--target"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        self.nx = agent("kvpath-initiator", False)
        self.peer = self.nx.add_remote_agent(base64.b64decode(hello["metadata"]))
        self.sources = [source_region(r, region_bytes(PAGE, PAGES)) for r in range(REGIONS)]
        self.small_src = source_region(REGIONS, region_bytes(SMALL, SMALL_PAGES))
        for buf in (*self.sources, self.small_src):
            self.nx.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        self.expected = [digest(s, PAGE, PAGES) for s in self.sources]
        self.src = [descs(self.nx, s.ctypes.data, PAGE, PAGES) for s in self.sources]
        self.dst = [descs(self.nx, a, PAGE, PAGES) for a in hello["regions"]]
        self.small = (descs(self.nx, self.small_src.ctypes.data, SMALL, SMALL_PAGES),
                      descs(self.nx, hello["small"], SMALL, SMALL_PAGES))
        self.verified = 0

    def _read(self) -> dict:
        return heard(self.target.stdout, "the nixl target", self.target)

    def _ask(self, cmd: dict) -> dict:
        assert self.target.stdin is not None
        self.target.stdin.write(json.dumps(cmd) + "\n")
        self.target.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.target.poll() is None:
                assert self.target.stdin is not None
                self.target.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.target.stdin.flush()
                self.target.wait(10)
        finally:
            if self.target.poll() is None:
                self.target.kill()
                self.target.wait()

    def _run(self, pairs: list[tuple[Any, Any]]) -> float:
        """WRITE each (source, destination) list, ``SEND_LANES`` at once, each to DONE."""
        t0 = time.perf_counter()
        live: list[Any] = []
        todo = list(pairs)
        while todo or live:
            while todo and len(live) < SEND_LANES:
                src, dst = todo.pop(0)
                handle = self.nx.initialize_xfer("WRITE", src, dst, self.peer)
                if self.nx.transfer(handle) == "ERR":
                    raise RuntimeError("nixl: transfer refused")
                live.append(handle)
            for handle in list(live):
                state = self.nx.check_xfer_state(handle)
                if state == "ERR":
                    raise RuntimeError("nixl: transfer failed")
                if state == "DONE":
                    self.nx.release_xfer_handle(handle)
                    live.remove(handle)
        return time.perf_counter() - t0

    def pages(self, n: int) -> float:
        """``n`` transfers of ``PAGES`` 1 MiB pages (region k % REGIONS), then verified."""
        elapsed = self._run([(self.src[k % REGIONS], self.dst[k % REGIONS]) for k in range(n)])
        written = sorted({k % REGIONS for k in range(n)})
        got = self._ask({"op": "digest", "regions": written})["digests"]
        if got != [self.expected[r] for r in written]:
            raise RuntimeError("nixl: a destination region does not hold its source")
        self.verified += len(written) * PAGES * PAGE
        return elapsed

    def small_pages(self, transfers: int) -> float:
        return self._run([self.small] * transfers)


async def measure(reps: int, transfers: int, small_pages: int) -> dict:
    peer = Initiator()
    try:
        copy = Memcpy()
        nbytes = transfers * PAGES * PAGE

        async def page() -> float:
            return peer.pages(transfers)

        cpu0 = proc_cpu_seconds(os.getpid()), proc_cpu_seconds(peer.target.pid)
        row = await paired(reps, page, lambda: copy.seconds(nbytes), nbytes)
        moved_gb = (reps + 1) * nbytes / 1e9
        # the initiator's CPU includes the paired memcpys: subtract them (one thread: their
        # CPU is their bytes at the memcpy rate); the target's is its progress thread's
        row["sender_cpu_s_per_gb"] = ((proc_cpu_seconds(os.getpid()) - cpu0[0]) / moved_gb
                                      - 1 / row["memcpy_gbps"])
        row["target_cpu_s_per_gb"] = (proc_cpu_seconds(peer.target.pid) - cpu0[1]) / moved_gb
        row["memcpy_cpu_s_per_gb"] = 1 / row["memcpy_gbps"]
        small = min(peer.small_pages(small_pages // SMALL_PAGES) for _ in range(3))
        return {"path": "nixl", "load": "idle", "page_bytes": PAGE, "inflight": INFLIGHT,
                **row, "verified": peer.verified, "pages_per_s_4k": small_pages / small,
                "loadavg_1m": os.getloadavg()[0]}
    finally:
        peer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--transfers", type=int, default=REGIONS)
    parser.add_argument("--small-pages", type=int, default=4 * SMALL_PAGES)
    args = parser.parse_args(argv)
    if args.target:
        target_main()
        return 0
    say(asyncio.run(measure(args.reps, args.transfers, args.small_pages)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
