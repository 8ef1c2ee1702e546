"""The dualpath ``KVSpec`` of the model a vLLM instance serves, and the check at connect."""

from __future__ import annotations

from typing import Any

from common.errors import KVSpecMismatch
from common.kv import KVSpec

# bytes per element of the dtypes vLLM's CPU backend keeps its KV cache in
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def spec_from_vllm(vllm_config: Any, block_tokens: int = 64) -> KVSpec:
    """KVSpec from vLLM's model config: B = 2 (K, V) · kv_heads · head_size · itemsize.

    The byte layout of B is ``integrations.vllm.geometry``'s: ``[K|V][kv_head][head_size]``.
    """
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = str(model.dtype).removeprefix("torch.")
    if dtype not in _ITEMSIZE:
        raise KVSpecMismatch(f"vLLM model dtype {dtype!r} has no dualpath KV layout "
                             f"(supported: {sorted(_ITEMSIZE)})")
    token_bytes = 2 * model.get_num_kv_heads(parallel) * model.get_head_size() * _ITEMSIZE[dtype]
    return KVSpec(name=f"vllm:{model.model}", num_layers=model.get_num_layers(parallel),
                  kv_bytes_per_token_per_layer=token_bytes, block_tokens=block_tokens,
                  dtype=dtype)


def check_same_layout(model_spec: KVSpec, cluster_spec: KVSpec, cluster: str) -> None:
    """Refuse to start when the model's KV layout is not the cluster's; names both specs."""
    if model_spec.fingerprint() != cluster_spec.fingerprint():
        raise KVSpecMismatch(
            f"KV spec mismatch: the vLLM model has {model_spec.describe()}, dtype "
            f"{model_spec.dtype}; {cluster} has {cluster_spec.describe()}, dtype "
            f"{cluster_spec.dtype} — serve the model the cluster's [kv] preset describes")


def check_supported(vllm_config: Any) -> None:
    """Refuse at start, naming the reason, what the connector would only half-serve.

    * TP/PP > 1: each rank holds a slice of the heads / layers, and the dualpath KV layout
      is the whole model's (one engine = one rank).
    * MLA, hybrid (attention + mamba/sliding groups), attention-free models: their KV is not
      ``[K|V][kv_head][head_size]`` per layer, the byte layout every stored block has.

    Prefix caching (vLLM's default) is served: vLLM's own local hit may be below, at or above
    the dualpath hit (``integrations.vllm.rows``, docs/vllm.md "Prefix caching").
    """
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    reasons = []
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        reasons.append(f"tensor_parallel_size={parallel.tensor_parallel_size}, "
                       f"pipeline_parallel_size={parallel.pipeline_parallel_size} (one engine "
                       f"must hold the whole model's KV: TP = PP = 1)")
    for flag, what in (("use_mla", "MLA attention"), ("is_hybrid", "a hybrid KV layout"),
                       ("is_attention_free", "an attention-free model")):
        if getattr(model, flag, False):
            reasons.append(f"{what} (the dualpath layout is [K|V][kv_head][head_size] per layer)")
    if reasons:
        raise ValueError("DualPathConnector cannot serve this vLLM instance: " + "; ".join(reasons))


def check_failure_policy(decode: bool, policy: str, prefix_caching: bool) -> None:
    """Refuse a ``kv_load_failure_policy`` that could serve wrong KV (docs/vllm.md "A failed
    load").

    * Decode (``kv_consumer``): ``"recompute"``. Its loads are asynchronous; vLLM caches
      their blocks only once a load succeeded, so a failed one is freed uncached and the
      request recomputed locally.
    * Prefill (``kv_producer``, ``kv_both``) with prefix caching: ``"fail"``. A prefill load
      fails inside the forward, after vLLM has already put the loaded blocks in its prefix
      cache. Under ``"recompute"`` vLLM leaves them there, half written, counting on the
      request to recompute them in its next step — but a request aborted first (the front
      drops a superseded attempt as soon as dualpath re-plans it) frees them still cached,
      and the next request with that prefix (the re-planned attempt itself) computes over
      the garbage. ``"fail"`` evicts them and every block after them at once. The dualpath
      attempt has failed anyway (its session failed), so nothing is lost: it is re-planned.
      Without prefix caching no block is reused, and either policy is safe."""
    if decode:
        if policy != "recompute":
            raise ValueError("DualPathConnector: a kv_consumer (decode) instance needs "
                             "kv_load_failure_policy='recompute' in --kv-transfer-config: a "
                             f"failed load is recomputed locally (got {policy!r})")
    elif prefix_caching and policy != "fail":
        raise ValueError("DualPathConnector: a prefill instance with prefix caching needs "
                         "kv_load_failure_policy='fail' in --kv-transfer-config: under "
                         f"{policy!r} a failed load's half-written blocks stay in vLLM's "
                         "prefix cache when the request is aborted before recomputing them "
                         "(docs/vllm.md \"A failed load\"); or start vLLM with "
                         "--no-enable-prefix-caching")
