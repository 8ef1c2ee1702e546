"""``dualpath simulate``: run the discrete-event simulator on a config and print/write the results.

    dualpath simulate -c configs/sim-2p4d-ds660b.toml --dataset 64k --agents 2048 [--mode dualpath]
                      [--online --aps 0.4] [--out results/sim.json] [--png FILE | --no-png]

``--mode`` takes one mode, a comma-separated list, or ``all`` (basic, +layer, +dpl, pe-only, dualpath,
oracle); with several modes the same workload runs under each and a comparison table (JCT,
speedup over the first mode, SNIC max/avg, share of reads on the DE path) is printed.
``--trace PATH`` (a file or a directory; format detected or ``--format``) simulates a recorded
workload instead (docs/workloads.md): offline every session at t = 0 without think times, or
``--online --aps X`` with think times × ``--think-scale``; ``--repeat N`` copies, each its own key
space; prompts above the model's maximum context are compacted or dropped (``--context-policy``),
and the counts are printed.
Results go to ``--out`` (default ``results/sim/<config>-<dataset>-<agents>[-online<aps>].json``)
and a PNG beside it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.errors import ConfigError, InvalidArgument
from services.scheduler.core.modes import ABLATION_MODES

from .config import MODES, load
from .plots import plot_runs
from .report import print_summary
from .run import simulate, simulate_trace

ALL = ABLATION_MODES              # what --mode all runs: the ablation sweep


def parse_modes(text: str) -> list[str]:
    modes = list(ALL) if text == "all" else [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)} or 'all'")
    return modes


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dualpath simulate", description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", help="simulator config (configs/sim-*.toml); default: 2P4D DS 660B")
    ap.add_argument("--dataset", default="64k", choices=("32k", "48k", "64k"))
    ap.add_argument("--agents", type=int, default=2048)
    ap.add_argument("--mode", default="dualpath", help=f"{', '.join(MODES)}, a list, or 'all'")
    ap.add_argument("--online", action="store_true", help="Poisson agent arrivals at --aps (else all at t=0)")
    ap.add_argument("--aps", type=float, default=None, help="agents arriving per second (online)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--turns-scale", type=float, default=1.0, help="shorten trajectories (quick runs)")
    ap.add_argument("--append-scale", type=float, default=1.0, help="multiply every append (Fig. 9)")
    ap.add_argument("--gen-scale", type=float, default=1.0, help="multiply every generation length")
    ap.add_argument("--exact", action="store_true", help="per-layer flows and events (small runs)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    ap.add_argument("--png", type=Path, default=None, help="plot file (default: beside the JSON)")
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="only the comparison table / headline")
    ap.add_argument("--request-log", type=Path, default=None,
                    help="--trace: JSONL of every request (mode, id, session, submit time)")
    add_trace_args(ap)
    return ap


def add_trace_args(ap: argparse.ArgumentParser) -> None:
    """The recorded-workload options (shared with ``dualpath plan``)."""
    t = ap.add_argument_group("recorded traces (docs/workloads.md)")
    t.add_argument("--trace", default=None, help="trace file or directory (instead of --dataset), "
                   "or table2:DATASET[:AGENTS] (the Table 2 generator as a trace; AGENTS default --agents)")
    t.add_argument("--format", default=None, choices=("agentic", "mooncake"), help="default: detected")
    t.add_argument("--repeat", type=int, default=1, help="copies of every session, own key spaces")
    t.add_argument("--conversations", type=int, default=None, help="only the first N sessions")
    t.add_argument("--think-scale", type=float, default=None,
                   help="× every think time (default: 1 online, 0 offline)")
    t.add_argument("--context-policy", default="compact", choices=("compact", "drop"),
                   help="turns above the model's maximum context")
    t.add_argument("--max-context", type=int, default=None,
                   help="override [model] max_context_tokens")
    t.add_argument("--arrivals", default="poisson", choices=("poisson", "trace"),
                   help="online arrivals: Poisson at --aps, or the trace's own start times and "
                        "turn times (implies --online; docs/workloads.md)")
    t.add_argument("--speed", type=float, default=1.0,
                   help="--arrivals trace: trace seconds per simulated second")


def load_trace(args: argparse.Namespace, cfg=None):
    """The workload ``--trace`` names (``sim.recorded.TraceError`` on bad input); a
    ``table2:`` spec is generated with ``cfg``'s block size and seed (``--seed`` overrides)."""
    from .recorded import load_workload

    from .table2_trace import is_table2, table2_workload
    if is_table2(args.trace):
        cfg = cfg or load(getattr(args, "config", None))
        seed = getattr(args, "seed", None)
        w = table2_workload(args.trace, default_agents=args.agents, block_tokens=cfg.kv.block_tokens,
                            seed=cfg.sim.seed if seed is None else seed, turns_scale=args.turns_scale)
    else:
        w = load_workload(args.trace, args.format)
    return w.subset(args.conversations)


