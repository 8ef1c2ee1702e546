"""``[engine_sim]``: the emulated engines (cost model, prefill mode, time scale, checks)."""

from __future__ import annotations

from typing import Literal

from common.config import NonNegFloat, PositiveFloat, PositiveInt, Section


class EngineSimConfig(Section):
    """How the emulated prefill/decode engines spend time and check bytes."""

    mode: Literal["layerwise", "whole"] = "layerwise"   # whole = the basic mode (no overlap)
    model: str | None = None               # cost-model preset; None: the KV preset's name
    time_scale: NonNegFloat = 1.0          # multiplies every predicted second (local runs: < 1)
    quota_s: PositiveFloat = 0.300         # intra-engine batching compute quota (paper §6.2)
    max_batch_tokens: int | None = None
    verify: bool = True                    # check hit KV (prefill) and full prompt KV (decode)
    hbm_copy: bool = True                  # decode copies the prompt KV into its own "HBM"
    decode_max_batch: PositiveInt = 256
    vocab: PositiveInt = 100_000
