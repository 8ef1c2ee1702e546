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

**Hit-rate sweep** (``basic`` vs ``dualpath``, after the ablation): a synthetic Mooncake-format
workload the bench writes itself, one point per hit share of :data:`SWEEP_HITS` (0 %, 50 %,
95 %). Both modes' clusters run at once (fresh, their own names and storage); per point, seed
requests store a few shared prefixes on each, then bursts of requests (all at t = 0) each read
that share of their prompt from storage and compute and write back the rest, the two modes'
bursts alternating (basic first, then dualpath first), so a load spike from another process
on a shared 2-core host hits both modes alike instead of whichever happened to run then. A
point's JCT per mode is its best of :data:`SWEEP_REPEATS` bursts (other processes only ever
add time). ``worst_ratio_vs_basic`` =
min over the points of JCT(basic) ÷ JCT(dualpath), goal ≥ 0.97 (a user who turns dualpath on
never loses by it; docs/workloads.md "Never worse than basic").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import bench_parser, headline, print_table, write_results
from services.scheduler.core.modes import ABLATION_MODES

MODES = ABLATION_MODES             # the ablation sweep, in the order it is reported
GOAL = 1.8
SWEEP_HITS = (0.0, 0.5, 0.95)      # hit share of a burst request's prompt
SWEEP_MODES = ("basic", "dualpath")
SWEEP_GOAL = 0.97                  # worst_ratio_vs_basic
SWEEP_BLOCKS = 20                  # Mooncake blocks per prompt (64 tokens each at scale 1/8)
SWEEP_DOCS = 4                     # shared prefixes (one seed request each)
SWEEP_REPEATS = 2                  # bursts per point and mode; the best one counts
SWEEP_SETTLE_S = 0.2               # pause before each burst (write-backs of the last one land)


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
            "ok": _checks_ok(c)}


def sweep_workloads(directory: Path, hit: float, burst: int, index: int,
                    repeats: int = SWEEP_REPEATS) -> tuple[list[Any], list[Any]]:
    """One sweep point's Mooncake-format files as replay specs: ``(seeds, bursts)``.

    Every request's prompt is ``SWEEP_BLOCKS`` trace blocks plus half a block; a burst
    request's first ``round(hit · SWEEP_BLOCKS)`` blocks are one of ``SWEEP_DOCS`` prefixes the
    seeds stored, the rest fresh (in every one of the ``repeats`` bursts). Hash ids are
    disjoint between points (``index``), so the points share a cluster without sharing hits.
    No seeds at 0 %: nothing to share.
    """
    from tools.replay.workloads import TraceSpec
    n_hit = min(round(hit * SWEEP_BLOCKS), SWEEP_BLOCKS - 1)
    base = (index + 1) * 10_000_000
    fresh = iter(range(base + SWEEP_DOCS * SWEEP_BLOCKS, base + 10_000_000))
    docs = [list(range(base + d * SWEEP_BLOCKS, base + d * SWEEP_BLOCKS + n_hit))
            for d in range(SWEEP_DOCS)]

    def line(prefix: list[int]) -> str:
        ids = prefix + [next(fresh) for _ in range(SWEEP_BLOCKS - len(prefix))]
        return json.dumps({"timestamp": 0, "input_length": SWEEP_BLOCKS * 512 + 256,
                           "output_length": 128, "hash_ids": ids + [next(fresh)]})

    def spec(name: str, prefixes: list[list[int]]) -> TraceSpec:
        path = directory / f"sweep-{index}-{name}.jsonl"
        path.write_text("".join(line(p) + "\n" for p in prefixes))
        return TraceSpec(str(path), limit=None, speed=1.0, scale=0.125)

    seeds = [spec("seeds", docs)] if n_hit else []
    return seeds, [spec(f"burst{r}", [docs[i % SWEEP_DOCS] for i in range(burst)])
                   for r in range(repeats)]


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