def run_one(cfg, mode: str, args: argparse.Namespace, trace, clusters: list,
            log: list | None = None) -> dict:
    if trace is not None:
        return simulate_trace(cfg, mode, trace, online=args.online, aps=args.aps, repeat=args.repeat,
                              think_scale=args.think_scale, policy=args.context_policy,
                              max_context=args.max_context, seed=args.seed,
                              exact=True if args.exact else None, cluster_out=clusters,
                              arrivals=args.arrivals, speed=args.speed, request_log=log)
    return simulate(cfg, mode, args.dataset, args.agents, online=args.online, aps=args.aps,
                    seed=args.seed, append_scale=args.append_scale, gen_scale=args.gen_scale,
                    turns_scale=args.turns_scale, exact=True if args.exact else None,
                    cluster_out=clusters)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        modes = parse_modes(args.mode)
        cfg = load(args.config)
        if args.arrivals == "trace":
            if not args.trace:
                raise ValueError("--arrivals trace needs --trace")
            args.online = True
        elif args.online and not args.aps:
            raise ValueError("--online needs --aps")
        trace = load_trace(args, cfg) if args.trace else None
    except (InvalidArgument, ConfigError, ValueError) as e:
        return input_error("simulate", e)
    runs, clusters = {}, []
    logs: dict[str, list] = {}
    for m in modes:
        try:
            runs[m] = run_one(cfg, m, args, trace, clusters, logs.setdefault(m, [])
                              if args.request_log else None)
        except InvalidArgument as e:
            return input_error("simulate", e)
        if not args.quiet:
            print_summary(runs[m])
            if "trace" in runs[m]:
                print_trace_stats(runs[m]["trace"])
            print()
    if len(modes) > 1:
        print_comparison(runs)
    what = (f"{Path(args.trace).stem.replace(':', '-')}-x{args.repeat}" if trace is not None
            else f"{args.dataset}-{args.agents}")
    online = ("-online-trace" if args.arrivals == "trace"
              else f"-online{args.aps:g}" if args.online else "")
    out = args.out or Path("results/sim") / f"{cfg.name}-{what}{online}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs}, indent=2, default=str))
    print(f"results written to {out}")
    if args.request_log:
        write_request_log(args.request_log, logs)
    if not args.no_png:
        msg = plot_runs(clusters, runs, args.png or out.with_suffix(".png"))
        print(msg)
    return 0


def write_request_log(path: Path, logs: dict[str, list]) -> None:
    """One JSON line per submitted request: mode, request id, session, submit time (s)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for mode, log in logs.items():
            for rid, session, t in log:
                f.write(json.dumps({"mode": mode, "request": rid, "session": session, "submit_s": t}) + "\n")
    print(f"request log written to {path}")


def input_error(prog: str, e: Exception) -> int:
    """Print a bad-input error (a typed error's message, which names the file) and return 2."""
    print(f"{prog}: {getattr(e, 'message', None) or e}", file=sys.stderr)
    return 2


def print_trace_stats(t: dict, file=None) -> None:
    print(f"  trace: {t['sessions']} sessions x{t['repeat']} "
          f"({t['agents_with_subagents']} agents with sub-agents), "
          f"{t['turns_per_copy']} turns per copy; context > {t['max_context']}: {t['compacted_turns']} "
          f"compacted, {t['dropped_turns']} dropped ({t['policy']}); hit share {t['hit_share']:.1%}; "
          + (f"arrivals: the trace's own times, speed {t['speed']:g}" if t.get("arrivals") == "trace"
             else f"think x{t['think_scale']:g}"), file=file or sys.stdout)


def print_comparison(runs: dict[str, dict], file=None) -> None:
    file = file or sys.stdout
    first = next(iter(runs.values()))["jct_s"]
    print(f"{'mode':12s} {'JCT s':>10s} {'speedup':>8s} {'SNIC max/avg':>13s} {'DE-path %':>10s} "
          f"{'TTFT mean':>10s} {'TPOT ms':>8s}", file=file)
    for m, r in runs.items():
        rb = r["read_bytes"]
        tot = rb["pe_path"] + rb["de_path"]
        share = 100 * rb["de_path"] / tot if tot else 0.0
        print(f"{m:12s} {r['jct_s']:10.1f} {first / r['jct_s']:8.3f} {r['snic_max_avg']:13.3f} "
              f"{share:10.1f} {r['latency']['ttft']['mean']:10.3f} {r['latency']['tpot']['mean'] * 1e3:8.1f}",
              file=file)


if __name__ == "__main__":
    sys.exit(main())
