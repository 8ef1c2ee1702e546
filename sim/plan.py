"""Capacity planner: the cheapest P/D cluster that meets an SLO, per mode (basic, pe-only, dualpath).

The search (docs/workloads.md "Planner"), per mode, in two passes:

1. **coarse**: the shapes ``k × (p : d)`` for each P:D ratio and every integer ``k`` from 1 to
   48, ordered by GPU count ``(P + D) × g``, simulated in that order until one meets the SLO;
2. **refine**: every shape between the largest that missed and the one that met, one node at a
   time (:func:`band`: any P, D whose P/D lies between the smallest and the largest ratio), in
   the same order; the first that meets is the answer.

The step is therefore one node (``g`` GPUs) at the answer, not one copy of a ratio: a coarse
grid alone quantises the GPU saving (1P2D vs 2P4D is 2.00 whatever lies between). The grids and
the order do not depend on the SLO and every simulation is deterministic, so a looser SLO never
needs more GPUs: its coarse answer is no larger, and the tighter SLO's answer (met under the
looser one too) lies above the looser's largest coarse miss.

The GPU saving (:func:`gpu_saving`) is a baseline mode's GPUs ÷ dualpath's. The headline
baseline is ``pe-only`` — dualpath with the DE read path switched off, so the ratio measures the
dual read path alone; ``basic`` (which also lacks layer-wise prefill and quota batching) is
reported beside it. Its resolution is the step from dualpath's shape to the next one the refine
pass could choose (``grid.step_at_dualpath``, one node where a P/D between the ratios fits).

SLO: online, the ``percentile`` of TTFT and of TPOT over every request of the run must be at
most ``ttft_s`` / ``tpot_s``; offline, the JCT (last session done) at most ``jct_s``. When no
shape meets it, the closest one (smallest worst ratio attained ÷ target) is reported instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import msgspec

from common.errors import InvalidArgument

from .bandwidth import check
from .config import SimConfig, mode_spec, replace
from .run import simulate, simulate_trace

K_GRID = tuple(range(1, 49))          # every k: a coarser grid quantises the saving (1 vs 2 → 2.00)
MODES = ("basic", "pe-only", "dualpath")
BASELINE = "pe-only"                  # the headline saving's baseline: dualpath minus the DE read path
QUICK_RATIOS = ((1, 2), (1, 1))
RATIOS = ((1, 2), (1, 1), (1, 3), (2, 1))


class SLO(msgspec.Struct, frozen=True):
    """Online: TTFT and TPOT percentiles; offline: JCT."""

    online: bool
    percentile: float = 90.0
    ttft_s: float = 4.0
    tpot_s: float = 0.050
    jct_s: float = math.inf

    def __post_init__(self) -> None:
        if not 0 < self.percentile <= 100:
            raise InvalidArgument(f"percentile must be in (0, 100], got {self.percentile}")
        if self.online and not (self.ttft_s > 0 and self.tpot_s > 0):
            raise InvalidArgument("an online SLO needs ttft_s > 0 and tpot_s > 0")
        if not self.online and not self.jct_s > 0:
            raise InvalidArgument("an offline SLO needs jct_s > 0")

    def describe(self) -> str:
        if self.online:
            return (f"TTFT p{self.percentile:g} ≤ {self.ttft_s:g} s and TPOT p{self.percentile:g} "
                    f"≤ {self.tpot_s * 1e3:g} ms")
        return f"JCT ≤ {self.jct_s:g} s"

    def attained(self, cl: Any) -> dict[str, float]:
        """The SLO's metrics of a finished simulated cluster."""
        if self.online:
            q = self.percentile / 100.0
            return {"ttft_s": cl.ttft.quantile(q), "tpot_s": cl.tpot.quantile(q)}
        return {"jct_s": cl.loop.now}

    def worst_ratio(self, att: dict[str, float]) -> float:
        """max attained ÷ target over the SLO's metrics (≤ 1: met)."""
        if self.online:
            return max(att["ttft_s"] / self.ttft_s, att["tpot_s"] / self.tpot_s)
        return att["jct_s"] / self.jct_s