async def run_sweep(cluster: Any, burst: int, inprocess: bool, echo: Any = print,
                    **kw: Any) -> dict[float, dict[str, list[dict[str, Any]]]]:
    """The hit-rate sweep (module docstring): ``{hit share: {mode: [burst results]}}``."""
    from tools.replay.run import fresh_cluster, replay
    sweep: dict[float, dict[str, list[dict[str, Any]]]] = {
        h: {m: [] for m in SWEEP_MODES} for h in SWEEP_HITS}
    root = Path("data/bench-e2e").resolve()
    t0 = time.monotonic()
    echo(f"== sweep: {' vs '.join(SWEEP_MODES)}, {burst} requests per burst")
    with tempfile.TemporaryDirectory(prefix="sweep-", dir=_mkdir(root)) as tmp:
        async with contextlib.AsyncExitStack() as stack:
            targets = {}
            for m in SWEEP_MODES:
                cl = cluster.with_overrides(cluster={"name": f"{cluster.spec.name}-sweep-{m}"})
                targets[m] = await stack.enter_async_context(fresh_cluster(
                    cl, mode=m, storage_root=str(root / f"sweep-{m}"), inprocess=inprocess,
                    remove_storage=True))
            # a fresh cluster's first requests open its transfer endpoints (both read paths):
            # a small unmeasured warm-up burst on each, else the first point pays for it
            seeds, warm = sweep_workloads(Path(tmp), 0.95, 8, len(SWEEP_HITS), repeats=1)
            for m in SWEEP_MODES:
                for w in seeds + warm:
                    await replay(targets[m], w, **kw)
            for i, h in enumerate(SWEEP_HITS):
                seeds, bursts = sweep_workloads(Path(tmp), h, burst, i)
                for m in SWEEP_MODES:
                    for w in seeds:
                        await replay(targets[m], w, **kw)
                for r, w in enumerate(bursts):
                    for m in (SWEEP_MODES if r % 2 == 0 else SWEEP_MODES[::-1]):
                        await asyncio.sleep(SWEEP_SETTLE_S)
                        sweep[h][m].append(await replay(targets[m], w, **kw))
                echo(f"   {h:.0%} hits: burst JCT " + "; ".join(
                    f"{m} " + ", ".join(f"{b['summary'].get('jct_s') or 0:.2f}" for b in runs)
                    for m, runs in sweep[h].items()) + " s")
    echo(f"   wall {time.monotonic() - t0:.1f} s")
    return sweep


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the shortest JCT (a failed one, without a JCT, last)."""
    return min(runs, key=lambda r: r["summary"].get("jct_s") or float("inf"))


def sweep_rows(sweep: dict[float, dict[str, list]]) -> list[dict[str, Any]]:
    """One row per sweep point: both modes' best burst JCTs, their ratio, hit rate, read split."""
    rows = []
    for h, by in sweep.items():
        if not all(m in by for m in SWEEP_MODES):
            continue
        b, d = (best(by[m])["summary"] for m in SWEEP_MODES)
        jb, jd = b.get("jct_s"), d.get("jct_s")
        db = d.get("bytes", {})
        pe, de = db.get("storage_read_pe_path", 0.0), db.get("storage_read_de_path", 0.0)
        rows.append({"hit_share": h, "hit_rate": d["tokens"]["hit_rate"],
                     "basic_jct_s": jb, "dualpath_jct_s": jd,
                     "ratio_vs_basic": (jb / jd) if jb and jd else None,
                     "de_read_share": (de / (pe + de)) if pe + de > 0 else 0.0,
                     "basic_ttft_p50_s": b["latency"]["ttft"]["p50"],
                     "dualpath_ttft_p50_s": d["latency"]["ttft"]["p50"],
                     "runs_s": {m: [r["summary"].get("jct_s") for r in by[m]] for m in SWEEP_MODES},
                     "ok": all(_checks_ok(r["summary"]["checks"]) for m in SWEEP_MODES
                               for r in by[m])})
    return rows


def _checks_ok(c: dict[str, Any]) -> bool:
    return bool(c["all_finished"] and c["hit_mismatches"] == 0
                and c.get("every_prompt_verified", False)
                and c.get("storage_read_matches_hits", False)
                # oracle: nothing of the hit crossed PE -> DE (None: a retry interfered)
                and c.get("pe_to_de_matches_new_tokens") is not False)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


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
    p.add_argument("--no-sweep", action="store_true",
                   help="skip the hit-rate sweep (basic vs dualpath at 0 %%, 50 %%, 95 %% hits)")
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
    burst = 0 if args.no_sweep else (32 if args.quick else 96)
    sweep = asyncio.run(run_sweep(cluster, burst, args.inprocess, progress=False)) if burst else {}
    pred = predicted(cluster, spec, modes)
    base = results.get("basic", {}).get("summary", {}).get("jct_s")
    rows = [row(m, r["summary"], base, pred) for m, r in results.items()]
    print_table(rows, ["mode", "jct_s", "speedup", "sim_speedup", "snic_max_avg", "read_pe_MB",
                       "read_de_MB", "pe_to_de_MB", "de_to_pe_MB", "written_MB", "hit_rate",
                       "ttft_p50_s", "ok"])
    if args.plots is not None:
        from tools.replay.plots import plot_all
        print("plots: " + ", ".join(str(x) for x in plot_all(results, args.plots)))
    srows = sweep_rows(sweep)
    if srows:
        print(f"\nhit-rate sweep ({burst} requests per burst, basic vs dualpath):")
        print_table(srows, ["hit_share", "hit_rate", "basic_jct_s", "dualpath_jct_s",
                            "ratio_vs_basic", "de_read_share", "basic_ttft_p50_s",
                            "dualpath_ttft_p50_s", "ok"])
    ratios = [r["ratio_vs_basic"] for r in srows if r["ratio_vs_basic"] is not None]
    worst = min(ratios) if ratios else None
    if worst is not None:
        print(f"worst_ratio_vs_basic = {worst:.3f} (goal >= {SWEEP_GOAL})")
    dp = results.get("dualpath", {}).get("summary", {}).get("jct_s")
    value = (base / dp) if base and dp else 0.0
    checks = {"all_modes_ok": all(r["ok"] for r in rows) and all(r["ok"] for r in srows),
              "oracle_at_least_dualpath": _cmp(rows, "oracle", "dualpath"),
              "snic_dualpath_below_dpl": _snic_below(rows),
              "never_worse_than_basic": None if worst is None else worst >= SWEEP_GOAL}
    write_results(args.out, "e2e", headline("dualpath_speedup_vs_basic", value, GOAL),
                  {"config": cluster.source, "cluster": cluster.spec.shape,
                   "remote_engines": cluster.spec.remote_engines,
                   "workload": _builtins(spec), "rows": rows, "checks": checks,
                   "worst_ratio_vs_basic": worst, "worst_ratio_goal": SWEEP_GOAL,
                   "sweep": {"hit_shares": list(SWEEP_HITS), "burst_requests": burst,
                             "prompt_blocks": SWEEP_BLOCKS, "prefixes": SWEEP_DOCS,
                             "repeats": SWEEP_REPEATS, "rows": srows,
                             "summaries": {f"{h:g}": {m: best(rs)["summary"]
                                                      for m, rs in by.items()}
                                           for h, by in sweep.items()}},
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
