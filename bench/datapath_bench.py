"""``dualpath bench datapath``: DE→PE layer-wise forwarding through the PullLayers path vs raw
ucxx, a memcpy ceiling, and the layer-wise prefill overlap.

Two processes on loopback. The child runs a real DE loader (``DELoaderService``; its DE-path
"read" is a prefilled buffer, so only the forwarding is measured) with a trivial decode
engine; this process runs a real PE receiver whose engine consumes layers as they arrive. A
request is DeepSeek-V3.2-sized: 61 layers x 656 B per token per layer, 8,192 or 32,768 hit
tokens (+1 computed token), one contiguous ``[L, tokens, B]`` region on each side.

* **pull path**: plan → PrepareDecode → the PE posts receives ``lookahead`` layers ahead and
  sends PullLayers; the DE sends each layer ``[l, 0:hit]`` as one message (cut at
  ``transport.max_message_bytes``). Throughput = hit bytes / (first pull → last layer in).
* **raw ucxx**: the same messages between the same two processes, all receives preposted,
  ``force_tag`` sends from the child; time = command → last receive complete.
* **memcpy**: one thread copying the same layers inside this process (the ceiling).
* **overlap**: the emulated prefill engine (``PrefillEngineSim``) with compute per layer set to
  1.5x the measured load per layer (rounded up to a whole ms: uvloop's timers); per request,
  load not hidden = plan → request handed to the engine + the engine's waits for layers;
  whole-prompt mode shows all of the load, so hidden = 1 − not_hidden(layer-wise) /
  not_hidden(whole). Measured with the bench's pulls and again with ``[pe_receiver]``'s
  default pull settings (``at_defaults`` in the JSON; docs/datapath.md "Measured").

Raw and pull phases alternate (drift hits both); the headline is the median of the paired
pull/raw ratios at 32,768 tokens (8,192 in ``--quick`` when the host is loaded is noisier).
NIXL 1.5.1 reference on these machines (issue 4): 3.4–3.6 GB/s per-block descriptors,
4.3–5.1 GB/s one descriptor per layer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

from common.service import run
from bench.report import (bench_parser, headline, print_table, read_json, send_json,
                          write_results)
from common.config import build_config
from tools.config import DualpathConfig
from common.kv import PRESETS, block_keys_from_tokens
from common.logging import configure_logging
from common.protocol import Endpoint, RequestPlan
from common.transport.plan import plan_messages

ROOT = Path(__file__).resolve().parents[1]
SPEC = PRESETS["deepseek-v3.2"]
SIZES = (8192, 32768)
NIXL = {"per_block_gbps": (3.4, 3.6), "coalesced_gbps": (4.3, 5.1)}
MiB = 1 << 20


# --path: how the layers cross between the two processes (docs/datapath.md): the production
# default (same host: one copy into the PE's /dev/shm buffer), UCX tag messages, or RMA puts
PATHS = {"default": {}, "tag": {"same_host": "ucx", "kv_mode": "tag"},
         "rma": {"same_host": "ucx", "kv_mode": "rma"}}


def config(max_tokens: int, lookahead: int, per_pull: int, in_flight: int = 2,
           path: str = "default") -> DualpathConfig:
    region = (max_tokens + 64) * SPEC.bytes_per_token
    buffer = region + 64 * MiB
    node = {"buffer_bytes": buffer, "page_bytes": 1 * MiB, "engines": 1,
            "alloc_timeout_s": 30.0}
    return build_config({
        "kv": {"preset": "deepseek-v3.2"},
        "transport": {"staging_bytes": 32 * MiB, **PATHS[path]},
        "pe_receiver": {**node, "lookahead_layers": lookahead, "layers_per_pull": per_pull,
                        "pulls_in_flight": in_flight},
        "de_loader": {**node, "writeback": False},
        "engine_sim": {"verify": False, "hbm_copy": False, "time_scale": 0.0},
        "logging": {"level": "warning"},
    }, DualpathConfig, "bench", environ={})


# ---------------------------------------------------------------- child: the DE loader

async def child_main(max_tokens: int, lookahead: int, per_pull: int, path: str) -> None:
    from services.de_loader.service import DELoaderService
    from tools.engine_sim.engines import EngineHost

    configure_logging("warning", json=False)
    cfg = config(max_tokens, lookahead, per_pull, path=path)

    async def prefilled(region, info):       # the DE buffer already holds the hit KV
        return info.hit_tokens

    svc = DELoaderService(cfg, "d0", spec=SPEC, hit_source=prefilled)
    await svc.start()
    arena = svc.pool.arena
    arena[:] = np.resize(np.arange(251, dtype=np.uint8), arena.nbytes)
    host = EngineHost(svc, cfg.engine_sim)
    await host.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"rpc_port": svc.rpc_port, "ucx": list(svc.ucx_address)}), flush=True)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "raw":
                await raw_send(svc, cmd)
            print(json.dumps({"done": cmd["op"], "live": len(svc.attempts),
                              "used": svc.pool.used_pages}), flush=True)
    finally:
        await host.stop()
        await svc.stop()


async def raw_send(svc, cmd: dict) -> None:
    ep = await svc.transport.endpoint(tuple(cmd["peer"]))
    base, pos, arena, sends = cmd["tid"] << 20, 0, svc.pool.arena, []
    for i, n in enumerate(cmd["sizes"]):
        sends.append(ep.send(arena[pos:pos + n], tag=base | i, force_tag=True))
        pos += n
    await asyncio.gather(*sends)


# ---------------------------------------------------------------- parent: the PE receiver

class FixedCost:
    """A cost model with a set prefill time (the overlap runs set compute per layer)."""

    def __init__(self, prefill_s: float) -> None:
        self._t = prefill_s

    def attention_s(self, cached: int, new: int) -> float:
        return 1e-6

    def prefill_s(self, cached: int, new: int) -> float:
        return self._t


class Bench:
    def __init__(self, args) -> None:
        self.quick = args.quick
        self.reps = 3 if args.quick else 7
        self.sizes = SIZES
        self.lookahead, self.per_pull = args.lookahead, args.layers_per_pull
        self.in_flight = getattr(args, "pulls_in_flight", 2)
        self.path = args.path
        self.cfg = config(max(self.sizes), self.lookahead, self.per_pull, self.in_flight,
                          self.path)
        self.n = 0

    async def __aenter__(self) -> Bench:
        from services.pe_receiver.service import PEReceiverService

        self.child = subprocess.Popen(
            [sys.executable, "-m", "bench.datapath_bench", "--child",
             "--max-tokens", str(max(self.sizes)), "--lookahead", str(self.lookahead),
             "--layers-per-pull", str(self.per_pull), "--path", self.path],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pe = PEReceiverService(self.cfg, "p0", spec=SPEC)
        await self.pe.start()
        ready = await self._reply()
        self.de = Endpoint("d0", "de_loader", "127.0.0.1", ready["rpc_port"], *ready["ucx"])
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if self.child.poll() is None:
                self._command({"op": "exit"})
                self.child.wait(timeout=30)
        finally:
            if self.child.poll() is None:
                self.child.kill()
                self.child.wait()
            await self.pe.stop()

    def _command(self, cmd: dict) -> None:
        send_json(self.child, cmd)

    async def _reply(self) -> dict:
        return await read_json(self.child, "DE loader")

    def plan(self, hit: int) -> RequestPlan:
        self.n += 1
        toks = np.arange(hit + 1) % 50_000
        keys = block_keys_from_tokens(toks, SPEC.block_tokens)
        return RequestPlan(f"b{self.n}", 0, "bench", "p0.e0", "p0", "d0.e0", "d0", "de", "d0",
                           hit, 1, 1, 1 << 30, keys, [], self.de, None, 120.0, [int(toks[-1])])

    # ------------------------------------------------------------------ pull path
    async def pull(self, hit: int) -> dict:
        """One request through PullLayers; the engine takes each layer as it lands."""
        port = self.pe.ports["p0.e0"]
        self.pe.submit_plan(self.plan(hit))
        h = await port.next_request()
        att = h._b
        for layer in range(SPEC.num_layers):
            await h.layer(layer)
        arrival, requested, start = list(att.layer_arrival), list(att.layer_requested), \
            att.t_pull_start
        for layer in range(SPEC.num_layers):
            await h.put_layer(layer)
        await h.finish(0)
        await self._settle()
        nbytes = hit * SPEC.bytes_per_token
        lat = [a - r for a, r in zip(arrival, requested)]
        return {"gbps": nbytes / (max(arrival) - start) / 1e9, "latency_s": lat}

    async def _settle(self) -> None:
        """Both sides have freed the request (the next run gets clean buffers)."""
        while self.pe.attempts:
            await asyncio.sleep(0.001)

    # ------------------------------------------------------------------ raw ucxx
    async def raw(self, hit: int) -> dict:
        t = self.pe.transport
        row = hit * SPEC.kv_bytes_per_token_per_layer
        region = self.pe.regions.try_allocate(SPEC, hit, "raw")
        try:
            msgs = [m for layer in range(SPEC.num_layers) for m in plan_messages(
                [region.slot(layer)], self.cfg.transport.max_message_bytes,
                self.cfg.transport.pack_below_bytes)]
            assert sum(m.nbytes for m in msgs) == row * SPEC.num_layers
            ep = await t.endpoint((self.de.ucx_host, self.de.ucx_port))
            tid = t.new_transfer_id()
            arena = region.arena
            recvs = [asyncio.ensure_future(ep.recv(arena[m.pieces[0][0]:m.pieces[0][0] + m.nbytes],
                                                   tag=(tid << 20) | i, force_tag=True))
                     for i, m in enumerate(msgs)]
            await asyncio.sleep(0)                     # every receive is posted
            start = time.perf_counter()
            self._command({"op": "raw", "peer": list(t.address), "tid": tid,
                           "sizes": [m.nbytes for m in msgs]})
            await asyncio.gather(*recvs)
            elapsed = time.perf_counter() - start
            await self._reply()
        finally:
            self.pe.regions.free(region)
        return {"gbps": row * SPEC.num_layers / elapsed / 1e9, "messages": len(msgs)}

    def memcpy(self, hit: int) -> float:
        """One thread copying the request layer by layer into warm destinations."""
        a = self.pe.regions.try_allocate(SPEC, hit, "copy")
        try:
            src = [a.flat(layer) for layer in range(SPEC.num_layers)]
            dst = [np.ones_like(src[0]) for _ in range(2)]
            best = 0.0
            for _ in range(3):
                start = time.perf_counter()
                for layer, s in enumerate(src):
                    np.copyto(dst[layer % 2], s)
                best = max(best, a.nbytes / (time.perf_counter() - start) / 1e9)
            return best
        finally:
            self.pe.regions.free(a)

    # ------------------------------------------------------------------ overlap
    async def overlap(self, hit: int, load_per_layer_s: float) -> dict:
        """Emulated prefill, whole-prompt vs layer-wise; load not hidden = plan → hand-over
        plus the engine's waits for layers (measured by the engine, per request)."""
        from tools.config import EngineSimConfig
        from tools.engine_sim.engines import PrefillEngineSim

        L = SPEC.num_layers
        # the emulated engine's compute is an asyncio sleep, and uvloop's timers count whole
        # milliseconds (a 1.41-ms sleep ran 0.95 ms): compute per layer is 1.5x the load,
        # rounded up to a whole millisecond so the goal's condition (load <= compute) holds
        compute = math.ceil(1.5 * load_per_layer_s * 1e3) / 1e3
        out = {"compute_per_layer_s": compute, "load_per_layer_s": load_per_layer_s}
        for mode in ("whole", "layerwise"):
            cfg = EngineSimConfig(mode=mode, verify=False, time_scale=1.0)
            eng = PrefillEngineSim(self.pe.ports["p0.e0"], SPEC, cfg, FixedCost(compute * L))
            task = asyncio.ensure_future(eng.run())
            total, exposed, spent, handover, waits = [], [], [], [], []
            try:
                for i in range(self.reps + 2):
                    t0 = time.monotonic()
                    self.pe.submit_plan(self.plan(hit))
                    while len(eng.timings) <= i:
                        await asyncio.sleep(0.0005)
                    tm = eng.timings[i]
                    total.append(tm.end - t0)
                    # load the engine did not overlap: plan → request handed over (the first
                    # layer is on its way then) + time it waited for layers afterwards
                    exposed.append(tm.start - t0 + tm.wait_s)
                    handover.append(tm.start - t0)
                    waits.append(tm.wait_s)
                    spent.append(tm.compute_s)
                    await self._settle()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            out[f"{mode}_s"] = statistics.median(total)
            out[f"{mode}_load_not_hidden_s"] = statistics.median(exposed)
            out[f"{mode}_compute_s"] = statistics.median(spent)
            out[f"{mode}_handover_s"] = statistics.median(handover)
            out[f"{mode}_layer_waits_s"] = statistics.median(waits)
        load = out["whole_load_not_hidden_s"]          # whole-prompt: all of the load shows
        out["load_total_s"] = load
        out["load_per_layer_in_run_s"] = load / L      # the condition: <= compute per layer
        out["compute_per_layer_in_run_s"] = out["whole_compute_s"] / L
        out["hidden_fraction"] = 1 - out["layerwise_load_not_hidden_s"] / load if load > 0 else 0
        # Wall clock, for transparency: here the receiver's cma copies run inside UCX progress
        # on the same event loop as the emulated engine and stretch its "compute" (on real
        # hardware the NIC writes the layers), so this undercounts what the engine overlaps.
        nominal = L * compute
        out["wallclock_saving_fraction"] = (out["whole_s"] - out["layerwise_s"]) / \
            max(out["whole_s"] - nominal, 1e-9)
        return out


