"""``dualpath bench engine``: a later turn's TTFT on real vLLM, dualpath loading vs recompute.

Real vLLM (CPU backend) on SmolLM2-135M in float32 (docs/vllm.md "Why the equality tests run
fp32"), each role pinned to its own core, all instances in their own processes from the vLLM
venv: a prefill instance with the DualPathConnector attached to a PE receiver, a decode
instance attached to a DE loader (an in-process dualpath data path: gateways on this host's
disk, PE receiver, DE loader), a plain instance (no connector, prefix caching off: vLLM
recomputes) and a peer, vLLM's bundled ExampleConnector loading the same prompt from a
directory on the same disk. Per context length: turn 1 stores its KV (dualpath: the decode
side writes the prompt and output back; ExampleConnector: the same prompt run once), turn 2
is timed — the prefill instance's time to its first token with dualpath loading the hit vs
the plain instance recomputing the whole prompt vs ExampleConnector loading it.

Headline ``engine_ttft_vs_recompute`` = dualpath TTFT ÷ recompute TTFT at the longest context,
goal ≤ 0.30 (lower is better). Also reported: the peak RSS of every instance's process tree.
``--quick``: the 1k context only (the vLLM loads dominate: ~1-2 min on a busy 2-core host).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import bench_parser, headline, print_table, write_results
from tools.vllm_engines import (DTYPE, PRESET, REPO, VLLM_PYTHON, Engine, agent_text_tokens,
                                model_dir)

GOAL = 0.30
BT = 64
GEN = 8
REPEATS = 5
MiB = 1 << 20


async def _run(contexts: list[int], tmp: Path) -> dict[str, Any]:
    from common.kv import block_keys_from_tokens
    from tools.cluster.inprocess import local_datapath

    model = model_dir()
    assert model is not None
    text = agent_text_tokens(model, n_items=260)
    max_len = max(contexts) + 256
    sock = {"pe_receiver": {"engine_socket": str(tmp / "p0.sock"), "engines": 1,
                            "buffer_bytes": 384 * MiB},
            "de_loader": {"engine_socket": str(tmp / "d0.sock"), "engines": 1,
                          "buffer_bytes": 384 * MiB},
            "kv": {"preset": PRESET},
            "gateway_service": {"staging_bytes": 32 * MiB, "max_batch_bytes": 8 * MiB}}
    async with local_datapath(tmp, scheduler=False, engines=False, overrides=sock) as c:
        common = ["--max-model-len", str(max_len)]
        engines = await Engine.start_all([
            (model, "prefill", tmp, [*common, "--socket", sock["pe_receiver"]["engine_socket"],
                                     "--engine-id", "p0.e0"]),
            (model, "decode", tmp, [*common, "--socket", sock["de_loader"]["engine_socket"],
                                    "--engine-id", "d0.e0"]),
            (model, "plain", tmp, common),
            (model, "example", tmp, [*common, "--store", str(tmp / "example")])])
        prefill, decode, plain, example = engines
        try:
            rows = []
            for n, ctx in enumerate(contexts):
                rows.append(await _context(c, prefill, decode, plain, example,
                                           text[n * 7:n * 7 + ctx], block_keys_from_tokens))
            rss = {e.role: round(e.peak_rss_mb(), 1) for e in engines}
        finally:
            for e in engines:
                await e.stop()
    return {"rows": rows, "peak_rss_mb": rss}


async def _context(c, prefill, decode, plain, example, prompt, keys_of) -> dict[str, Any]:
    first = prompt[:len(prompt) - 200]
    await _through_dualpath(c, prefill, decode, first, f"w-{len(prompt)}", keys_of)
    await example.generate(prompt, 1)                               # ExampleConnector saves
    dp, rc, ex, hits = [], [], [], []
    for i in range(REPEATS):
        t, hit = await _through_dualpath(c, prefill, decode, prompt, f"t-{len(prompt)}-{i}",
                                         keys_of)
        dp.append(t)
        hits.append(hit)
        rc.append((await plain.generate(prompt, 1))["latency_s"])
        ex.append((await example.generate(prompt, 1))["latency_s"])
    med = statistics.median
    return {"context": len(prompt), "hit_tokens": hits[-1],
            "dualpath_ttft_ms": round(med(dp) * 1e3, 1),
            "recompute_ttft_ms": round(med(rc) * 1e3, 1),
            "example_ttft_ms": round(med(ex) * 1e3, 1),
            "ratio_vs_recompute": med(dp) / med(rc), "ratio_vs_example": med(dp) / med(ex),
            "samples_ms": {"dualpath": [round(t * 1e3, 1) for t in dp],
                           "recompute": [round(t * 1e3, 1) for t in rc],
                           "example": [round(t * 1e3, 1) for t in ex]}}


async def _through_dualpath(c, prefill, decode, prompt, rid, keys_of) -> tuple[float, int]:
    """One request through the data path (plan submitted to the PE receiver, as the front's
    scheduler would); the prefill instance's time to its first token and the hit."""
    from common.protocol import Endpoint, RequestPlan

    keys = keys_of(prompt, BT)
    hit_blocks = min(await c.stored_prefix(keys), (len(prompt) - 1) // BT)
    n_full = len(prompt) // BT
    de = c.de["d0"]
    de_endpoint = Endpoint(de.node_id, de.name, "127.0.0.1", de.rpc_port, *de.ucx_address)
    side = "de" if hit_blocks else "none"
    c.pe["p0"].submit_plan(RequestPlan(
        rid, 0, "bench", "p0.e0", "p0", "d0.e0", "d0", side, "d0" if hit_blocks else "",
        hit_blocks * BT, len(prompt) - hit_blocks * BT, GEN, 1 << 20, keys[:hit_blocks],
        keys[hit_blocks:], de_endpoint, None, 900.0, prompt[n_full * BT:]))
    pre, _ = await asyncio.gather(
        prefill.generate(prompt, 1, {"request_id": rid, "hit_tokens": hit_blocks * BT}),
        decode.generate(prompt, GEN, {"request_id": rid}))
    for _ in range(600):
        if any(r.request_id == rid and r.stage == "finished" for r in de.reports):
            break
        await asyncio.sleep(0.05)
    return pre["latency_s"], hit_blocks * BT


def load_rate(tokens: int) -> dict[str, Any]:
    """The connector's scatter into a vLLM-shaped paged cache vs memcpy (in the vLLM venv:
    integrations/vllm/load_rate.py), for ``tokens`` tokens of hit."""
    out = subprocess.run([str(VLLM_PYTHON), "-m", "integrations.vllm.load_rate", "--tokens",
                          str(tokens), "--dtype", DTYPE], capture_output=True, text=True,
                         cwd=REPO, timeout=600, check=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("engine", __doc__.splitlines()[0])
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if model_dir() is None:
        print("bench engine needs the vLLM venv and the model: make vllm-env vllm-model",
              file=sys.stderr)
        return 2
    from common.logging import configure_logging
    configure_logging("warning", None)
    contexts = [1024] if args.quick else [1024, 2048, 4096]
    with tempfile.TemporaryDirectory(prefix="dualpath-bench-engine-") as tmp:
        res = asyncio.run(_run(contexts, Path(tmp)))
    print_table(res["rows"], ["context", "hit_tokens", "dualpath_ttft_ms", "recompute_ttft_ms",
                              "example_ttft_ms", "ratio_vs_recompute", "ratio_vs_example"])
    print(f"peak RSS per instance (MB, process tree): {res['peak_rss_mb']}")
    res["load_rate"] = load_rate(max(contexts))
    lr = res["load_rate"]
    print(f"KV load into vLLM's paged cache ({lr['tokens']} tokens x 30 layers, "
          f"{lr['bytes'] / 2**20:.0f} MiB): {lr['load_gb_s']:.2f} GB/s vs memcpy "
          f"{lr['memcpy_gb_s']:.2f} GB/s of the same bytes ({lr['load_vs_memcpy']:.2f}x)")
    ratio = res["rows"][-1]["ratio_vs_recompute"]
    write_results(args.out, "engine",
                  headline("engine_ttft_vs_recompute", ratio, GOAL, higher_is_better=False), res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
