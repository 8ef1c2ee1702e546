"""The simulator's prediction for a cluster config (issue 7's cross-check with the live bench).

:func:`sim_config` describes the cluster to the simulator: nodes, engines per node, the
emulated link rates (the compute link is per node here, per GPU there), DRAM ≈ 10 × SNIC
(docs/simulator.md), the DE HBM the loaders report, the KV/cost preset, fetch interval, compute
quota, scheduler constants and the time scale. ``[cluster] sim_config = "configs/sim-….toml"`` uses
that file instead.

:func:`predict` maps the replay workload onto the simulator's (it has no token scale: the
appended and generated tokens are scaled by ``append_scale``/``gen_scale``, the turn cap by
``turns_scale``), so the prediction is for a *similar* workload, not the same token ids.
"""

from __future__ import annotations

from typing import Any

from .config import Cluster


def sim_config(cluster: Cluster) -> Any:
    from common.config import build_config
    from sim.config import SimConfig, load

    c, cfg = cluster.spec, cluster.cfg
    if c.sim_config:
        return load(c.sim_config)
    snic = max(c.storage_link(n) for n in c.nodes) or 50e9
    g = max(c.engines(n) for n in c.nodes)
    cnic = (max(c.compute_link(n) for n in c.nodes) or snic * g) / g
    sched = {k: v for k, v in cluster.data.get("scheduler", {}).items()
             if k not in ("policy", "oracle", "placement")}
    data = {"name": c.name,
            "hardware": {"prefill_nodes": len(c.prefill), "decode_nodes": len(c.decode),
                         "gpus_per_node": g, "snic_bytes_per_s": snic,
                         "cnic_bytes_per_s": cnic, "dram_bytes_per_s": 10 * snic,
                         "de_hbm_kv_bytes": float(cfg.de_loader.hbm_capacity_bytes)},
            "model": {"preset": cfg.engine_sim.model or cfg.kv.preset, "ep_sync": False},
            "engine": {"fetch_interval_s": cfg.scheduler_service.fetch_interval_s,
                       "compute_quota_s": cfg.engine_sim.quota_s},
            "scheduler": sched,
            "sim": {"time_scale": c.time_scale}}
    return build_config(data, SimConfig, f"{cluster.source} (as simulator config)", environ={})


def predict(cluster: Cluster, spec: Any, modes: tuple[str, ...]) -> dict[str, Any]:
    """``{mode: {"jct_s", "speedup_vs_basic", "snic_max_avg", ...}}`` from ``sim.predict_speedups``."""
    from sim import predict_speedups
    from tools.replay.workloads import DATASETS

    ds = DATASETS[spec.dataset]
    turns_scale = (spec.max_turns / ds.turns) if spec.max_turns else 1.0
    sim_modes = tuple(m for m in modes)
    return predict_speedups(sim_config(cluster), spec.dataset, spec.agents, sim_modes,
                            append_scale=spec.scale * spec.append_scale,
                            gen_scale=spec.scale * spec.gen_scale, turns_scale=turns_scale,
                            seed=spec.seed)
