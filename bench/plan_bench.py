"""``dualpath bench plan``: GPUs the capacity planner needs for the real agentic traces, pe-only vs
dualpath, at the same SLO (``plan_gpu_saving``), basic beside it, and the planner's wall time.

Workload: the shared agentic conversations (``../shared/traces/agentic``, or
``$DUALPATH_SHARED_DIR``), DeepSeek 660B preset on the paper's hardware
(``configs/sim-2p4d-ds660b.toml``: 8 GPUs per node, 400 Gbps SNIC and CNICs); sessions arrive
online as a Poisson process; SLO TTFT p90 ≤ 4 s and TPOT p90 ≤ 50 ms over every request.
Think times are scaled by 0 (the paper's online agents, §7.2, have no tool latency: every turn
follows the previous at once, the load the cluster must be sized for).

* full: all 71 conversations × 8 copies (568 sessions, 31K requests) at 1 session/s, the
  ``--quick`` planner shapes (P:D 1:2 and 1:1); goal: planner wall time < 10 min on one core.
* ``--quick``: × 4 copies at 0.5 sessions/s, the same P:D 1:2 and 1:1 (< 60 s): enough load that
  dualpath needs more than the smallest shape (at 2 copies and 0.25/s every mode but basic fits
  1P1D, where the next candidate is +50 % GPUs and the ratio says nothing).

The search (``sim.plan``): every integer k of each ratio, then one node at a time between the
largest shape that missed and the first that met, so the answer's step is one node (8 GPUs), not
one copy of a ratio; the JSON's ``grid.step_at_dualpath`` says how far the next shape above
dualpath's is (the ratio's resolution).

Headline: ``plan_gpu_saving`` = ``pe-only`` GPUs ÷ dualpath GPUs (``baseline_mode``): ``pe-only``
is dualpath with the DE read path switched off — the same layer-wise prefill, quota batching and
placement — so the ratio is what the dual read path itself saves. Its goal is only ≥ 1.0 (the
second path never costs GPUs); the value is reported as measured. ``saving_vs_basic`` (basic also
lacks layer-wise prefill and quota batching; the old headline, goal ≥ 1.4) is beside it. Also
reported: the attained SLO of the simulated online run at the chosen dualpath shape, the binding
resource and eq. (9) of each chosen shape. The simulator runs compiled (``sim.accel``), built
first if missing (``--no-accel``: interpreted).
"""

from __future__ import annotations

import sys
import time

from bench.report import bench_parser, headline, print_table, write_results
from bench.sim_bench import _rerun
from sim import accel

GOAL = 1.0            # vs pe-only: the dual read path never costs GPUs (no target above that)
GOAL_VS_BASIC = 1.4
WALL_GOAL_S = 600.0


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("plan", __doc__.splitlines()[0])
    p.add_argument("--no-accel", action="store_true", help="run the simulator interpreted")
    p.add_argument("--trace", default=None, help="agentic trace directory (default: the shared one)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    rc = _rerun(argv, not args.no_accel, "bench.plan_bench")
    if rc is not None:
        return rc
    from sim.recorded import load_workload, shared_agentic_dir
    from sim.config import load
    from sim.plan import QUICK_RATIOS, SLO, PlanWorkload, plan
    from sim.plan_cli import render

    print(f"simulator: {accel.status()}", flush=True)
    path = args.trace or shared_agentic_dir()
    if not (args.trace or shared_agentic_dir().is_dir()):
        print(f"bench plan: the shared agentic traces are not at {path} (set DUALPATH_SHARED_DIR)",
              file=sys.stderr)
        return 2
    t0, c0 = time.perf_counter(), time.process_time()
    trace = load_workload(path)
    repeat, aps, ratios = (4, 0.5, QUICK_RATIOS) if args.quick else (8, 1.0, QUICK_RATIOS)
    wl = PlanWorkload(trace=trace, repeat=repeat, aps=aps, think_scale=0.0)
    slo = SLO(online=True, percentile=90.0, ttft_s=4.0, tpot_s=0.050)
    cfg = load("configs/sim-2p4d-ds660b.toml")
    print(f"plan: {wl.describe()}, SLO {slo.describe()}, P:D ratios {ratios}", flush=True)
    step = lambda mode, i, n: print(f"  {mode}: {i}/{n} shapes", flush=True)  # noqa: E731
    result = plan(cfg, wl, slo, ratios=ratios, on_step=step)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    render(result)
    rows = [{"mode": m, "shape": v["chosen"]["shape"], "gpus": v["chosen"]["gpus"], "met": v["met"],
             "ttft_p90_s": v["chosen"]["attained"]["ttft_s"], "tpot_p90_ms": v["chosen"]["attained"]["tpot_s"] * 1e3,
             "binding": v["chosen"]["binding"]["resource"], "eq9_inside": v["eq9"]["inside"],
             "shapes_tried": len(v["evaluated"])} for m, v in result["modes"].items()]
    print_table(rows, list(rows[0]))
    saving = result["saving"]["ratio"] or 0.0
    vs_basic = result["saving_vs_basic"]["ratio"] or 0.0
    dp = result["modes"]["dualpath"]["chosen"]
    checks = {"saving_at_least_1": saving >= GOAL, "saving_vs_basic_at_least_1_4": vs_basic >= GOAL_VS_BASIC,
              "wall_under_10min": wall < WALL_GOAL_S,
              "cpu_under_10min": cpu < WALL_GOAL_S, "dualpath_meets_slo": result["modes"]["dualpath"]["met"]}
    print(f"planner wall {wall:.1f} s, CPU {cpu:.1f} s (one core); dualpath at {dp['shape']}: TTFT p90 "
          f"{dp['attained']['ttft_s']:.2f} s, TPOT p90 {dp['attained']['tpot_s'] * 1e3:.1f} ms; "
          + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items()))
    head = headline("plan_gpu_saving", saving, GOAL, higher_is_better=True)
    head |= {"baseline_mode": result["saving"]["baseline_mode"], "saving_vs_basic": vs_basic,
             "grid_step_at_dualpath": result["grid"]["step_at_dualpath"]}
    write_results(args.out, "plan", head, {"baseline_mode": result["saving"]["baseline_mode"],
                                           "saving_vs_basic": vs_basic,
                                           "saving_lower_bound": result["saving"]["lower_bound"],
                                           "grid": result["grid"],
                                           "quick": args.quick, "planner_wall_s": wall, "planner_cpu_s": cpu,
                                           "dualpath_attained_slo": dp["attained"], "checks": checks,
                                           "rows": rows, "plan": result, "compiled": accel.active(),
                                           "simulator_build": accel.status()})
    return 0