async def bench_main(args) -> tuple[list[dict], dict, dict]:
    rows, lat_all, overlap = [], {}, {}
    async with Bench(args) as b:
        for hit in b.sizes:
            await b.pull(hit)                      # warm: endpoints, page faults
            await b.raw(hit)
            pulls, raws = [], []
            for _ in range(b.reps):
                raws.append(await b.raw(hit))
                pulls.append(await b.pull(hit))
            ratios = [p["gbps"] / r["gbps"] for p, r in zip(pulls, raws)]
            lat = sorted(x for p in pulls for x in p["latency_s"])
            copy = b.memcpy(hit)
            best = max(p["gbps"] for p in pulls)
            row = {"hit_tokens": hit, "bytes": hit * SPEC.bytes_per_token,
                   "layer_bytes": hit * SPEC.kv_bytes_per_token_per_layer,
                   "pull_gbps": best, "pull_gbps_median": statistics.median(p["gbps"] for p in pulls),
                   "raw_gbps": max(r["gbps"] for r in raws),
                   "ratio": statistics.median(ratios), "memcpy_gbps": copy,
                   "vs_nixl_coalesced": best / NIXL["coalesced_gbps"][1],
                   # numpy's "higher": the samples lat[n // 2] and lat[int(0.99 n)]
                   "layer_p50_ms": 1e3 * float(np.quantile(lat, 0.50, method="higher")),
                   "layer_p99_ms": 1e3 * float(np.quantile(lat, 0.99, method="higher")),
                   "raw_messages": raws[0]["messages"]}
            rows.append(row)
            print_table([row], COLUMNS)
            lat_all[hit] = lat
        hit = b.sizes[0]
        load = rows[0]["layer_bytes"] / (rows[0]["pull_gbps_median"] * 1e9)
        overlap = await b.overlap(hit, load)
        stats = b.pe.transport.stats()
    overlap["pull_settings"] = {"lookahead_layers": b.lookahead, "layers_per_pull": b.per_pull,
                                "pulls_in_flight": b.in_flight}
    overlap["at_defaults"] = await overlap_at_defaults(args)
    # which path carried the bytes (the PE's transport counts each): --path's proof
    received = {k: stats.get(k, 0.0) for k in ("bytes_received", "shm_bytes_received",
                                               "rma_bytes_received", "messages_received")}
    return rows, overlap, {"lookahead_layers": b.lookahead, "layers_per_pull": b.per_pull,
                           "pulls_in_flight": b.in_flight, "received": received}