class PlanWorkload(msgspec.Struct, frozen=True):
    """What every candidate simulates: a loaded trace, or a Table 2 dataset."""

    trace: Any = None                 # sim.recorded.Workload
    dataset: str = "64k"
    agents: int = 512
    turns_scale: float = 1.0
    repeat: int = 1
    aps: float | None = None
    think_scale: float | None = None
    policy: str = "compact"
    max_context: int | None = None
    arrivals: str = "poisson"         # "trace": online on the trace's own times (÷ speed)
    speed: float = 1.0

    @property
    def online(self) -> bool:
        return self.aps is not None or self.arrivals == "trace"

    def describe(self) -> str:
        base = (f"trace {self.trace.name} x{self.repeat}" if self.trace is not None
                else f"Table 2 {self.dataset}, {self.agents} agents, turns x{self.turns_scale:g}")
        if self.arrivals == "trace":
            return base + f", online at the trace's own times (speed {self.speed:g})"
        return base + (f", online {self.aps:g} sessions/s" if self.aps else ", offline")


def shapes(ratios: tuple[tuple[int, int], ...], gpus_per_node: int, max_gpus: int) -> list[tuple[int, int]]:
    """Candidate (P, D) in ascending GPU order (ties: fewer prefill nodes first)."""
    out = {(k * p, k * d) for p, d in ratios for k in K_GRID if (k * p + k * d) * gpus_per_node <= max_gpus}
    return sorted(out, key=lambda s: (s[0] + s[1], s[0]))


