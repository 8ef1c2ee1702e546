"""Real-vLLM checks of the cache geometry and the connector's load path (runs in .venv-vllm).

Spawned by tests/test_vllm_geometry.py (the main venv has no torch/vllm); prints one JSON
object with what it measured, which the pytest side asserts on. Modes:

* ``roundtrip``: random KV in a tensor of vLLM's real CPU cache shape; gather -> dualpath
  bytes -> scatter into a zeroed cache equals the original, and the gathered K/V rows equal the
  ones vLLM's CPU attention reads (its own ``view(..., 2 * block_size, -1).chunk(2, dim=2)``).
* ``run``: one vLLM instance (connector on, a ``LocalKVStore`` directory) runs prompts given as
  token-id lists and reports the greedy outputs, the hit of each and the store's byte counters.
* ``plain``: the same prompts on plain vLLM (no connector, prefix caching off).
* ``hf_kv``: the model's K/V for a prefix computed by transformers (fp32), compared with the
  stored dualpath bytes of the same prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def roundtrip() -> dict:
    import torch

    from integrations.vllm.geometry import (
        CacheGeometry,
        gather_layer,
        scatter_layer,
        scatter_range,
        token_slots,
    )

    torch.manual_seed(0)
    cache = torch.randn(40, 3, 128, 128).to(torch.bfloat16)    # vLLM's (docs/vllm.md)
    geom = CacheGeometry.of_cache(cache)
    block_ids = [7, 3, 31, 12]
    tokens = 400                                                # a partial last block
    slots = token_slots(block_ids, geom.block_size, 0, tokens)
    data = gather_layer(geom, cache, slots)
    fresh = torch.zeros_like(cache)
    scatter_layer(geom, fresh, slots, data)
    # the measured layout, written out independently: per block and head the K half holds
    # K transposed ([head, block_size]), the V half V row-major ([block_size, head])
    halves = cache.view(40, 3, 2, 128 * 64)
    key_t = halves[:, :, 0].reshape(40, 3, 64, 128)
    value = halves[:, :, 1].reshape(40, 3, 128, 64)
    kv = data.view(torch.bfloat16).view(tokens, 2, 3, 64)
    t = torch.arange(tokens)
    blk = torch.tensor(block_ids)[t // 128]
    k_ref = torch.stack([key_t[b, :, :, o] for b, o in zip(blk.tolist(), (t % 128).tolist())])
    v_ref = torch.stack([value[b, :, o] for b, o in zip(blk.tolist(), (t % 128).tolist())])
    # the block-wise load (whole vLLM blocks at once) writes what the token path writes, for
    # ranges starting and ending inside, on and across block boundaries
    range_equal = True
    for a, b in [(0, 400), (64, 384), (100, 300), (128, 256), (5, 6), (127, 129), (0, 512)]:
        src = gather_layer(geom, cache, token_slots(block_ids, 128, a, b))
        x, y = torch.zeros_like(cache), torch.zeros_like(cache)
        scatter_layer(geom, x, token_slots(block_ids, 128, a, b), src)
        scatter_range(geom, y, block_ids, a, b, src)
        range_equal &= bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))
    touched = torch.zeros(40, dtype=torch.bool)
    touched[block_ids] = True
    return {
        "amx": amx_against_the_kernel(),
        "token_bytes": geom.token_bytes,
        "bytes_shape": list(data.shape),
        "k_equal": bool(torch.equal(kv[:, 0], k_ref)),
        "v_equal": bool(torch.equal(kv[:, 1], v_ref)),
        "scatter_equal": bool(torch.equal(gather_layer(geom, fresh, slots), data)),
        "untouched_zero": bool((fresh[~touched] == 0).all()),
        "range_equal": range_equal,
    }


def amx_against_the_kernel() -> dict | None:
    """On a CPU with AMX (None elsewhere): K/V written by vLLM's own ``amx`` kernel, gathered
    back by the connector's layout, equal what was written; the connector's scatter (token
    path and block path) writes the kernel's bytes — for head sizes 64 and 128."""
    import torch
    from vllm import _custom_ops as ops

    from integrations.vllm.geometry import (
        CacheGeometry,
        gather_layer,
        scatter_layer,
        scatter_range,
        token_slots,
    )

    if not torch.cpu._is_amx_tile_supported():
        return None
    torch.manual_seed(1)
    out = {}
    for head in (64, 128):
        cache = torch.zeros(12, 3, 128, 2 * head, dtype=torch.bfloat16)
        key_cache, value_cache = cache.view(12, 3, 256, head).chunk(2, dim=2)
        tokens, block_ids = 333, [5, 2, 9]
        key = torch.randn(tokens, 3, head).to(torch.bfloat16)
        value = torch.randn(tokens, 3, head).to(torch.bfloat16)
        slot_mapping = torch.tensor([block_ids[t // 128] * 128 + t % 128 for t in range(tokens)])
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, "amx")
        geom = CacheGeometry.of_cache(cache).for_isa("amx")
        slots = token_slots(block_ids, 128, 0, tokens)
        data = gather_layer(geom, cache, slots)
        got = data.view(torch.bfloat16).view(tokens, 2, 3, head)
        by_token, by_range = torch.zeros_like(cache), torch.zeros_like(cache)
        scatter_layer(geom, by_token, slots, data)
        scatter_range(geom, by_range, block_ids, 0, tokens, data)
        out[head] = {
            "gather_equal": bool(torch.equal(got[:, 0], key) and torch.equal(got[:, 1], value)),
            "scatter_equal": bool(torch.equal(by_token.view(torch.int16), cache.view(torch.int16))
                                  and torch.equal(by_range.view(torch.int16),
                                                  cache.view(torch.int16)))}
    return out


def make_llm(model: str, store: str | None):
    from vllm import LLM

    kw: dict = dict(model=model, max_model_len=2048, enforce_eager=True, dtype="bfloat16",
                    gpu_memory_utilization=0.2,
                    enable_prefix_caching=False, max_num_batched_tokens=2048)
    if store is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "DualPathConnector",
            "kv_connector_module_path": "integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"source": "local", "store_dir": store,
                                          "kv_preset": "smollm2-135m"},
        }
    return LLM(**kw)


