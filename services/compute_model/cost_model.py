"""FLOPs → seconds cost model for prefill and decode, per model preset (paper §6).

Prefill of ``new`` tokens on top of ``cached`` tokens of context costs

* **linear layers**: ``2 · linear_params · new`` FLOPs (``linear_params`` = activated,
  non-embedding parameters);
* **attention**: ``attn_pair_flops · layers · pairs(cached, new, window)``, where ``pairs`` counts
  the causal (query, key) pairs: new token ``i`` (1-based) sees ``cached + i`` keys, or at most
  ``window`` of them under DeepSeek Sparse Attention (top-k). For dense models this is
  ``new·cached + new·(new+1)/2 ≈ new·(cached + new/2)``;
* **DSA lightning indexer** (DeepSeek-V3.2 family): ``indexer_pair_flops · layers`` per *dense*
  causal pair (the indexer scores every earlier token to pick the top-k).

Each part is turned into seconds with its own effective FLOP/s, the quantity the paper fits by
profiling per hardware and parallelism setup; the defaults below are *estimates* for one Hopper
GPU (H800/H100 SXM: 989 TFLOP/s dense BF16, 1979 TFLOP/s dense FP8) and must be replaced by
profiled numbers before trusting absolute times. ``attention_s`` (attention + indexer) is what the
intra-engine batcher's 300 ms quota limits (paper §6); ``prefill_s`` adds the linear layers.

Decode: one step of a decode engine costs ``decode_base_s + batch · decode_s_per_seq +
context_tokens · decode_s_per_ctx_token`` (weights/communication, per-sequence work, KV bytes
read from HBM), a memory-bound model whose constants are likewise estimates.

Where the FLOPs constants come from (checked by ``tests/test_batching.py`` against Table 1):

* **qwen2.5-32b**: ≈31e9 non-embedding params; 64 layers; 40 query heads × 128 dims →
  ``4 · 5120`` FLOPs per pair per layer (QKᵀ and PV). Reproduces 120/191/271 GB/PFLOP at
  16K/32K/64K context with 429 appended tokens (paper: 117–267).
* **deepseek-v3.2**: 37e9 activated params; 61 layers; absorbed MLA with 128 heads over a
  512-dim latent + 64-dim RoPE key: ``2·128·(576 + 512)`` FLOPs per pair per layer over at most
  2048 keys (top-k); lightning indexer 64 heads × 128 dims: ``2·64·128`` per dense pair. With
  61 × 656 B of KV per token this gives ≈12/22/35 GB/PFLOP (paper: 13–36, "≈22" at 32.7K).
* **ds-27b** (Appendix A.2): hidden 2560, 30 layers, 32 heads, 1 dense layer (12288) and MoE
  layers with 6 routed + 2 shared experts of 1536 → ≈3.8e9 activated params; MLA latent assumed
  equal to V3's (512 + 64), so ``2·32·(576 + 512)`` per pair, top-k 1024; indexer 32 heads × 64.
* **smollm2-135m** (the real model of docs/vllm.md, vLLM on CPU): hidden 576, 30 layers, 9
  query heads × 64 dims → ``4 · 9 · 64`` per pair; ≈106e6 non-embedding params. Rates are those
  of vLLM's CPU backend on one core (docs/vllm.md, 'Engine facts': 481 prompt tokens in ~1 s).
* **test-small**: synthetic, sized so a few thousand tokens take tens of milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from common.errors import InvalidArgument


def causal_pairs(cached: int, new: int, window: int | None = None) -> int:
    """(query, key) pairs when ``new`` tokens attend causally over ``cached`` + earlier new tokens.

    Token ``i`` (1-based) of the new tokens sees ``cached + i`` keys, capped at ``window``.
    """
    if window is None:
        return new * cached + new * (new + 1) // 2
    m = min(max(window - cached, 0), new)  # tokens still under the window
    return m * cached + m * (m + 1) // 2 + (new - m) * window


class ModelCost(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Per-model FLOPs constants and effective rates of one GPU; see the module docstring."""

    name: str
    layers: int
    linear_params: float
    attn_pair_flops: float
    attn_window: int | None = None
    indexer_pair_flops: float = 0.0
    linear_flops_per_s: float
    attn_flops_per_s: float
    indexer_flops_per_s: float = 1.0e15
    decode_base_s: float
    decode_s_per_seq: float
    decode_s_per_ctx_token: float

    # ------------------------------------------------------------------ FLOPs
    def linear_flops(self, new: int) -> float:
        return 2.0 * self.linear_params * new

    def attention_flops(self, cached: int, new: int) -> float:
        """Main attention FLOPs (sparse when ``attn_window`` is set), excluding the indexer."""
        return self.attn_pair_flops * self.layers * causal_pairs(cached, new, self.attn_window)

    def indexer_flops(self, cached: int, new: int) -> float:
        if not self.indexer_pair_flops:
            return 0.0
        return self.indexer_pair_flops * self.layers * causal_pairs(cached, new)

    def prefill_flops(self, cached: int, new: int) -> float:
        return self.linear_flops(new) + self.attention_flops(cached, new) + self.indexer_flops(cached, new)

    # ------------------------------------------------------------------ seconds
    def attention_s(self, cached: int, new: int) -> float:
        """Predicted attention-layer time (all layers) of one (cached, new) pair: the batching metric."""
        t = self.attention_flops(cached, new) / self.attn_flops_per_s
        if self.indexer_pair_flops:
            t += self.indexer_flops(cached, new) / self.indexer_flops_per_s
        return t

    def prefill_s(self, cached: int, new: int) -> float:
        """Predicted prefill time (linear layers + attention) of ``new`` tokens over ``cached``."""
        return self.linear_flops(new) / self.linear_flops_per_s + self.attention_s(cached, new)

    def attention_fn(self) -> Callable[[int, int], float]:
        """``attention_s`` as a closure over this model's constants, for hot loops.

        The batcher calls its cost function several times per forward batch (a binary search
        for the cut chunk); the simulator makes millions of such calls. Same arithmetic in the
        same order as ``attention_s``, so the results are identical to the last bit.
        """
        apl, rate, win = self.attn_pair_flops * self.layers, self.attn_flops_per_s, self.attn_window
        ipl, irate = self.indexer_pair_flops * self.layers, self.indexer_flops_per_s
        if not self.indexer_pair_flops:
            ipl = 0.0

        def attention_s(cached: int, new: int) -> float:
            dense = new * cached + new * (new + 1) // 2
            if win is None:
                pairs = dense
            else:
                m = win - cached
                m = 0 if m < 0 else (new if m > new else m)
                pairs = m * cached + m * (m + 1) // 2 + (new - m) * win
            t = apl * pairs / rate
            if ipl:
                t += ipl * dense / irate
            return t

        return attention_s

    def prefill_fn(self) -> Callable[[int, int], float]:
        """``prefill_s`` as a closure (see ``attention_fn``); identical results."""
        lin, lrate, attn = 2.0 * self.linear_params, self.linear_flops_per_s, self.attention_fn()

        def prefill_s(cached: int, new: int) -> float:
            return lin * new / lrate + attn(cached, new)

        return prefill_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences holding ``context_tokens`` tokens in total."""
        if batch <= 0:
            return 0.0
        return (self.decode_base_s + batch * self.decode_s_per_seq
                + context_tokens * self.decode_s_per_ctx_token)

    def prompt_tokens_per_s(self, context: int, append: int) -> float:
        """Prompt tokens (hit + new) one GPU prefills per second for requests of this shape.

        This is the rate β is derived from (β = tokens one GPU processes in 5 s, paper §6.4).
        """
        if append <= 0 or context < 0:
            raise InvalidArgument(f"need append > 0 and context >= 0, got {append=}, {context=}")
        return (context + append) / self.prefill_s(context, append)

    def cache_compute_ratio(self, kv_bytes_per_token: int, context: int, append: int) -> float:
        """Hit-KV bytes per prefill FLOP in GB/PFLOP (paper Table 1's metric)."""
        return kv_bytes_per_token * context / self.prefill_flops(context, append) * 1e15 / 1e9


class PrefillLoad:
    """A request's prefill-engine load in **reference-shape tokens** (the unit of β, tok_e).

    Raw prompt tokens are a poor proxy for PE work: a cold token (no hit) costs the linear
    layers, a hit token almost nothing, so at DeepSeek V3.2's reference shape (32,721 hit + 429
    new) a 300-token cold prompt is ~40× the work per token. Counted raw, β (5 s of prefill *at
    the reference shape*) admits minutes of cold work, and the first PE group to fetch during a
    burst of cold turns (every agent's first rounds, a restart) takes all of it while the other
    groups idle. The load is therefore the request's predicted prefill time expressed in tokens
    of the reference shape, ``prefill_s(hit, new) / prefill_s(ref) · ref_tokens``, never below
    its raw prompt tokens (its hit KV still has to be loaded layer by layer and held). At the
    reference shape both are equal, so β keeps its meaning: 5 s of work on one GPU.

    Only ratios of the cost model are used, so a profiled ``pe_tokens_per_s`` (absolute rate)
    and a time-scaled emulation leave the weights unchanged.
    """

    __slots__ = ("_fn",)

    def __init__(self, cost: ModelCost, ref_context: int, ref_append: int) -> None:
        if ref_append <= 0 or ref_context < 0:
            raise InvalidArgument(f"need ref_append > 0 and ref_context >= 0, "
                                  f"got {ref_append=}, {ref_context=}")
        scale = (ref_context + ref_append) / cost.prefill_s(ref_context, ref_append)
        # prefill_s inlined (one call per submitted request): the same operations in the same
        # order as ModelCost.prefill_s / attention_s, so the value is identical to the bit.
        lin, lrate = 2.0 * cost.linear_params, cost.linear_flops_per_s
        apl, rate, win = cost.attn_pair_flops * cost.layers, cost.attn_flops_per_s, cost.attn_window
        ipl = cost.indexer_pair_flops * cost.layers if cost.indexer_pair_flops else 0.0
        irate = cost.indexer_flops_per_s

        def load(hit: int, new: int) -> int:
            dense = new * hit + new * (new + 1) // 2
            if win is None:
                pairs = dense
            else:
                m = win - hit
                m = 0 if m < 0 else (new if m > new else m)
                pairs = m * hit + m * (m + 1) // 2 + (new - m) * win
            t = apl * pairs / rate
            if ipl:
                t += ipl * dense / irate
            w = int((lin * new / lrate + t) * scale + 0.5)
            raw = hit + new
            return w if w > raw else raw

        self._fn = load

    def __call__(self, hit: int, new: int) -> int:
        return self._fn(hit, new)

    @property
    def fn(self) -> Callable[[int, int], int]:
        """The same as calling this object, one call level less (the core's submit path)."""
        return self._fn


_HOPPER_BF16 = 989e12
_HOPPER_FP8 = 1979e12

PRESETS: dict[str, ModelCost] = {
    # Dense GQA, BF16: linear at ~60% of peak, FlashAttention-3-class attention at ~50%.
    # Decode: 64 GB of weights per DP rank at 3.35 TB/s ≈ 19 ms; 256 KiB of KV per context token.
    "qwen2.5-32b": ModelCost(
        name="qwen2.5-32b", layers=64, linear_params=31e9, attn_pair_flops=4 * 40 * 128,
        linear_flops_per_s=0.6 * _HOPPER_BF16, attn_flops_per_s=0.5 * _HOPPER_BF16,
        decode_base_s=0.019, decode_s_per_seq=2e-4, decode_s_per_ctx_token=262144 / 3.35e12),
    # MoE FP8 (DeepGEMM) at ~40% of FP8 peak under EP; sparse MLA prefill ~500 TFLOP/s; indexer
    # FP8. Decode: ~20 ms per step (expert weights + EP all-to-all), top-k KV per sequence.
    "deepseek-v3.2": ModelCost(
        name="deepseek-v3.2", layers=61, linear_params=37e9, attn_pair_flops=2 * 128 * (576 + 512),
        attn_window=2048, indexer_pair_flops=2 * 64 * 128,
        linear_flops_per_s=0.4 * _HOPPER_FP8, attn_flops_per_s=0.5 * _HOPPER_BF16,
        indexer_flops_per_s=0.5 * _HOPPER_FP8,
        decode_base_s=0.020, decode_s_per_seq=3e-5, decode_s_per_ctx_token=61 * 132 / 3.35e12),
    # The paper's scaled-down DS 27B: small experts run far below peak, hence the lower rates.
    "ds-27b": ModelCost(
        name="ds-27b", layers=30, linear_params=3.8e9, attn_pair_flops=2 * 32 * (576 + 512),
        attn_window=1024, indexer_pair_flops=2 * 32 * 64,
        linear_flops_per_s=0.25 * _HOPPER_FP8, attn_flops_per_s=0.4 * _HOPPER_BF16,
        indexer_flops_per_s=0.4 * _HOPPER_FP8,
        decode_base_s=0.008, decode_s_per_seq=2e-5, decode_s_per_ctx_token=30 * 68 / 3.35e12),
    # vLLM's CPU backend, one thread per engine: ~500 prompt tokens/s measured (1e11 FLOP/s
    # linear); decode steps of tens of ms. Estimates for placement only, not for TTFT claims.
    "smollm2-135m": ModelCost(
        name="smollm2-135m", layers=30, linear_params=106e6, attn_pair_flops=4 * 9 * 64,
        linear_flops_per_s=1e11, attn_flops_per_s=2e10,
        decode_base_s=0.02, decode_s_per_seq=2e-3, decode_s_per_ctx_token=1e-6),
    # Synthetic: 2k new tokens over 8k cached ≈ 50 ms of prefill; an empty decode step 5 ms.
    "test-small": ModelCost(
        name="test-small", layers=4, linear_params=1e9, attn_pair_flops=4 * 1024,
        linear_flops_per_s=2e14, attn_flops_per_s=1e13,
        decode_base_s=0.005, decode_s_per_seq=1e-5, decode_s_per_ctx_token=1e-8),
}


# the same model in float32 (the real-engine tests): placement estimates only, as above
PRESETS["smollm2-135m-f32"] = msgspec.structs.replace(PRESETS["smollm2-135m"], name="smollm2-135m-f32")


def cost_model(name: str) -> ModelCost:
    """The preset named like ``common.kv.PRESETS`` (``qwen2.5-32b``, ``deepseek-v3.2``, …)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgument(f"unknown cost-model preset {name!r}; known: {sorted(PRESETS)}") from None
