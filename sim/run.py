"""Library entry points: run one simulated configuration, or a set of modes on the same workload."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.scheduler.core.modes import ABLATION_MODES

from .cluster import Cluster
from .config import SimConfig, load
from .workload import TraceWorkload

if TYPE_CHECKING:
    from .recorded import Workload


def simulate(cfg: SimConfig | str | Path | None, mode: str = "dualpath", dataset: str = "64k",
             agents: int = 2048, *, online: bool = False, aps: float | None = None,
             seed: int | None = None, append_scale: float = 1.0, gen_scale: float = 1.0,
             turns_scale: float = 1.0, exact: bool | None = None, until: float = float("inf"),
             cluster_out: list | None = None) -> dict:
    """Simulate ``agents`` agents of ``dataset`` on ``cfg`` in ``mode``; returns the results dict."""
    if not isinstance(cfg, SimConfig):
        cfg = load(cfg)
    w = TraceWorkload(dataset, agents, cfg.sim.seed if seed is None else seed, cfg.kv.block_tokens,
                      append_scale=append_scale, gen_scale=gen_scale, turns_scale=turns_scale)
    cl = Cluster(cfg, mode, w, online=online, aps=aps, exact=exact)
    if cluster_out is not None:
        cluster_out.append(cl)
    return cl.run(until)


def simulate_trace(cfg: SimConfig | str | Path | None, mode: str, workload: Workload, *,
                   online: bool = False, aps: float | None = None, repeat: int = 1,
                   think_scale: float | None = None, policy: str = "compact",
                   max_context: int | None = None, seed: int | None = None,
                   exact: bool | None = None, until: float = float("inf"),
                   cluster_out: list | None = None, arrivals: str = "poisson", speed: float = 1.0,
                   request_log: list | None = None) -> dict:
    """Simulate the sessions of a loaded trace (``sim.recorded``) on ``cfg`` in ``mode``.

    Offline (the paper's RL-rollout setting): every session at t = 0 and no think times, unless
    ``think_scale`` says otherwise; online: sessions arrive at ``aps`` and think times are kept
    (× ``think_scale``, default 1). ``arrivals="trace"`` is online on the trace's own timeline
    (÷ ``speed``; ``session_workload``): ``aps`` is then the mean rate it works out to. Every
    submitted request's ``(id, session, time)`` is appended to ``request_log`` when one is given.
    """
    from .session_workload import SessionWorkload
    if not isinstance(cfg, SimConfig):
        cfg = load(cfg)
    online = online or arrivals == "trace"
    ts = (1.0 if online else 0.0) if think_scale is None else think_scale
    w = SessionWorkload(workload, cfg.kv.block_tokens, max_context or cfg.model.max_context_tokens,
                        policy=policy, think_scale=ts, repeat=repeat,
                        seed=cfg.sim.seed if seed is None else seed, arrivals=arrivals, speed=speed)
    if arrivals == "trace":
        aps = w.n_roots / w.arrival_span
    cl = Cluster(cfg, mode, w, online=online, aps=aps, exact=exact)
    cl.request_log = request_log
    if cluster_out is not None:
        cluster_out.append(cl)
    return cl.run(until)


def predict_speedups(cfg: SimConfig | str | Path | None, dataset: str = "64k", agents: int = 256,
                     modes: tuple[str, ...] = ABLATION_MODES, **kw) -> dict[str, dict]:
    """JCT and speedup over ``basic`` per mode, same workload (for the live ablation cross-check)."""
    if not isinstance(cfg, SimConfig):
        cfg = load(cfg)
    runs = {m: simulate(cfg, m, dataset, agents, **kw) for m in modes}
    base = runs.get("basic", next(iter(runs.values())))["jct_s"]
    return {m: {"jct_s": r["jct_s"], "speedup_vs_basic": base / r["jct_s"],
                "snic_max_avg": r["snic_max_avg"], "read_bytes": r["read_bytes"]}
            for m, r in runs.items()}
