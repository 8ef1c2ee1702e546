"""``dualpath bench e2e -c configs/local-1p2d.toml``: the ablation on real services, real bytes.

The same agentic workload (paper Table 2 shape, scaled to the emulation) replayed offline under
``basic`` (PE-side reads, whole-prompt prefill, round-robin), ``+layer`` (layer-wise prefill),
``+dpl`` (both read paths, alternating), ``pe-only`` (``dualpath`` without the DE read path),
``dualpath`` (full scheduler) and ``oracle`` (the
paper's bound: the hit is resident on both engines — no KV read, loaded or sent for it, no
compute for it, nothing of it written back; docs/datapath.md "Oracle"). Each mode gets a
fresh cluster of subprocesses on empty storage (so every mode reads exactly what its own
earlier turns wrote back). Reported per mode: JCT, speedup over basic,
SNIC max/avg, bytes per path, hit rate, the run's checks (every request finished, hits as
predicted, storage bytes = hits, every prompt byte-verified), and the simulator's predicted
speedup for the same config when the simulator is available.

Headline: ``dualpath_speedup_vs_basic`` = JCT(basic) ÷ JCT(dualpath), goal ≥ 1.8 (paper up to
1.87×). ``--quick`` runs fewer agents and turns of the same workload (same mechanism).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench.report import bench_parser, headline, print_table, write_results
from services.scheduler.core.modes import ABLATION_MODES

MODES = ABLATION_MODES             # the ablation sweep, in the order it is reported
GOAL = 1.8


def workload(quick: bool, agents: int | None = None, turns: int | None = None):
    from tools.replay.workloads import AgenticSpec
    return AgenticSpec("32k", agents or (16 if quick else 24), seed=1, scale=0.125,
                       max_turns=turns or (10 if quick else 12))


def predicted(cluster: Any, spec: Any, modes: tuple[str, ...]) -> dict[str, Any]:
    """The simulator's speedup per mode for this cluster (None per mode when unavailable)."""
    try:
        from tools.cluster.simhook import predict
        return predict(cluster, spec, modes)
    except Exception as e:         # the simulator is optional here: report why it is missing
        return {"error": f"{type(e).__name__}: {e}"}


def row(mode: str, s: dict[str, Any], base_jct: float | None, pred: dict[str, Any]) -> dict:
    b, links, c = s.get("bytes", {}), s.get("links", {}), s["checks"]
    jct = s.get("jct_s")
    p = pred.get(mode) if isinstance(pred.get(mode), dict) else {}
    mb = lambda k: round(b.get(k, 0.0) / 1e6, 1)  # noqa: E731
    return {"mode": mode, "jct_s": jct,
            "speedup": (base_jct / jct) if base_jct and jct else None,
            "sim_speedup": p.get("speedup_vs_basic"),
            "snic_max_avg": links.get("snic_max_avg"),
            "read_pe_MB": mb("storage_read_pe_path"), "read_de_MB": mb("storage_read_de_path"),
            "pe_to_de_MB": mb("pe_to_de"), "de_to_pe_MB": mb("de_to_pe"),
            "written_MB": mb("storage_written"),
            "hit_rate": s["tokens"]["hit_rate"],
            "ttft_p50_s": s["latency"]["ttft"]["p50"],
            "ok": bool(c["all_finished"] and c["hit_mismatches"] == 0
                       and c.get("every_prompt_verified", False)
                       and c.get("storage_read_matches_hits", False)
                       # oracle: nothing of the hit crossed PE -> DE (None: a retry interfered)
                       and c.get("pe_to_de_matches_new_tokens") is not False)}


