"""The connector's KV load rate into vLLM's paged cache against a memcpy of the same bytes.

``python -m integrations.vllm.load_rate --tokens 4096 --dtype float32`` (vLLM venv; ``dualpath
bench engine`` runs it): a cache tensor of the shape vLLM 0.32's CPU backend registers for
SmolLM2-135M (``[blocks, 3 heads, 128, 2 x 64]`` per layer, 30 layers), a request whose vLLM
blocks are scattered over it (shuffled ids, as after other requests came and went), and the
hit as dualpath hands it over (``uint8 [tokens, B]`` per layer in the arena). Timed: the
connector's own ``scatter_range`` for every layer (what ``wait_for_layer_load`` does after the
bytes arrived) against ``torch.Tensor.copy_`` of the same bytes between two flat buffers — the
floor for moving them once. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from integrations.vllm.geometry import CacheGeometry, scatter_range

LAYERS, HEADS, HEAD, BLOCK = 30, 3, 64, 128


def measure(tokens: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)                  # as vLLM's worker here (one core per instance)
    blocks = -(-tokens // BLOCK)
    num_blocks = 4 * blocks
    caches = [torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD, dtype=dtype) for _ in range(LAYERS)]
    geom = CacheGeometry.of_cache(caches[0])
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))[:blocks].tolist()
    src = [torch.randint(0, 255, (tokens, geom.token_bytes), dtype=torch.uint8)
           for _ in range(LAYERS)]
    flat_dst = [torch.empty(tokens * geom.token_bytes, dtype=torch.uint8) for _ in range(LAYERS)]
    total = LAYERS * tokens * geom.token_bytes
    load, copy = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            scatter_range(geom, caches[layer], ids, 0, tokens, src[layer])
        load.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            flat_dst[layer].copy_(src[layer].view(-1))
        copy.append(time.perf_counter() - t0)
    lo, co = statistics.median(load), statistics.median(copy)
    return {"tokens": tokens, "bytes": total, "load_gb_s": total / lo / 1e9,
            "memcpy_gb_s": total / co / 1e9, "load_vs_memcpy": co / lo,
            "load_ms": lo * 1e3, "memcpy_ms": co * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(json.dumps(measure(a.tokens, getattr(torch, a.dtype), a.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
