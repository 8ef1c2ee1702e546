"""``[engine_sim]``: the emulated engines (cost model, prefill mode, time scale, checks)."""

from __future__ import annotations

from typing import Literal

from common.config import Section


class EngineSimConfig(Section):
    """How the emulated prefill/decode engines spend time and check bytes."""

    mode: Literal["layerwise", "whole"] = "layerwise"   # whole = the basic mode (no overlap)
    model: str | None = None               # cost-model preset; None: the KV preset's name
    time_scale: float = 1.0                # multiplies every predicted second (local runs: < 1)
    quota_s: float = 0.300                 # intra-engine batching compute quota (paper §6.2)
    max_batch_tokens: int | None = None
    verify: bool = True                    # check hit KV (prefill) and full prompt KV (decode)
    hbm_copy: bool = True                  # decode copies the prompt KV into its own "HBM"
    decode_max_batch: int = 256
    vocab: int = 100_000

    def __post_init__(self) -> None:
        if not self.time_scale >= 0:
            raise ValueError(f"engine_sim.time_scale must be >= 0, got {self.time_scale}")
        if self.quota_s <= 0 or self.decode_max_batch <= 0 or self.vocab <= 0:
            raise ValueError("engine_sim.quota_s, decode_max_batch and vocab must be positive")
