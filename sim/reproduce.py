"""Regenerate ``docs/reproduction.md``: every paper result next to the simulator's number.

    python -m sim.reproduce --quick            # ~5 min on 2 cores: fewer agents, shorter trajectories
    python -m sim.reproduce --full             # paper agent counts (~25 min), needs the full bench JSON
                                               # (or --run-scaleout) for the 48P96D row
    python -m sim.reproduce --full --scaleout-json results/sim.json

Sections follow paper §7: offline speedup vs agents and MAL (Fig. 7), P/D sweep with
the equivalent pairs (Fig. 8), append-length scaling (Fig. 9), the ablation (Fig. 12 right),
storage-link balance (Fig. 13), online APS capacity under the SLO (Fig. 10), scale-out (Table 3).
Every run is a fresh, deterministic simulation with the configs in ``configs/sim-*.toml``; the
raw numbers go to ``--json`` as well.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import accel
from .config import load
from .run import simulate

C660 = "configs/sim-2p4d-ds660b.toml"
C27 = {"1P1D": "configs/sim-1p1d-ds27b.toml", "2P1D": "configs/sim-2p1d-ds27b.toml",
       "1P2D": "configs/sim-1p2d-ds27b.toml"}
CQWEN = "configs/sim-1p2d-qwen32b.toml"

LEVELS = {
    # Offline DS 660B runs keep full-length trajectories even in --quick: shortened runs are
    # dominated by the start-up transient (see the scale-out notes) and are not storage-bound.
    "quick": {"turns": 1.0, "fig7": {"64k": [512, 2048], "48k": [1024], "32k": [1024]}, "fig7_other": [512],
              "abl_agents": [2048], "pd_agents": [512], "app_agents": 1024, "snic_agents": 1024,
              "online_turns": 0.35, "online_iters": 3, "online_lifetimes": 3.0,
              "scaleout": ("configs/sim-8p16d-ds660b.toml", 2048, 8192, 0.35)},
    "full": {"turns": 1.0, "fig7": {m: [512, 1024, 2048, 4096] for m in ("32k", "48k", "64k")},
             "fig7_other": [1024, 2048], "abl_agents": [1024, 2048], "pd_agents": [512, 1024, 2048],
             "app_agents": 1024, "snic_agents": 1024, "online_turns": 0.5, "online_iters": 5,
             "online_lifetimes": 3.0, "scaleout": ("configs/sim-48p96d-ds660b.toml", 2048, 48_000, 1.0)},
}


class Runner:
    """Runs (and caches) simulations; keeps only the numbers the report needs."""

    def __init__(self, turns: float) -> None:
        self.turns = turns
        self.cache: dict[tuple, dict] = {}
        self.wall = 0.0

    def offline(self, cfg: str, mode: str, mal: str, agents: int, **kw) -> dict:
        key = (cfg, mode, mal, agents, tuple(sorted(kw.items())))
        if key not in self.cache:
            t0 = time.perf_counter()
            kw.setdefault("turns_scale", self.turns)
            r = simulate(cfg, mode, mal, agents, **kw)
            self.wall += time.perf_counter() - t0
            self.cache[key] = {"jct_s": r["jct_s"], "snic_max_avg": r["snic_max_avg"],
                               "snic_util": r["links"]["snic_read"]["mean_util"],
                               "read_bytes": r["read_bytes"], "ttft_mean": r["latency"]["ttft"]["mean"],
                               "tpot_mean": r["latency"]["tpot"]["mean"],
                               "attn_max_avg_first5pct": r["attn_max_avg_first5pct"]}
            print(f"  {Path(cfg).stem} {mode:9s} {mal} {agents:5d} agents {kw}: JCT {r['jct_s']:.0f} s "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        return self.cache[key]

    def online(self, cfg: str, mode: str, aps: float, lifetimes: float, turns: float) -> dict:
        """One online run long enough (``lifetimes`` agent lifetimes) to judge the steady state."""
        life = 160 * turns * 6.0                 # ~157 turns of ~6 s (decode + TTFT), scaled
        agents = max(40, int(aps * lifetimes * life))
        key = (cfg, mode, "online", aps, agents, turns)
        if key not in self.cache:
            t0 = time.perf_counter()
            r = simulate(cfg, mode, "64k", agents, online=True, aps=aps, turns_scale=turns)
            self.wall += time.perf_counter() - t0
            s = r["steady"]
            self.cache[key] = {"met": r["slo"]["met"], "ttft": s["ttft"]["mean"], "tpot": s["tpot"]["mean"],
                               "stable": s["stable"], "agent_jct": r["agent_jct"]["mean"]}
            print(f"  online {Path(cfg).stem} {mode} {aps:.3f} APS x {agents}: TTFT {s['ttft']['mean']:.2f} s "
                  f"{'MET' if r['slo']['met'] else 'missed'} ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
        return self.cache[key]


def _speed(r: Runner, cfg: str, mal: str, agents: int, **kw) -> tuple[float, float, float]:
    b = r.offline(cfg, "basic", mal, agents, **kw)["jct_s"]
    d = r.offline(cfg, "dualpath", mal, agents, **kw)["jct_s"]
    o = r.offline(cfg, "oracle", mal, agents, **kw)["jct_s"]
    return b / d, b / o, d / o


# ----------------------------------------------------------------------------- sections

def _fig7_why(r: Runner, peak: float) -> str:
    d = r.offline(C660, "dualpath", "64k", 2048)
    b = r.offline(C660, "basic", "64k", 2048)
    return ("Why ours differ: Basic is bounded by the PE nodes' storage links alone "
            f"(2 × 50 GB/s; ours run at {b['snic_util'] * 300 / 100:.0%} of that on average, ramp-up "
            "and tail included) and DualPath by prefill compute once all six links read. Our cost "
            "model (services/compute_model/cost_model.py, unprofiled Hopper estimates) prefills faster "
            f"than the paper's engine — DualPath JCT at 2K agents is {d['jct_s']:.0f} s here vs "
            "3,167 s in the paper — so DualPath saturates compute later and the peak sits "
            + ("above" if peak > 1.87 else "below") + " 1.87x. With few agents both modes are "
            "latency-bound (per-turn decode) and the speedup shrinks, as in the paper.")


def fig7(r: Runner, lv: dict) -> dict:
    rows = []
    for mal, counts in lv["fig7"].items():
        for n in counts:
            s, so, gap = _speed(r, C660, mal, n)
            rows.append(["DS 660B 2P4D", mal, n, f"{s:.2f}x", f"{so:.2f}x", f"{gap:.2f}x"])
    for name, cfg in (("DS 27B 1P1D", C27["1P1D"]), ("Qwen 32B 1P2D", CQWEN)):
        for n in lv["fig7_other"]:
            s, so, gap = _speed(r, cfg, "64k", n)
            rows.append([name, "64k", n, f"{s:.2f}x", f"{so:.2f}x", f"{gap:.2f}x"])
    ds = [float(x[3][:-1]) for x in rows if x[0] == "DS 660B 2P4D"]
    peak = max(ds)
    at64 = [x for x in rows if x[0] == "DS 660B 2P4D" and x[1] == "64k"]
    first, last = at64[0], at64[-1]
    grows = float(last[3][:-1]) >= float(first[3][:-1])
    notes = [f"Peak DS 660B speedup **{peak:.2f}x** (paper: up to 1.87x at 64K, 2K–4K agents).",
             "Speedup grows with the number of agents: " + ("yes" if grows else "no")
             + f" ({first[3]} at {first[2]} agents → {last[3]} at {last[2]} agents, {last[1]}).",
             _fig7_why(r, peak)]
    return {"title": "Offline JCT speedup vs agents and maximum agent length (Fig. 7)",
            "head": ["model / cluster", "MAL", "agents", "DualPath / Basic", "Oracle / Basic",
                     "DualPath slower than Oracle by"],
            "rows": rows, "paper": "DS 660B up to 1.87x (close to Oracle); DS 27B up to 1.78x "
            "(1.09–1.85x slower than Oracle); Qwen 32B same trend.", "notes": notes}


def pd_sweep(r: Runner, lv: dict) -> dict:
    rows, jct = [], {}
    for n in lv["pd_agents"]:
        for shape, cfg in C27.items():
            b = r.offline(cfg, "basic", "64k", n)["jct_s"]
            d = r.offline(cfg, "dualpath", "64k", n)["jct_s"]
            jct[(shape, "basic", n)], jct[(shape, "dualpath", n)] = b, d
            rows.append([shape, n, f"{b:.0f}", f"{d:.0f}", f"{b / d:.2f}x"])
    pairs = []
    for n in lv["pd_agents"]:
        for (a, b, label) in (((("1P1D", "basic")), ("1P2D", "basic"), "Basic 1P1D ≈ Basic 1P2D"),
                              ((("1P1D", "dualpath")), ("2P1D", "basic"), "DualPath 1P1D ≈ Basic 2P1D"),
                              ((("2P1D", "dualpath")), ("1P2D", "dualpath"), "DualPath 2P1D ≈ DualPath 1P2D")):
            x, y = jct[(*a, n)], jct[(*b, n)]
            pairs.append([label, n, f"{x:.0f} vs {y:.0f}", f"{abs(x / y - 1) * 100:.1f} %"])
    sp = [float(x[4][:-1]) for x in rows]
    notes = [f"Average DualPath speedup {sum(sp) / len(sp):.2f}x, max {max(sp):.2f}x "
             "(paper: 1.64x average, up to 2.46x).",
             "Equal usable storage bandwidth gives equal JCT — the pairs below differ by the "
             "percentages shown (paper: 'confirm that storage bandwidth dominates').",
             "Why ours are higher: with our DS 27B estimates (30 × 724 B of KV per token, a cheap "
             "cost model) the model is even more storage-bound than the paper's, so the speedup "
             "tracks the storage-bandwidth ratio (P+D)/P (2x, 1.5x, 3x) more closely."]
    return {"title": "P/D ratio sweep, DS 27B (Fig. 8)", "head": ["P/D", "agents", "Basic JCT s",
            "DualPath JCT s", "speedup"], "rows": rows, "extra_head": ["equivalent pair", "agents",
            "JCT s", "difference"], "extra": pairs,
            "paper": "DualPath 1.64x on average, up to 2.46x; Basic 1P1D ≈ Basic 1P2D, DualPath 1P1D ≈ "
            "Basic 2P1D, DualPath 2P1D ≈ DualPath 1P2D.", "notes": notes}


def append_scaling(r: Runner, lv: dict) -> dict:
    n, rows, sp = lv["app_agents"], [], []
    for scale in (1.0, 1.5, 2.0, 3.0):
        kw = {"append_scale": scale} if scale != 1.0 else {}
        b = r.offline(C660, "basic", "64k", n, **kw)["jct_s"]
        d = r.offline(C660, "dualpath", "64k", n, **kw)["jct_s"]
        o = r.offline(C660, "oracle", "64k", n, **kw)["jct_s"]
        sp.append(b / d)
        rows.append([f"{scale:g}x", f"{b:.0f}", f"{d:.0f}", f"{o:.0f}", f"{b / d:.2f}x"])
    shrinks = sp[-1] < sp[0]
    notes = ["Speedup shrinks as the append grows: " + ("yes" if shrinks else "no")
             + f" ({sp[0]:.2f}x → {sp[-1]:.2f}x). Longer appends add prefill compute per byte of "
             "hit KV, so Basic's storage bottleneck matters less (paper: 'Basic gradually approaches "
             "DualPath and Oracle').",
             f"Paper: 1.82–1.99x across the scales; ours {min(sp):.2f}–{max(sp):.2f}x. The level follows "
             "the Fig. 7 difference (how far compute is from binding DualPath); the paper also scaled "
             "generation lengths, which we leave at 1x here."]
    return {"title": f"Append-length scaling, DS 660B 2P4D, 64K, {n} agents (Fig. 9)",
            "head": ["append", "Basic JCT s", "DualPath JCT s", "Oracle JCT s", "DualPath / Basic"],
            "rows": rows, "paper": "1.82–1.99x; Basic approaches DualPath as appends grow.",
            "notes": notes}


def ablation(r: Runner, lv: dict) -> dict:
    paper = {"+layer": -17.21, "+dpl": -38.19, "dualpath": -45.62}
    drops = {m: [] for m in paper}
    for n in lv["abl_agents"]:
        b = r.offline(C660, "basic", "64k", n)["jct_s"]
        for m in paper:
            drops[m].append((r.offline(C660, m, "64k", n)["jct_s"] / b - 1) * 100)
    rows = [[{"+layer": "Basic + layer-wise prefill", "+dpl": "+ dual-path loading",
              "dualpath": "+ scheduling (= DualPath)"}[m], f"{paper[m]:.2f} %",
             f"{sum(v) / len(v):.2f} %", " / ".join(f"{x:.1f} %" for x in v)] for m, v in drops.items()]
    mean = {m: sum(v) / len(v) for m, v in drops.items()}
    ordered = mean["dualpath"] <= mean["+dpl"] <= mean["+layer"] + 0.5
    notes = ["Each component lowers JCT, in the paper's order: " + ("yes" if ordered else "no") + ".",
             "Why +layer gains less here: our Basic is purely storage-bound (its PE storage links run "
             "near 100 %), and layer-wise prefill only changes how the PE uses HBM and hides "
             "transfers, which matters when the PE is also busy. In the paper Basic's PEs were a "
             "co-bottleneck (small HBM-limited batches, un-overlapped copies), so +layer bought 17 %.",
             "+dpl (both paths, round-robin placement, alternating read side) delivers most of the "
             "gain, +sched (Algorithm 1, two-phase DE placement, shorter-queue read side, 300 ms "
             "quota batching) the rest — as in the paper."]
    return {"title": f"Ablation, DS 660B 2P4D, 64K, {' and '.join(map(str, lv['abl_agents']))} agents "
            "(Fig. 12 right)", "head": ["configuration", "paper JCT change", "ours (mean)",
            "ours per agent count"], "rows": rows,
            "paper": "−17.21 % (+layer), −38.19 % (+dpl), −45.62 % (+sched), averaged over 1K and 2K agents.",
            "notes": notes}


def _attn_note(r: Runner) -> str:
    loaded = r.offline(C660, "dualpath", "64k", 2048)["attn_max_avg_first5pct"]
    return (f"Attention max/avg across a PE node's 8 GPUs during the first 5 % of the DualPath run "
            f"(64K, 2,048 agents): {loaded or float('nan'):.2f} (paper: as low as 1.06). It is higher "
            "in lightly loaded runs: a unit steps as soon as it is free, so some GPUs have nothing "
            "read yet and the quota can only even out GPUs that have work.")


def snic_balance(r: Runner, lv: dict) -> dict:
    n = lv["snic_agents"]
    rr = r.offline(C660, "+dpl", "48k", n)
    rrd = r.offline(C660, "dualpath-rr", "48k", n)
    dp = r.offline(C660, "dualpath", "48k", n)
    rows = [["round-robin (+dpl: round-robin placement, alternating read side)", "1.53",
             f"{rr['snic_max_avg']:.3f}", f"{rr['jct_s']:.0f}"],
            ["round-robin placement, shorter-queue read side", "–", f"{rrd['snic_max_avg']:.3f}",
             f"{rrd['jct_s']:.0f}"],
            ["DualPath scheduler", "1.18", f"{dp['snic_max_avg']:.3f}", f"{dp['jct_s']:.0f}"]]
    notes = ["Metric: per 1 s window, max ÷ mean read traffic over the 6 storage links of 2P4D, averaged "
             "over the loaded windows (mean traffic ≥ half the busiest window's; the paper drops the "
             "under-loaded tail too). The paper measured three machines; we use all six.",
             "The scheduler " + ("lowers" if dp["snic_max_avg"] < rr["snic_max_avg"] else "does not lower")
             + f" the imbalance ({rr['snic_max_avg']:.2f} → {dp['snic_max_avg']:.2f}).",
             _attn_note(r)]
    return {"title": f"Storage-link load balance, DS 660B 2P4D, 48K, {n} agents (Fig. 13)",
            "head": ["scheduler", "paper SNIC max/avg", "ours", "JCT s"], "rows": rows,
            "paper": "1.53 (round-robin) → 1.18 (DualPath scheduler).", "notes": notes}


def _capacity(r: Runner, cfg: str, mode: str, lo: float, hi: float, lv: dict) -> float:
    """Largest APS whose steady state meets the SLO, by bisection on [lo, hi]."""
    run = lambda aps: r.online(cfg, mode, aps, lv["online_lifetimes"], lv["online_turns"])  # noqa: E731
    if not run(lo)["met"]:
        return lo
    while run(hi)["met"]:
        lo, hi = hi, hi * 2
    for _ in range(lv["online_iters"]):
        mid = round((lo + hi) / 2, 4)
        if run(mid)["met"]:
            lo = mid
        else:
            hi = mid
    return lo


def online_capacity(r: Runner, lv: dict) -> dict:
    t = lv["online_turns"]
    rows, ratios = [], {}
    for name, cfg, paper, lo, hi in (("DS 660B 2P4D", C660, 2.25, 0.1 / t, 0.8 / t),
                                     ("DS 27B 1P1D", C27["1P1D"], 1.67, 0.05 / t, 0.4 / t)):
        b = _capacity(r, cfg, "basic", lo, hi, lv)
        d = _capacity(r, cfg, "dualpath", lo, hi, lv)
        ratios[name] = d / b
        rows.append([name, f"{b * t:.3f}", f"{d * t:.3f}", f"{d / b:.2f}x", f"{paper:.2f}x"])
    notes = ["SLO: mean TTFT ≤ 4 s and mean TPOT ≤ 50 ms over the turns submitted in the last quarter "
             "of the arrival span, and TTFT no longer growing (last quarter ≤ max(1.25 × previous, "
             "previous + 0.5 s)); the span is 3 agent lifetimes (paper: stop when TTFT exceeds 4 s or "
             "is steady over 150 s windows). Capacity = the largest APS meeting it (bisection)."
             + (f" Trajectories are shortened ×{t:g}, so raw APS is ×{1 / t:g}; the table shows "
                "APS × turns_scale (agents per second at full length)." if t != 1.0 else ""),
             f"Average of the two ratios {(sum(ratios.values()) / 2):.2f}x (paper: 1.96x).",
             "Why ours differ: Basic's capacity is set by the PE storage links (per agent ≈ 157 turns × "
             "34K hit tokens of KV) and DualPath's by compute once all links read; absolute APS is "
             "higher than the paper's because our cost model prefills faster."]
    return {"title": "Online serving: APS capacity under the SLO (Fig. 10)", "head": ["model / cluster",
            "Basic APS", "DualPath APS", "ratio", "paper ratio"], "rows": rows,
            "paper": "1.67x (DS 27B) and 2.25x (DS 660B) APS over Basic; 1.96x on average.",
            "notes": notes}


def scaleout(r: Runner, lv: dict, bench_json: Path | None, run_it: bool) -> dict:
    rows, note = [], ""
    if bench_json is not None and bench_json.exists():
        doc = json.loads(bench_json.read_text())
        runs = doc["results"]["runs"]
        for x in runs:
            build = {True: "compiled", False: "interpreted"}.get(x.get("compiled"), "")
            rows.append([x["cluster"], x["agents"], f"{x['jct_s']:.0f}", build, f"{x['wall_s']:.0f}",
                         f"{x['cpu_s']:.0f}", f"{x['events_per_s']:,.0f}", f"{x['peak_rss_mb']:.0f}"])
        # the paper's online scale-out row has no simulator counterpart here (see notes)
        ratio = runs[1]["jct_s"] / runs[0]["jct_s"]
        note = (f"From `{bench_json}` (`dualpath bench sim{' --quick' if doc['results']['quick'] else ''}`"
                f"); SNIC max/avg {runs[0]['snic_max_avg']:.2f} at {runs[0]['cluster']}, "
                f"{runs[1]['snic_max_avg']:.2f} at {runs[1]['cluster']} (a maximum over more links).")
    else:
        cfg, small, large, ts = lv["scaleout"]
        if not run_it and cfg.endswith("48p96d-ds660b.toml"):
            cfg, large, ts = "configs/sim-8p16d-ds660b.toml", small * 4, 0.35
        a = r.offline(C660, "dualpath", "64k", small, turns_scale=ts)
        b = r.offline(cfg, "dualpath", "64k", large, turns_scale=ts)
        shape = load(cfg).shape().split(" ")[0]
        rows = [["2P4D", small, f"{a['jct_s']:.0f}", "", "", "", "", ""],
                [shape, large, f"{b['jct_s']:.0f}", "", "", "", "", ""]]
        ratio = b["jct_s"] / a["jct_s"]
        note = f"Run here ({shape} instead of 48P96D unless --run-scaleout)." if shape != "48P96D" else ""
    notes = [f"JCT ratio large ÷ 2P4D = **{ratio:.3f}** (paper 3,201 / 3,167 = 1.011; goal ≤ 1.05). {note}",
             "What used to widen the gap (1.173 before the fix): the start of an offline run. "
             "Every agent submits its cold synthetic first round at t = 0 and its cold task "
             "prompt shortly after. Algorithm 1 caps a PE at β = 5 s of *reference-shape* prompt "
             "tokens (32.7K hit + 429 new); counted raw, a cold token (~40x the cost of a hit "
             "token) made β admit minutes of cold work, and the first PE group to fetch took the "
             "whole burst — a burst that grows with the cluster — while the others idled.",
             "Fixed in the scheduler (its code runs unchanged here): a PE's load counts each "
             "request's predicted prefill time in reference-shape tokens, "
             "`max(hit + new, prefill_s(hit, new) / prefill_s(ref) × ref tokens)` "
             "(`SchedulerConfig.pe_load = \"cost\"`, docs/simulator.md 'Findings'). 8P16D/8,192 vs "
             "2P4D/2,048 agents at 35 % of the turns: 1.074 → 1.014; 12P24D/12,288: 1.156 → 1.019. "
             "What then remained at full length (48P96D: 1.091) was a per-turn latency gap (mean "
             "TTFT 7.79 s vs 6.78 s) growing in the read wait: in the steady state the first PE "
             "group to fetch took the whole tick's intake, a lump of N ticks of its own share that "
             "grows with the number of groups N, and its reads queued on its own node. Fixed in "
             "the scheduler too: a fetch takes at most the group's fair share of the cluster's PE "
             "load (`SchedulerConfig.pe_share`, docs/simulator.md 'Findings' 1c); 48P96D full "
             "length 1.091 → 0.994 (mean TTFT 6.65 s vs 6.76 s). The paper's online scale-out row "
             "(44P88D at 8.8 APS vs 2P4D at 0.4 APS) is not simulated here."]
    return {"title": "Scale-out (Table 3)", "head": ["cluster", "agents", "JCT s", "simulator", "sim wall s",
            "sim CPU s", "events/s (wall)", "peak RSS MB"], "rows": rows,
            "paper": "Offline 2P4D 2K agents 3,167 s vs 48P96D 48K agents 3,201 s.", "notes": notes}


# ----------------------------------------------------------------------------- output

def render(sections: list[dict], level: str, wall: float) -> str:
    out = ["# Reproduction of the DualPath paper's results with the simulator", "",
           f"Generated by `python -m sim.reproduce --{level}` ({wall / 60:.1f} min of simulation, "
           f"{'compiled' if accel.active() else 'interpreted'} simulator: docs/simulator.md 'Compiled build'). "
           "Every number is a deterministic simulation of `configs/sim-*.toml` with the scheduler "
           "code of `services/scheduler` (imported unchanged); trajectories follow Table 2 "
           "(docs/simulator.md describes the model, its approximations and their checks). "
           "Absolute times depend on the cost model's *estimated* Hopper constants, so compare "
           "shapes and ratios, not seconds.", ""]
    if level == "quick":
        out += ["**Scaled down** (`--quick`): fewer agent counts and data points than the paper; "
                "offline runs keep full-length trajectories, online runs and the scale-out check "
                "use trajectories shortened to 35 % of their turns. `--full` runs the paper's "
                "agent counts.", ""]
    for s in sections:
        out += [f"## {s['title']}", "", f"**Paper:** {s['paper']}", ""]
        out += _table(s["head"], s["rows"])
        if s.get("extra"):
            out += [""] + _table(s["extra_head"], s["extra"])
        out += [""] + [f"- {n}" for n in s["notes"]] + [""]
    return "\n".join(out)


def _table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.reproduce", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="scaled down (default)")
    g.add_argument("--full", action="store_true", help="paper agent counts")
    ap.add_argument("--out", type=Path, default=Path("docs/reproduction.md"))
    ap.add_argument("--json", type=Path, default=Path("results/reproduction.json"))
    ap.add_argument("--scaleout-json", type=Path, default=None,
                    help="take the scale-out row from a `dualpath bench sim --out` file")
    ap.add_argument("--run-scaleout", action="store_true", help="simulate 48P96D here (~10 min)")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections: fig7,pd,append,ablation,snic,online,scaleout")
    args = ap.parse_args(argv)
    level = "full" if args.full else "quick"
    lv = LEVELS[level]
    r = Runner(lv["turns"])
    chosen = set((args.only or "fig7,pd,append,ablation,snic,online,scaleout").split(","))
    t0 = time.perf_counter()
    sections = []
    for name, fn in (("fig7", fig7), ("pd", pd_sweep), ("append", append_scaling), ("ablation", ablation),
                     ("snic", snic_balance), ("online", online_capacity)):
        if name in chosen:
            print(f"[{name}]", file=sys.stderr, flush=True)
            sections.append(fn(r, lv))
    if "scaleout" in chosen:
        print("[scaleout]", file=sys.stderr, flush=True)
        sections.append(scaleout(r, lv, args.scaleout_json, args.run_scaleout))
    wall = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from .trace_repro import keep_section      # the agentic-traces section has its own generator
    args.out.write_text(keep_section(args.out, render(sections, level, wall)))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"level": level, "sections": sections,
                                     "runs": {repr(k): v for k, v in r.cache.items()}}, indent=2, default=str))
    print(f"wrote {args.out} and {args.json} in {wall / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
