"""``dualpath bench engine_ipc``: the engine API across processes against in-process engines.

One PE receiver and one DE loader (loopback UCX, shared-memory arenas, no scheduler) serve the
same requests twice: once to engines in the node services' own event loop (the in-process
ports: the baseline), once to engines in two other processes attached over the nodes' Unix
sockets (``SyncEngineClient``, the blocking client a vLLM connector uses). Both engines do the
same work per request: copy every layer of the hit KV out, write the new tokens' KV, put the
layer; the decode engine copies the full prompt KV and finishes. Reported per side: request
time (plan submitted → decode finished) median and p90, and for the cross-process engines the
per-call round trips measured inside the engine process (``layer()`` once the KV is there,
``put_layer()``).

Headline: ``engine_ipc_request_time_ratio`` = median request time across processes ÷
in-process, goal ≤ 1.25 (the engine channel adds a few control round trips per layer; the KV
itself is never copied by the channel). A third row runs the cross-process engines with
``put_layer(wait=False)`` (puts pipelined behind the engine's compute, errors raised by the
next call). ``--quick``: fewer requests. On a small host the ratio can be below 1: in-process
engines share the node service's event loop (and the GIL) with its transfers, engines in
their own processes run beside it. Measured on the shared 2-core dev host (load average ~10,
so noisy), ``--quick``, 780-token requests of 32 layers × 1 KiB/token: in-process p50
289-486 ms, cross-process 199-559 ms (ratio 0.69-1.15), pipelined puts ratio 0.97;
``layer()`` / ``put_layer()`` round trips 1.5-2.4 ms p50, ``put_layer(wait=False)`` 0.14 ms.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import bench_parser, headline, print_table, write_results

GOAL = 1.25
BT = 64
MiB = 1 << 20
KV = {"preset": "test-small", "num_layers": 32, "kv_bytes_per_token_per_layer": 1024}
PROMPT_BLOCKS, HIT_BLOCKS = 12, 8           # 780-token prompts, 512 tokens hit (PE-side read)


def _overrides(root: Path) -> dict[str, Any]:
    return {"kv": KV, "pe_receiver": {"buffer_bytes": 128 * MiB,
                                      "engine_socket": str(root / "p0.sock")},
            "de_loader": {"buffer_bytes": 128 * MiB, "engine_socket": str(root / "d0.sock")},
            "transport": {"staging_bytes": 64 * MiB}}


def _plan(c: Any, rid: str, seed: int) -> Any:
    from common.kv import block_keys_from_tokens
    from common.protocol import Endpoint, RequestPlan
    toks = [(seed * 7919 + i * 31) % 50_000 for i in range(PROMPT_BLOCKS * BT + 12)]
    keys = block_keys_from_tokens(toks, BT)
    de = c.de["d0"]
    ep = Endpoint("d0", de.name, "127.0.0.1", de.rpc_port, *de.ucx_address)
    n_full = len(toks) // BT
    return RequestPlan(rid, 0, f"s{seed}", "p0.e0", "p0", "d0.e0", "d0", "pe", "p0",
                       HIT_BLOCKS * BT, len(toks) - HIT_BLOCKS * BT, 2, 1 << 20,
                       keys[:HIT_BLOCKS], keys[HIT_BLOCKS:], ep, None, 30.0,
                       toks[n_full * BT:]), keys


# --------------------------------------------------------------------------- engines' work

def _prefill_layer(hit: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """What an engine does with one layer: take the hit KV into its cache, write new KV."""
    np.copyto(scratch[:hit.shape[0]], hit)
    out.fill(7)


async def _inprocess_engines(c: Any, n: int) -> None:
    pe_port, de_port = c.pe["p0"].ports["p0.e0"], c.de["d0"].ports["d0.e0"]
    spec = c.spec
    scratch = np.empty((PROMPT_BLOCKS * BT + BT, spec.kv_bytes_per_token_per_layer), np.uint8)

    async def prefill() -> None:
        for _ in range(n):
            h = await pe_port.next_request()
            for layer in range(spec.num_layers):
                _prefill_layer(await h.layer(layer), h.output(layer), scratch)
                await h.put_layer(layer)
            await h.finish(1)

    async def decode() -> None:
        for _ in range(n):
            req = await de_port.next_ready()
            for layer in range(spec.num_layers):
                np.copyto(scratch[:req.info.prompt_tokens], req.layer(layer))
            await req.took_kv()
            await req.finish([1, 2])

    await asyncio.gather(prefill(), decode())


def peer_main(argv: list[str]) -> int:
    """``--peer prefill|decode SOCK ENGINE N SPEC_JSON wait|nowait``: an engine in its own
    process (``nowait``: ``put_layer(wait=False)``, puts pipelined behind the compute)."""
    import msgspec
    from common.kv import KVSpec
    from services.engine_api.remote import SyncEngineClient
    role, sock, engine_id, n, spec_json = argv[0], argv[1], argv[2], int(argv[3]), argv[4]
    wait = argv[5] == "wait"
    spec = msgspec.json.decode(spec_json, type=KVSpec)
    c = SyncEngineClient.connect(sock, engine_id=engine_id, role=role, kv_spec=spec)
    scratch = np.empty((PROMPT_BLOCKS * BT + BT, spec.kv_bytes_per_token_per_layer), np.uint8)
    waits, puts = [], []
    print(json.dumps({"attached": engine_id}), flush=True)
    for _ in range(n):
        if role == "prefill":
            h = c.next_prefill(60.0)
            assert h is not None
            for layer in range(spec.num_layers):
                t0 = time.perf_counter()
                hit = h.layer(layer, 30.0)
                t1 = time.perf_counter()
                _prefill_layer(hit, h.output(layer), scratch)
                t2 = time.perf_counter()
                h.put_layer(layer, wait=wait)
                waits.append(t1 - t0)
                puts.append(time.perf_counter() - t2)
            h.finish(1)
        else:
            d = c.next_decode(60.0)
            assert d is not None
            for layer in range(spec.num_layers):
                np.copyto(scratch[:d.info.prompt_tokens], d.layer(layer))
            d.took_kv()
            d.finish([1, 2])
    c.close()
    print(json.dumps({"done": n, "layer_s": waits, "put_s": puts}), flush=True)
    return 0


# --------------------------------------------------------------------------- the runs

WARMUP = 3          # first requests of each side (connections, page faults) are not counted


async def _requests(c: Any, n: int, tag: str) -> list[float]:
    """Submit ``n`` plans one after the other; seconds from submit to the DE's finish (the
    first ``WARMUP`` left out)."""
    out = []
    de = c.de["d0"]
    for i in range(n):
        plan, keys = _plan(c, f"{tag}{i}", i)
        await c.store_blocks(keys[:HIT_BLOCKS])
        t0 = time.perf_counter()
        c.pe["p0"].submit_plan(plan)
        while not any(r.request_id == plan.request_id and r.stage == "finished"
                      for r in de.reports):
            await asyncio.sleep(0.001)
        out.append(time.perf_counter() - t0)
    return out[WARMUP:]


async def _cross_process(c: Any, root: Path, n: int, puts: str) -> tuple[list[float], dict]:
    """``n`` requests to engines in two other processes; (request times, prefill peer's
    per-call times)."""
    import msgspec
    spec = msgspec.json.encode(c.spec).decode()
    peers = [subprocess.Popen([sys.executable, "-m", "bench.engine_ipc_bench", "--peer", role,
                               str(root / sock), eng, str(n), spec, puts],
                              stdout=subprocess.PIPE, text=True)
             for role, sock, eng in (("prefill", "p0.sock", "p0.e0"),
                                     ("decode", "d0.sock", "d0.e0"))]
    try:
        for p in peers:
            await asyncio.to_thread(p.stdout.readline)      # attached
        times = await _requests(c, n, f"ipc-{puts}-")
        outs = [json.loads((await asyncio.to_thread(p.communicate, timeout=60))[0]
                           .splitlines()[-1]) for p in peers]
    finally:
        for p in peers:
            if p.poll() is None:
                p.kill()
                p.wait()
    return times, outs[0]


async def _run(n: int) -> dict[str, Any]:
    from tools.cluster.inprocess import local_datapath
    with tempfile.TemporaryDirectory(prefix="dualpath-engine-ipc-") as tmp:
        root = Path(tmp)
        async with local_datapath(root, scheduler=False, engines=False,
                                  overrides=_overrides(root)) as c:
            engines = asyncio.ensure_future(_inprocess_engines(c, n))
            local = await _requests(c, n, "in")
            await engines
            remote, peer = await _cross_process(c, root, n, "wait")
            piped, peer_piped = await _cross_process(c, root, n, "nowait")
            leaks = c.leaks()
    return {"inprocess_s": local, "cross_process_s": remote, "pipelined_s": piped,
            "peer": peer, "peer_pipelined": peer_piped, "leaks": leaks,
            "per_call_note": "measured in the prefill engine process, all requests",
            "kv": KV, "prompt_tokens": PROMPT_BLOCKS * BT + 12, "hit_tokens": HIT_BLOCKS * BT}


def _ms(xs: list[float], q: float) -> float:
    return round(float(np.quantile(np.asarray(xs), q)) * 1e3, 3)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer"]:
        return peer_main(argv[1:])
    p = bench_parser("engine_ipc", __doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=None)
    args = p.parse_args(argv)
    from common.logging import configure_logging
    configure_logging("warning", None)
    n = max(args.requests or (20 if args.quick else 60), WARMUP + 2)
    res = asyncio.run(_run(n))
    rows = [{"engines": name, "requests": len(xs), "p50_ms": _ms(xs, 0.5),
             "p90_ms": _ms(xs, 0.9), "mean_ms": round(statistics.fmean(xs) * 1e3, 3)}
            for name, xs in (("in-process", res["inprocess_s"]),
                             ("cross-process", res["cross_process_s"]),
                             ("cross-process, put_layer(wait=False)", res["pipelined_s"]))]
    print_table(rows, ["engines", "requests", "p50_ms", "p90_ms", "mean_ms"])
    peer = res["peer"]
    calls = {"layer_p50_us": _ms(peer["layer_s"], 0.5) * 1e3,
             "put_layer_p50_us": _ms(peer["put_s"], 0.5) * 1e3,
             "put_layer_nowait_p50_us": _ms(res["peer_pipelined"]["put_s"], 0.5) * 1e3}
    print(f"cross-process engine, per layer: layer() p50 {calls['layer_p50_us']:.0f} us, "
          f"put_layer() p50 {calls['put_layer_p50_us']:.0f} us (wait=False: "
          f"{calls['put_layer_nowait_p50_us']:.0f} us)")
    ratio = rows[1]["p50_ms"] / rows[0]["p50_ms"]
    print(f"request time cross-process / in-process: {ratio:.3f} (pipelined puts: "
          f"{rows[2]['p50_ms'] / rows[0]['p50_ms']:.3f})")
    ok = not any(res["leaks"].values())
    write_results(args.out, "engine_ipc",
                  headline("engine_ipc_request_time_ratio", ratio, GOAL, higher_is_better=False),
                  {"rows": rows, "per_call": calls, "no_leaked_pages": ok,
                   "kv": res["kv"], "prompt_tokens": res["prompt_tokens"],
                   "hit_tokens": res["hit_tokens"], "requests": n})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
