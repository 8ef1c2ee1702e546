"""Simulator configuration: a frozen Struct loaded from ``configs/sim-*.toml``.

Sections (every key optional; typos are rejected with their name):

* ``[hardware]`` — cluster shape and link rates: ``prefill_nodes`` (P), ``decode_nodes`` (D),
  ``gpus_per_node`` (g), ``snic_bytes_per_s`` (s·B, each direction), ``cnic_bytes_per_s`` (B,
  each direction), ``dram_bytes_per_s`` (M, half-duplex), HBM left for KV on a PE (whole-prompt
  prefill only) and on a DE.
* ``[model]`` — ``preset`` (KV layout of ``common.kv`` + cost model of
  ``services/scheduler/cost_model.py``), whether a node's PEs step together (DP attention + EP
  MoE), the linear layers' batch efficiency (paper Fig. 3 right).
* ``[engine]`` — fetch interval, compute quota, batch caps, read-queue concurrency, prefetch depth.
* ``[scheduler]`` — ``services.scheduler.SchedulerConfig`` as is. The simulator overrides
  ``model`` and ``snic_bytes_per_s`` from the sections above and ``policy``/``oracle``/
  ``placement`` from the mode, so α and β always follow the simulated hardware.
* ``[sim]`` — time scale, SNIC window, seed, exact per-layer mode.

``time_scale`` mirrors a slowed-down local emulation: every cost-model time (prefill, decode)
and the SLO thresholds are multiplied by it; link rates are taken as written.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from common.config import Section, load_config
from common.kv import PRESETS as KV_PRESETS
from common.kv import KVSpec
from services.scheduler import SchedulerConfig
from services.scheduler.cost_model import ModelCost, cost_model

MODES = ("basic", "+layer", "+dpl", "dualpath", "dualpath-rr", "oracle")


class HardwareConfig(Section):
    prefill_nodes: int = 2
    decode_nodes: int = 4
    gpus_per_node: int = 8
    snic_bytes_per_s: float = 50e9        # one 400 Gbps storage NIC per node (paper §6.1)
    cnic_bytes_per_s: float = 50e9        # one 400 Gbps compute NIC per GPU
    dram_bytes_per_s: float = 500e9       # M ≈ 10 × SNIC (digest §9)
    pe_hbm_kv_bytes: float = 16e9         # whole-prompt (basic) batches must fit here
    de_hbm_kv_bytes: float = 50e9         # DE HBM for request KV (the scheduler's HBM stop)

    def __post_init__(self) -> None:
        for name in ("prefill_nodes", "decode_nodes", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware.{name} must be positive, got {getattr(self, name)}")
        for name in ("snic_bytes_per_s", "cnic_bytes_per_s", "dram_bytes_per_s",
                     "pe_hbm_kv_bytes", "de_hbm_kv_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware.{name} must be positive, got {getattr(self, name)}")


class ModelSection(Section):
    preset: str = "deepseek-v3.2"
    ep_sync: bool = True                  # DP attention + EP MoE: a node's PEs run forward passes together
    batch_eff_tokens: float = 755.0       # linear-layer efficiency 1 − exp(−tokens/k); 0 disables

    def __post_init__(self) -> None:
        if self.preset not in KV_PRESETS:
            raise ValueError(f"unknown model.preset {self.preset!r}; known: {sorted(KV_PRESETS)}")
        if self.batch_eff_tokens < 0:
            raise ValueError("model.batch_eff_tokens must be >= 0")


class EngineSection(Section):
    fetch_interval_s: float = 0.1         # group leaders fetch on a common tick (pull-based)
    compute_quota_s: float = 0.300        # intra-engine batching quota (dualpath, oracle)
    max_batch_new_tokens: int = 8192      # token cap of a forward batch in the modes without the quota
    read_concurrency: int = 1             # reads served at once per node read queue (FIFO)
    prefetch_layers: int = 1              # layer-wise: layers loaded ahead of the one computing

    def __post_init__(self) -> None:
        if self.fetch_interval_s <= 0 or self.compute_quota_s <= 0:
            raise ValueError("engine.fetch_interval_s and compute_quota_s must be positive")
        if self.max_batch_new_tokens <= 0 or self.read_concurrency <= 0 or self.prefetch_layers < 0:
            raise ValueError("engine: max_batch_new_tokens, read_concurrency > 0, prefetch_layers >= 0")


class SimSection(Section):
    time_scale: float = 1.0
    window_s: float = 1.0                 # SNIC max/avg and utilisation time series window
    seed: int = 1
    exact_layers: bool = False            # per-layer flows/events instead of the aggregated model

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or self.window_s <= 0:
            raise ValueError("sim.time_scale and sim.window_s must be positive")


class SimConfig(Section):
    """Root of a ``configs/sim-*.toml`` file."""

    name: str = "sim"
    hardware: HardwareConfig = msgspec.field(default_factory=HardwareConfig)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    engine: EngineSection = msgspec.field(default_factory=EngineSection)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    sim: SimSection = msgspec.field(default_factory=SimSection)

    @property
    def kv(self) -> KVSpec:
        return KV_PRESETS[self.model.preset]

    @property
    def cost(self) -> ModelCost:
        return cost_model(self.model.preset)

    def shape(self) -> str:
        h = self.hardware
        return f"{h.prefill_nodes}P{h.decode_nodes}D x {h.gpus_per_node}"


class ModeSpec(msgspec.Struct, frozen=True):
    """What a mode switches on (digest §9 ablation switches)."""

    policy: str                 # SchedulerConfig.policy
    placement: str              # SchedulerConfig.placement
    oracle: bool
    layerwise: bool
    quota: bool                 # intra-engine 300 ms quota batching (part of "+sched")


MODE_SPECS: dict[str, ModeSpec] = {
    "basic": ModeSpec("basic", "auto", False, False, False),
    "+layer": ModeSpec("basic", "auto", False, True, False),
    "+dpl": ModeSpec("dpl", "auto", False, True, False),
    "dualpath": ModeSpec("dualpath", "auto", False, True, True),
    "dualpath-rr": ModeSpec("dualpath", "round_robin", False, True, True),
    "oracle": ModeSpec("dualpath", "auto", True, True, True),
}


def mode_spec(mode: str) -> ModeSpec:
    try:
        return MODE_SPECS[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}") from None


def scheduler_config(cfg: SimConfig, mode: str) -> SchedulerConfig:
    """The ``[scheduler]`` section with model, SNIC rate and the mode's switches filled in."""
    spec = mode_spec(mode)
    sc = cfg.scheduler
    changes: dict = {"model": cfg.model.preset, "snic_bytes_per_s": cfg.hardware.snic_bytes_per_s,
                     "policy": spec.policy, "placement": spec.placement, "oracle": spec.oracle}
    if sc.pe_tokens_per_s is None and sc.beta_tokens is None and cfg.sim.time_scale != 1.0:
        rate = cfg.cost.prompt_tokens_per_s(sc.ref_context_tokens, sc.ref_append_tokens)
        changes["pe_tokens_per_s"] = rate / cfg.sim.time_scale
    return msgspec.structs.replace(sc, **changes)


def load(path: str | Path | None) -> SimConfig:
    """Load a simulator config (``None``: the embedded defaults, the paper's 2P4D DS 660B)."""
    return load_config(path, cls=SimConfig)


def replace(cfg: SimConfig, **sections) -> SimConfig:
    """A copy with fields of sections replaced: ``replace(cfg, hardware={"prefill_nodes": 4})``."""
    out = {}
    for name, fields in sections.items():
        out[name] = msgspec.structs.replace(getattr(cfg, name), **fields) if isinstance(fields, dict) else fields
    return msgspec.structs.replace(cfg, **out)
