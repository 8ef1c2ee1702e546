"""Results of one simulated run as a JSON-able dict, and its printed summary."""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING

from . import accel
from .stats import link_summary

if TYPE_CHECKING:
    from .cluster import Cluster

SLO_TTFT_S = 4.0
SLO_TPOT_S = 0.050


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB.

    On Linux from ``VmHWM`` (this address space's high-water mark): ``ru_maxrss`` survives
    ``execve``, so a child started by a large parent would report the parent's peak.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def results(cl: Cluster) -> dict:
    now = cl.loop.now
    cfg = cl.cfg
    if cl.windows.rows and now > len(cl.windows.rows) * cfg.sim.window_s + 1e-9:
        cl.windows.sample(now)
    snic_ratio, snic_windows = cl.windows.max_avg()
    early = [v for k, v in cl.attn_windows.items() if (k + 1) * cfg.sim.window_s <= 0.05 * now]
    attn_early = sum(v[0] for v in early) / sum(v[1] for v in early) if early else None
    pe_ep = cl.prefill.ep_steps
    ts = cl.ts
    out = {
        "config": cfg.name, "shape": cfg.shape(), "model": cfg.model.preset, "mode": cl.mode,
        "workload": cl.workload.describe(), "agents": cl.n_agents, "online": cl.online,
        "aps": cl.aps if cl.online else None, "exact_layers": cl.exact, "time_scale": ts,
        "jct_s": now, "agent_jct": cl.agent_jct.summary(),
        "requests": cl.requests_done, "agents_done": cl.agents_done,
        "prompt_tokens": cl.tokens_prompt, "gen_tokens": cl.tokens_gen,
        "prompt_tokens_per_s": cl.tokens_prompt / now if now else 0.0,
        "latency": {"ttft": cl.ttft.summary(), "ttst": cl.ttst.summary(), "tpot": cl.tpot.summary()},
        "ttft_breakdown_mean_s": dict(zip(("de_wait", "pe_wait", "read", "prefill"),
                                          (b / max(cl.requests_done, 1) for b in cl.breakdown))),
        "read_bytes": {"pe_path": cl.read_bytes[0], "de_path": cl.read_bytes[1]},
        "links": link_summary(cl.links_by_class(), now),
        "snic_max_avg": snic_ratio, "snic_windows": snic_windows,
        "attn_max_avg": cl.prefill.attn_ratio_sum / pe_ep if pe_ep else None,
        "attn_max_avg_first5pct": attn_early,
        "pe_compute_util": cl.prefill.busy_s / (len(cl.units) * now) if now else 0.0,
        "sim": {"events": cl.loop.events, "wall_s": cl.wall_s,
                "events_per_s": cl.loop.events / cl.wall_s if cl.wall_s else 0.0,
                "requests_per_s": cl.requests_done / cl.wall_s if cl.wall_s else 0.0,
                "flows": cl.net.started, "resolves": cl.net.resolves, "widened": cl.net.widened,
                "peak_rss_mb": peak_rss_mb(), "compiled": accel.active(), "build": accel.status()},
    }
    stats = getattr(cl.workload, "stats", None)
    if stats is not None:            # trace sessions: context policy counts (session_workload.py)
        out["trace"] = stats()
    if cl.online:
        ttft_ss, tpot_ss = cl.ttft_ss.summary(), cl.tpot_ss.summary()
        quarters = [q[0] / q[1] if q[1] else None for q in cl.quarters]
        q3, q4 = quarters[2], quarters[3]
        stable = q3 is not None and q4 is not None and q4 <= max(1.25 * q3, q3 + 0.5 * ts)
        out["steady"] = {"window_s": list(cl.ss_window), "ttft": ttft_ss, "tpot": tpot_ss,
                         "ttft_mean_by_quarter": quarters, "stable": stable}
        out["slo"] = {"ttft_s": SLO_TTFT_S * ts, "tpot_s": SLO_TPOT_S * ts,
                      "met": bool(ttft_ss["n"]) and stable and ttft_ss["mean"] <= SLO_TTFT_S * ts
                      and tpot_ss["mean"] <= SLO_TPOT_S * ts}
    return out


def print_summary(r: dict, file=None) -> None:
    file = file or sys.stdout
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p(f"{r['config']} [{r['shape']}, {r['model']}] mode={r['mode']} — {r['workload']}"
      + (f", online {r['aps']:.4g} APS" if r["online"] else ", offline"))
    p(f"  JCT {r['jct_s']:.1f} s   requests {r['requests']}   agent JCT mean {r['agent_jct']['mean']:.1f} s   "
      f"prompt {r['prompt_tokens_per_s']:.4g} tok/s")
    lat = r["latency"]
    for k in ("ttft", "ttst", "tpot"):
        s = lat[k]
        p(f"  {k.upper():4s} mean {s['mean']:.4g}  p50 {s['p50']:.4g}  p90 {s['p90']:.4g}  p99 {s['p99']:.4g} s")
    if r["online"]:
        st, slo = r["steady"], r["slo"]
        p(f"  steady TTFT mean {st['ttft']['mean']:.3f} s, TPOT mean {st['tpot']['mean'] * 1e3:.1f} ms "
          f"{'stable' if st['stable'] else 'still growing'} → SLO (TTFT ≤ {slo['ttft_s']:g} s, "
          f"TPOT ≤ {slo['tpot_s'] * 1e3:g} ms) {'MET' if slo['met'] else 'MISSED'}")
    b = r["ttft_breakdown_mean_s"]
    p("  TTFT breakdown (mean s): " + ", ".join(f"{k} {v:.3g}" for k, v in b.items()))
    rb = r["read_bytes"]
    tot = rb["pe_path"] + rb["de_path"]
    if tot:
        p(f"  hit KV read: {tot / 1e12:.3f} TB, {100 * rb['de_path'] / tot:.1f} % on the DE path")
    p(f"  SNIC max/avg {r['snic_max_avg']:.3f} over {r['snic_windows']} windows"
      + (f"; attention max/avg {r['attn_max_avg']:.3f}" if r["attn_max_avg"] else ""))
    p("  link utilisation (mean / max):")
    for k, v in r["links"].items():
        p(f"    {k:14s} {v['mean_util']:6.3f} / {v['max_util']:6.3f}")
    s = r["sim"]
    p(f"  simulated {s['events']:,} events in {s['wall_s']:.2f} s ({s['events_per_s']:,.0f} events/s, "
      f"{s['requests_per_s']:,.0f} requests/s), peak RSS {s['peak_rss_mb']:.0f} MB; {s['build']}")