async def run_modes(cluster: Any, spec: Any, modes: tuple[str, ...], inprocess: bool,
                    echo: Any = print, **kw: Any) -> dict[str, dict[str, Any]]:
    from tools.replay.run import replay_fresh
    out = {}
    root = Path("data/bench-e2e").resolve()
    for mode in modes:
        t0 = time.monotonic()
        echo(f"== {mode}")
        out[mode] = await replay_fresh(cluster, spec, mode=mode,
                                       storage_root=str(root / mode.replace("+", "plus-")),
                                       inprocess=inprocess, echo=None, remove_storage=True, **kw)
        s = out[mode]["summary"]
        echo(f"   JCT {s.get('jct_s', 0):.2f} s, {s['finished']}/{s['requests']} finished, "
             f"wall {time.monotonic() - t0:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("e2e", __doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="configs/local-1p2d.toml")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    p.add_argument("--agents", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--inprocess", action="store_true", help="services in this process")
    p.add_argument("--plots", type=Path, default=None, help="write the PNGs here")
    p.add_argument("--remote-engines", action="store_true",
                   help="emulated engines in their own processes, attached over each node's "
                        "engine socket (docs/engine-api.md \"Cross-process\")")
    args = p.parse_args(argv)
    from common.logging import configure_logging
    from tools.cluster.config import load_cluster
    configure_logging("warning", None)
    cluster = load_cluster(args.config)
    cluster = cluster.with_overrides(cluster={"name": f"{cluster.spec.name}-bench"})
    if args.remote_engines:
        cluster = cluster.with_overrides(cluster={"remote_engines": True})
    modes = tuple(m for m in args.modes.split(",") if m)
    spec = workload(args.quick, args.agents, args.turns)
    print(f"e2e ablation on {cluster.source} ({cluster.spec.shape}, "
          f"{'in-process' if args.inprocess else 'subprocesses'}"
          f"{', engines over their sockets' if args.remote_engines else ''}): {spec}")
    results = asyncio.run(run_modes(cluster, spec, modes, args.inprocess, progress=False))
    pred = predicted(cluster, spec, modes)
    base = results.get("basic", {}).get("summary", {}).get("jct_s")
    rows = [row(m, r["summary"], base, pred) for m, r in results.items()]
    print_table(rows, ["mode", "jct_s", "speedup", "sim_speedup", "snic_max_avg", "read_pe_MB",
                       "read_de_MB", "pe_to_de_MB", "de_to_pe_MB", "written_MB", "hit_rate",
                       "ttft_p50_s", "ok"])
    if args.plots is not None:
        from tools.replay.plots import plot_all
        print("plots: " + ", ".join(str(x) for x in plot_all(results, args.plots)))
    dp = results.get("dualpath", {}).get("summary", {}).get("jct_s")
    value = (base / dp) if base and dp else 0.0
    checks = {"all_modes_ok": all(r["ok"] for r in rows),
              "oracle_at_least_dualpath": _cmp(rows, "oracle", "dualpath"),
              "snic_dualpath_below_dpl": _snic_below(rows)}
    write_results(args.out, "e2e", headline("dualpath_speedup_vs_basic", value, GOAL),
                  {"config": cluster.source, "cluster": cluster.spec.shape,
                   "remote_engines": cluster.spec.remote_engines,
                   "workload": _builtins(spec), "rows": rows, "checks": checks,
                   "predicted": pred,
                   "summaries": {m: r["summary"] for m, r in results.items()}})
    return 0 if checks["all_modes_ok"] else 1


def _cmp(rows: list[dict], better: str, than: str) -> bool | None:
    by = {r["mode"]: r for r in rows}
    if better not in by or than not in by or not by[better]["jct_s"]:
        return None
    return by[better]["jct_s"] <= by[than]["jct_s"] * 1.02


def _snic_below(rows: list[dict]) -> bool | None:
    by = {r["mode"]: r.get("snic_max_avg") for r in rows}
    if by.get("dualpath") is None or by.get("+dpl") is None:
        return None
    return by["dualpath"] < by["+dpl"]


def _builtins(spec: Any) -> dict:
    import msgspec
    return msgspec.to_builtins(spec)


if __name__ == "__main__":
    raise SystemExit(main())