def band(ratios: tuple[tuple[int, int], ...], gpus_per_node: int, above: int,
         below: int) -> list[tuple[int, int]]:
    """Every (P, D) with ``above < (P + D) × g < below`` GPUs whose P/D lies between the smallest
    and the largest of ``ratios``, in the candidates' order (the refine pass's shapes)."""
    lo_p, lo_d = min(ratios, key=lambda r: r[0] / r[1])
    hi_p, hi_d = max(ratios, key=lambda r: r[0] / r[1])
    out = []
    for n in range(above // gpus_per_node + 1, -(-below // gpus_per_node)):
        for P in range(1, n):
            D = n - P
            if P * lo_d >= lo_p * D and P * hi_d <= hi_p * D:
                out.append((P, D))
    return out


def evaluate(base: SimConfig, P: int, D: int, mode: str, wl: PlanWorkload, slo: SLO) -> dict:
    """Simulate one candidate; the row the planner keeps."""
    cfg = replace(base, hardware={"prefill_nodes": P, "decode_nodes": D})
    cfg = msgspec.structs.replace(cfg, name=f"{P}p{D}d")
    clusters: list = []
    online = wl.online
    if wl.trace is not None:
        r = simulate_trace(cfg, mode, wl.trace, online=online, aps=wl.aps, repeat=wl.repeat,
                           think_scale=wl.think_scale, policy=wl.policy, max_context=wl.max_context,
                           cluster_out=clusters, arrivals=wl.arrivals, speed=wl.speed)
    else:
        r = simulate(cfg, mode, wl.dataset, wl.agents, online=online, aps=wl.aps,
                     turns_scale=wl.turns_scale, cluster_out=clusters)
    cl = clusters[0]
    att = slo.attained(cl)
    ratio = slo.worst_ratio(att)
    g = base.hardware.gpus_per_node
    return {"mode": mode, "P": P, "D": D, "shape": f"{P}P{D}D", "gpus": (P + D) * g, "met": ratio <= 1.0,
            "worst_ratio": ratio, "attained": att, "jct_s": r["jct_s"], "requests": r["requests"],
            "ttft_mean_s": r["latency"]["ttft"]["mean"], "tpot_mean_s": r["latency"]["tpot"]["mean"],
            "binding": binding(r, cl, P + D if mode_spec(mode).de_reads else P),
            "sim_wall_s": r["sim"]["wall_s"],
            "trace": r.get("trace")}


# what each part of the TTFT breakdown waits on (sim.cluster's request flow)
_WAITS = {"de_wait": "DE admission (HBM, decode batch)", "pe_wait": "PE admission (prefill queue)",
          "read": "storage read (SNIC, read queue)", "prefill": "prefill compute"}


def binding(r: dict, cl: Any, read_nodes: int) -> dict[str, Any]:
    """What binds a shape: the largest part of its mean TTFT, with the storage links' load
    (p95 over time windows of the mean utilisation of the nodes the mode reads on — basic, +layer
    and pe-only: the PE nodes only) and the PE compute share (Σ step time ÷ units × run time) beside it."""
    parts = r["ttft_breakdown_mean_s"]
    worst = max(parts, key=lambda k: parts[k])
    per_window = sorted(sum(w[:read_nodes]) / read_nodes for w in cl.windows.utilisation())
    snic_p95 = per_window[int(0.95 * (len(per_window) - 1))] if per_window else 0.0
    return {"resource": _WAITS[worst], "ttft_part_s": parts[worst], "ttft_parts_s": parts,
            "snic_read_p95_util": snic_p95, "pe_compute_util": r.get("pe_compute_util", 0.0)}


def plan(base: SimConfig, wl: PlanWorkload, slo: SLO, *, modes: tuple[str, ...] = MODES,
         ratios: tuple[tuple[int, int], ...] = RATIOS, max_gpus: int = 1152,
         on_step: Callable[[str, int, int], None] | None = None) -> dict:
    """Search every mode (see the module docstring); returns the JSON-able plan."""
    h = base.hardware
    cands = shapes(ratios, h.gpus_per_node, max_gpus)
    if not cands:
        raise InvalidArgument(f"no P/D shape fits in {max_gpus} GPUs at {h.gpus_per_node} GPUs per node")
    t0 = time.perf_counter()
    out: dict[str, Any] = {"workload": wl.describe(), "slo": msgspec.to_builtins(slo) | {"text": slo.describe()},
                           "candidates": [f"{p}P{d}D" for p, d in cands], "modes": {}}
    for mode in modes:
        rows: list[dict] = []
        chosen = _first_met(cands, rows, base, mode, wl, slo, on_step)
        if chosen is not None:
            missed = max((r["gpus"] for r in rows if not r["met"]), default=0)
            finer = band(ratios, h.gpus_per_node, missed, chosen["gpus"])
            chosen = _first_met(finer, rows, base, mode, wl, slo, on_step) or chosen
        closest = chosen or min(rows, key=lambda x: x["worst_ratio"])
        eq9 = check(closest["P"], closest["D"], h.gpus_per_node, h.snic_bytes_per_s, h.cnic_bytes_per_s,
                    h.dram_bytes_per_s)
        out["modes"][mode] = {"met": chosen is not None, "chosen": closest, "evaluated": rows,
                              "eq9": {"inside": eq9.inside, "summary": eq9.summary(),
                                      "binding": eq9.binding, "violated": eq9.violated}}
    out["wall_s"] = time.perf_counter() - t0
    out["grid"] = grid(out, cands, ratios, h.gpus_per_node)
    baseline = BASELINE if BASELINE in modes else "basic"
    out["saving"] = gpu_saving(out, baseline)
    out["saving_vs_basic"] = gpu_saving(out, "basic")
    return out


def _first_met(shapes_: list[tuple[int, int]], rows: list[dict], base: SimConfig, mode: str,
               wl: PlanWorkload, slo: SLO, on_step: Callable[[str, int, int], None] | None) -> dict | None:
    """Simulate ``shapes_`` in order, appending to ``rows``, until one meets the SLO (returned)."""
    n0 = len(rows)
    for i, (P, D) in enumerate(shapes_):
        row = evaluate(base, P, D, mode, wl, slo)
        rows.append(row)
        if on_step:
            on_step(mode, n0 + i + 1, n0 + len(shapes_))
        if row["met"]:
            return row
    return None


def grid(p: dict, cands: list[tuple[int, int]], ratios: tuple[tuple[int, int], ...],
         gpus_per_node: int) -> dict[str, Any]:
    """The search grid and its resolution: the step from dualpath's shape to the next shape the
    refine pass could have chosen (one node, unless no P/D between the ratios fits there)."""
    out: dict[str, Any] = {"k": f"every integer {K_GRID[0]}..{K_GRID[-1]}",
                           "ratios": [f"{a}:{b}" for a, b in ratios],
                           "refine_step_gpus": gpus_per_node, "step_at_dualpath": None}
    d = p["modes"].get("dualpath")
    if d is not None and d["met"]:
        g = d["chosen"]["gpus"]
        top = max((P + D) * gpus_per_node for P, D in cands)
        above = [(P + D) * gpus_per_node for P, D in band(ratios, gpus_per_node, g, top + 1)]
        if above:
            out["step_at_dualpath"] = {"gpus": min(above) - g, "relative": min(above) / g - 1}
    return out


def gpu_saving(p: dict, baseline: str = BASELINE) -> dict[str, Any]:
    """``baseline`` GPUs ÷ dualpath GPUs (``lower_bound``: the baseline met nothing, its largest
    shape counts); ``None`` when either mode was not planned or dualpath met nothing."""
    m = p["modes"]
    if baseline not in m or "dualpath" not in m or not m["dualpath"]["met"]:
        return {"ratio": None, "lower_bound": False, "baseline_mode": baseline}
    b = m[baseline]
    gb = b["chosen"]["gpus"] if b["met"] else max(x["gpus"] for x in b["evaluated"])
    return {"ratio": gb / m["dualpath"]["chosen"]["gpus"], "lower_bound": not b["met"],
            "baseline_mode": baseline}