async def overlap_at_defaults(args) -> dict:
    """The overlap again with ``[pe_receiver]``'s own pull settings (what a node runs; the
    bench's deeper pipeline serves the throughput rows): its load per layer measured there
    first, over the same path."""
    from services.node.config import PEReceiverConfig

    d = PEReceiverConfig()
    plain = argparse.Namespace(**{**vars(args), "lookahead": d.lookahead_layers,
                                  "layers_per_pull": d.layers_per_pull,
                                  "pulls_in_flight": d.pulls_in_flight})
    async with Bench(plain) as b:
        hit = SIZES[0]
        await b.pull(hit)                          # warm
        pulls = [await b.pull(hit) for _ in range(b.reps)]
        gbps = statistics.median(p["gbps"] for p in pulls)
        out = await b.overlap(hit, hit * SPEC.kv_bytes_per_token_per_layer / (gbps * 1e9))
    out["pull_settings"] = {"lookahead_layers": d.lookahead_layers,
                            "layers_per_pull": d.layers_per_pull,
                            "pulls_in_flight": d.pulls_in_flight}
    return out


def overlap_line(o: dict) -> str:
    s = o["pull_settings"]
    return (f"look-ahead {s['lookahead_layers']}, {s['layers_per_pull']} layers per pull, "
            f"{s['pulls_in_flight']} in flight: load/layer {o['load_per_layer_in_run_s'] * 1e3:.2f}"
            f" ms, compute/layer {o['compute_per_layer_in_run_s'] * 1e3:.2f} ms; whole-prompt "
            f"{o['whole_s'] * 1e3:.1f} ms, layer-wise {o['layerwise_s'] * 1e3:.1f} ms; load not "
            f"hidden {o['whole_load_not_hidden_s'] * 1e3:.1f} -> "
            f"{o['layerwise_load_not_hidden_s'] * 1e3:.1f} ms (hand-over "
            f"{o['layerwise_handover_s'] * 1e3:.1f}, waits {o['layerwise_layer_waits_s'] * 1e3:.1f})"
            f": {o['hidden_fraction']:.1%} of load time hidden (goal >= 90%); wall clock: "
            f"{o['wallclock_saving_fraction']:.1%} of whole-prompt load time saved")


