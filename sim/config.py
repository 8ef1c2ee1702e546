"""Simulator configuration: a frozen Struct loaded from ``configs/sim-*.toml``.

Sections (every key optional; typos are rejected with their name):

* ``[hardware]`` — cluster shape and link rates: ``prefill_nodes`` (P), ``decode_nodes`` (D),
  ``gpus_per_node`` (g), ``snic_bytes_per_s`` (s·B, each direction), ``cnic_bytes_per_s`` (B,
  each direction), ``dram_bytes_per_s`` (M, half-duplex), HBM left for KV on a PE (whole-prompt
  prefill only) and on a DE.
* ``[model]`` — ``preset`` (KV layout of ``common.kv`` + cost model of
  ``services/compute_model/cost_model.py``), whether a node's PEs step together (DP attention + EP
  MoE), the linear layers' batch efficiency (paper Fig. 3 right).
* ``[engine]`` — fetch interval, compute quota, batch caps, read-queue concurrency, prefetch depth.
* ``[scheduler]`` — ``services.scheduler.SchedulerConfig`` as is. The simulator overrides
  ``model`` and ``snic_bytes_per_s`` from the sections above and ``policy``/``oracle``/
  ``placement`` from the mode, so α and β always follow the simulated hardware, and
  ``write_weight`` to 0 unless ``snic_shared`` (a full-duplex SNIC's writes never delay a read;
  with ``snic_shared`` the section's value stays: set it to 1, its default 0 is full duplex's).
* ``[sim]`` — time scale, SNIC window, seed, exact per-layer mode.

``time_scale`` mirrors a slowed-down local emulation: every cost-model time (prefill, decode)
and the SLO thresholds are multiplied by it; link rates are taken as written.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from common.config import (NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, Section,
                           load_config)
from common.kv import PRESETS as KV_PRESETS
from common.kv import KVSpec
from services.scheduler.core.config import SchedulerConfig
from services.compute_model.cost_model import ModelCost, cost_model
# The mode table is the scheduler's (one copy, shared with tools.cluster); re-exported here.
from services.scheduler.core.modes import MODE_SPECS, MODES, ModeSpec, mode_spec  # noqa: F401


class HardwareConfig(Section):
    prefill_nodes: PositiveInt = 2
    decode_nodes: PositiveInt = 4
    gpus_per_node: PositiveInt = 8
    snic_bytes_per_s: PositiveFloat = 50e9   # one 400 Gbps storage NIC per node (paper §6.1)
    cnic_bytes_per_s: PositiveFloat = 50e9   # one 400 Gbps compute NIC per GPU
    dram_bytes_per_s: PositiveFloat = 500e9  # M ≈ 10 × SNIC (docs/simulator.md, 'Hardware ratios')
    pe_hbm_kv_bytes: PositiveFloat = 16e9    # whole-prompt (basic) batches must fit here
    de_hbm_kv_bytes: PositiveFloat = 50e9    # DE HBM for request KV (the scheduler's HBM stop)
    # one storage link per node carrying reads *and* write-backs (the local emulation's gateway
    # token bucket, docs/storage.md); false: a full-duplex SNIC, writes on their own direction
    snic_shared: bool = False


class ModelSection(Section):
    preset: str = "deepseek-v3.2"
    ep_sync: bool = True                   # DP attention + EP MoE: a node's PEs run forward passes together
    batch_eff_tokens: NonNegFloat = 755.0  # linear-layer efficiency 1 − exp(−tokens/k); 0 disables
    # the longest prompt + generation the model serves (DeepSeek V3.2: 128K); trace turns above it
    # follow the workload's context policy (session_workload.py: compact or drop, docs/workloads.md)
    max_context_tokens: PositiveInt = 131072

    def __post_init__(self) -> None:
        if self.preset not in KV_PRESETS:
            raise ValueError(f"unknown model.preset {self.preset!r}; known: {sorted(KV_PRESETS)}")


class EngineSection(Section):
    fetch_interval_s: PositiveFloat = 0.1     # group leaders fetch on a common tick (pull-based)
    compute_quota_s: PositiveFloat = 0.300    # intra-engine batching quota (dualpath, oracle)
    max_batch_new_tokens: PositiveInt = 8192  # token cap of a forward batch in the modes without the quota
    read_concurrency: PositiveInt = 1         # reads served at once per node read queue (FIFO)
    prefetch_layers: NonNegInt = 1            # layer-wise: layers loaded ahead of the one computing


class SimSection(Section):
    time_scale: PositiveFloat = 1.0
    window_s: PositiveFloat = 1.0         # SNIC max/avg and utilisation time series window
    seed: int = 1
    exact_layers: bool = False            # per-layer flows/events instead of the aggregated model


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


def scheduler_config(cfg: SimConfig, mode: str) -> SchedulerConfig:
    """The ``[scheduler]`` section with model, SNIC rate and the mode's switches filled in."""
    spec = mode_spec(mode)
    sc = cfg.scheduler
    changes: dict = {"model": cfg.model.preset, "snic_bytes_per_s": cfg.hardware.snic_bytes_per_s,
                     "policy": spec.policy, "placement": spec.placement, "oracle": spec.oracle,
                     "read_side": spec.read_side}
    if not cfg.hardware.snic_shared:
        # full-duplex SNICs: a write-back takes nothing from the read direction, so the read
        # side must not count it (SchedulerConfig.write_weight; shared links keep the section's)
        changes["write_weight"] = 0.0
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