def wait_stored(store: str, ids: list[int], deadline_s: float = 60.0) -> bool:
    """Poll until every full block of ``ids`` is in the store: the worker finishes a session
    (writes its blocks) a step after vLLM returned the request's output."""
    import time

    from common.kv import block_keys_from_tokens

    paths = [os.path.join(store, f"{k}.kv") for k in block_keys_from_tokens(ids, 64)]
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if all(os.path.exists(p) for p in paths):
            return True
        time.sleep(0.05)
    return False


def generate(llm, prompts: list[list[int]], max_tokens: int, store: str | None) -> list[dict]:
    from vllm import SamplingParams

    dualpath = store is not None
    out = []
    for i, ids in enumerate(prompts):
        extra = {"kv_transfer_params": {"dualpath": {"request_id": f"r{i}"}}} if dualpath else None
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
        res = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
        params = res.kv_transfer_params or {}
        out.append({"tokens": list(res.outputs[0].token_ids), "dualpath": params.get("dualpath"),
                    "stored": wait_stored(store, ids) if dualpath else None})
    return out


def hf_kv(model: str, store: str, ids: list[int]) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from common.kv import PRESETS, block_keys_from_tokens

    spec = PRESETS["smollm2-135m"]
    keys = block_keys_from_tokens(ids, spec.block_tokens)
    m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    with torch.no_grad():
        past = m(torch.tensor([ids[:len(keys) * 64]]), use_cache=True).past_key_values
    worst_rel, worst_cos = 0.0, 1.0
    for i, key in enumerate(keys):
        block = np.fromfile(os.path.join(store, f"{key}.kv"), dtype=np.uint8)
        stored = torch.from_numpy(block).view(torch.bfloat16).float().view(30, 64, 2, 3, 64)
        for layer in range(30):
            k, v = past.layers[layer].keys[0], past.layers[layer].values[0]  # [heads, T, head]
            ref = torch.stack([k, v])[:, :, i * 64:(i + 1) * 64].permute(2, 0, 1, 3)
            got = stored[layer]
            rel = float((got - ref).norm() / ref.norm())
            cos = float(torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0))
            worst_rel, worst_cos = max(worst_rel, rel), min(worst_cos, cos)
    return {"blocks": len(keys), "worst_rel_l2": worst_rel, "worst_cosine": worst_cos}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["roundtrip", "run", "plain", "hf_kv"])
    ap.add_argument("--model")
    ap.add_argument("--store")
    ap.add_argument("--prompts", help="JSON file: list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    if a.mode == "roundtrip":
        result = roundtrip()
    else:
        with open(a.prompts) as f:
            prompts = json.load(f)
        if a.mode == "hf_kv":
            result = hf_kv(a.model, a.store, prompts[0])
        else:
            llm = make_llm(a.model, a.store if a.mode == "run" else None)
            store = a.store if a.mode == "run" else None
            result = {"outputs": generate(llm, prompts, a.max_tokens, store)}
            import resource
            result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