COLUMNS = ["hit_tokens", "pull_gbps", "raw_gbps", "ratio", "memcpy_gbps", "vs_nixl_coalesced",
           "layer_p50_ms", "layer_p99_ms"]



def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("datapath", __doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=max(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--lookahead", type=int, default=16, help="PE look-ahead in layers")
    parser.add_argument("--layers-per-pull", type=int, default=4, help="layers per PullLayers")
    parser.add_argument("--pulls-in-flight", type=int, default=3,
                        help="PullLayers calls outstanding at once")
    parser.add_argument("--path", choices=sorted(PATHS), default="default",
                        help="how layers cross: the production default (same host: one copy "
                             "into the PE's shared buffer), UCX tag messages, or RMA puts")
    args = parser.parse_args(argv)
    if args.child:
        run(child_main(args.max_tokens, args.lookahead, args.layers_per_pull, args.path))
        return 0
    configure_logging("warning", json=False)
    start, load_before = time.perf_counter(), os.getloadavg()
    rows, overlap, settings = run(bench_main(args))
    print()
    print_table(rows, COLUMNS)
    print(f"\noverlap at {SIZES[0]} hit tokens, the bench's pulls: {overlap_line(overlap)}")
    print(f"overlap, [pe_receiver]'s default pulls: {overlap_line(overlap['at_defaults'])}")
    head_row = rows[-1]
    print(f"NIXL 1.5.1 reference: {NIXL['per_block_gbps']} GB/s per block, "
          f"{NIXL['coalesced_gbps']} coalesced; ours {head_row['pull_gbps']:.2f} GB/s = "
          f"{head_row['vs_nixl_coalesced']:.2f}x the best coalesced figure (goal >= 1.2x); "
          f"memcpy {head_row['memcpy_gbps']:.2f} GB/s")
    load = {"before": load_before, "after": os.getloadavg()}
    got = settings["received"]
    print(f"path {args.path}: the PE received {got['bytes_received'] / 1e9:.2f} GB, "
          f"{got['shm_bytes_received'] / 1e9:.2f} GB by one copy, "
          f"{got['rma_bytes_received'] / 1e9:.2f} GB by RMA puts, "
          f"{got['messages_received']:.0f} tag messages")
    print(f"{time.perf_counter() - start:.1f} s, load average {load}")
    write_results(args.out, "datapath",
                  headline("de_to_pe_vs_raw_ucxx", head_row["ratio"], 0.85),
                  {"rows": rows, "overlap": overlap, "nixl_reference": NIXL,
                   "settings": settings, "path": args.path, "quick": args.quick, "loadavg": load,
                   "model": msgspec.to_builtins(SPEC)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
