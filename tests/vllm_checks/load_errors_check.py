"""A prefill forward whose dualpath session ends mid-forward reports the hit rows it will never
load (vLLM venv: vLLM's metadata types and torch, no model).

Run by tests/test_vllm_load_errors.py: the worker half (``WorkerHalf``) over three fake cache
layers. The save of layer 0 fails (the DE it forwards to died), which drops the session; the
loads of layers 1 and 2 then have no session. Their rows are already counted computed by vLLM
(and in its prefix cache), so their blocks must reach ``get_block_ids_with_load_errors`` —
silently skipping them left garbage in cached blocks that the re-planned attempt took as a
local hit (ci21, stop 31's landing run). A failed load reports its blocks too. Prints
``RESULT {...}``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import numpy as np
import torch

from common.kv import KVSpec
from integrations.vllm.metadata import DualPathMetadata, ReqStep
from integrations.vllm.worker_half import WorkerHalf

LAYERS, BLOCKS, HEADS, HEAD, BS = 3, 8, 2, 8, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class FakeSession:
    """A claimed prefill: hit rows per layer; the output of ``broken_layer`` cannot be saved;
    ``lost_layer``'s hit never arrives."""

    def __init__(self, hit: int, token_bytes: int, broken_layer: int | None = None,
                 lost_layer: int | None = None) -> None:
        self.hit_tokens, self.token_bytes = hit, token_bytes
        self.broken_layer, self.lost_layer = broken_layer, lost_layer
        self.failed: str | None = None
        self.loaded: list[int] = []

    def layer(self, layer: int, timeout_s: float) -> np.ndarray:
        if layer == self.lost_layer:
            raise TimeoutError(f"layer {layer} not loaded in {timeout_s}s")
        self.loaded.append(layer)
        return np.full((self.hit_tokens, self.token_bytes), 7, dtype=np.uint8)

    def output(self, layer: int) -> np.ndarray:
        if layer == self.broken_layer:
            raise ConnectionError("the DE closed the connection")
        return np.zeros((64, self.token_bytes), dtype=np.uint8)

    def put_layer(self, layer: int, wait: bool = True) -> None:
        pass

    def fail(self, reason: str) -> None:
        self.failed = reason


def worker(meta: DualPathMetadata) -> tuple[WorkerHalf, list[torch.Tensor]]:
    caches = [torch.zeros((BLOCKS, HEADS, BS, 2 * HEAD), dtype=torch.float32)
              for _ in range(LAYERS)]
    token_bytes = HEADS * 2 * HEAD * 4
    source = NS(spec=KVSpec("t", LAYERS, token_bytes, block_tokens=BS))
    cfg = NS(cache_config=NS(block_size=BS), compilation_config=NS(static_forward_context={}))
    w = WorkerHalf(cfg, source, lambda: meta, decode=False, layer_timeout_s=1.0,
                   claim_timeout_s=1.0, open_threads=1)
    w.register(dict(zip(NAMES, caches)))
    return w, caches


def forward(w: WorkerHalf, caches: list[torch.Tensor]) -> None:
    """vLLM's layer hooks for one forward: load layer l, compute (nothing here), save it."""
    w.start(NS(attn_metadata=object()))
    for name, cache in zip(NAMES, caches):
        w.load_layer(name)
        w.save_layer(name, cache)
    w.end_step()


def run(broken_layer: int | None, lost_layer: int | None) -> dict:
    # rows [0, 32) loaded (blocks 3 and 5), rows [32, 40) computed and saved (block 6)
    step = ReqStep("r", [3, 5, 6], (0, 32), (32, 40), False, 40)
    w, caches = worker(DualPathMetadata(steps=[step]))
    session = FakeSession(32, HEADS * 2 * HEAD * 4, broken_layer, lost_layer)
    w._sessions.put("r", session)
    forward(w, caches)
    return {"load_errors": sorted(w.load_errors()), "loaded": session.loaded,
            "failed": (session.failed or "").split(":")[0]}


def main() -> None:
    print("RESULT " + json.dumps({"save_failed": run(0, None), "load_failed": run(None, 1),
                                  "ok": run(None, None)}), flush=True)


if __name__ == "__main__":
    main()
