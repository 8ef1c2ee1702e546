"""Root of a whole host config file: every service section plus the tools' own (``[engine_sim]``).

``dualpath serve`` and the launcher load files with this class; the services accept it because
it extends ``services.config.ServicesConfig``. The ``[engine_sim]`` section's schema lives here,
not in ``tools/engine_sim/``: every ``dualpath serve`` reads it with the file, and serving a
gateway, a scheduler or a node without emulated engines must not load the emulator.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.config import NonNegFloat, PositiveFloat, PositiveInt, Section
from services.config import ServicesConfig


class EngineSimConfig(Section):
    """``[engine_sim]``: how the emulated prefill/decode engines spend time and check bytes
    (cost model, prefill mode, time scale, checks)."""

    mode: Literal["layerwise", "whole"] = "layerwise"   # whole = the basic mode (no overlap)
    model: str | None = None               # cost-model preset; None: the KV preset's name
    time_scale: NonNegFloat = 1.0          # multiplies every predicted second (local runs: < 1)
    quota_s: PositiveFloat = 0.300         # intra-engine batching compute quota (paper §6.2)
    max_batch_tokens: int | None = None
    verify: bool = True                    # check hit KV (prefill) and full prompt KV (decode)
    hbm_copy: bool = True                  # decode copies the prompt KV into its own "HBM"
    decode_max_batch: PositiveInt = 256
    vocab: PositiveInt = 100_000
    # share of each modelled layer (prefill) / step (decode) spent in a TP/EP collective,
    # announced to the node with collective_begin/end so its arbiter caps KV meanwhile
    # (docs/qos.md); 0 = the emulator models no collective and sends no such message
    collective_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0


class DualpathConfig(ServicesConfig):
    """A host's config file: services' sections plus the engine emulator's."""

    engine_sim: EngineSimConfig = msgspec.field(default_factory=EngineSimConfig)
