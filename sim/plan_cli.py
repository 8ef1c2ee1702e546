"""``dualpath plan``: the cheapest cluster that meets an SLO, basic vs pe-only vs dualpath, side by side.

    dualpath plan --online --aps 0.2 --ttft 4 --tpot 0.05          # the shared agentic traces
    dualpath plan --trace DIR -c configs/sim-2p4d-ds660b.toml --jct 4000 --repeat 8   # offline
    dualpath plan --table2 --dataset 64k --agents 1024 --jct 2500 --quick
    dualpath plan --trace table2:32k:256 --turns-scale 0.25 --jct 600 --quick   # the same, as a trace

The hardware profile is the ``[hardware]`` section of ``-c`` (link rates, GPUs per node; P and D
are what the search varies), the model its ``[model]`` (``--preset`` overrides). Prints per mode
the chosen shape, GPUs, attained SLO, the binding resource and the eq. (9) check of that shape,
then the GPU saving against ``pe-only`` (dualpath without the DE read path: what the dual path
itself saves) and against ``basic``, with the grid's step at dualpath's shape; ``--out`` JSON
and a frontier plot (GPUs vs attained SLO per mode). Exit 0 when dualpath meets the SLO, 1 when
no shape does (the closest shape is shown), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.errors import ConfigError, InvalidArgument

from .cli import add_trace_args, input_error, load_trace
from .config import load, replace
from .plan import MODES, QUICK_RATIOS, RATIOS, SLO, PlanWorkload, plan

DEFAULT_CONFIG = "configs/sim-2p4d-ds660b.toml"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dualpath plan", description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", default=DEFAULT_CONFIG, help="hardware profile + model")
    ap.add_argument("--preset", default=None, help="model preset (overrides [model] preset)")
    ap.add_argument("--table2", action="store_true", help="plan for a Table 2 dataset, not a trace")
    ap.add_argument("--dataset", default="64k", choices=("32k", "48k", "64k"))
    ap.add_argument("--agents", type=int, default=512)
    ap.add_argument("--turns-scale", type=float, default=1.0)
    ap.add_argument("--online", action="store_true", help="sessions arrive at --aps (else offline)")
    ap.add_argument("--aps", type=float, default=None, help="sessions (agents) arriving per second")
    ap.add_argument("--percentile", type=float, default=90.0, help="online SLO percentile")
    ap.add_argument("--ttft", type=float, default=4.0, help="online SLO: TTFT percentile ≤ s")
    ap.add_argument("--tpot", type=float, default=0.050, help="online SLO: TPOT percentile ≤ s")
    ap.add_argument("--jct", type=float, default=None, help="offline SLO: JCT ≤ s")
    ap.add_argument("--quick", action="store_true", help=f"P:D ratios {QUICK_RATIOS} only")
    ap.add_argument("--ratios", default=None, help="P:D ratios, e.g. 1:2,1:1 (default: "
                    + ",".join(f"{p}:{d}" for p, d in RATIOS) + ")")
    ap.add_argument("--max-gpus", type=int, default=1152, help="largest cluster considered")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, default=None, help="plan JSON (default results/plan/...)")
    ap.add_argument("--png", type=Path, default=None, help="frontier plot (default beside the JSON)")
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    add_trace_args(ap)
    return ap


def parse_ratios(text: str | None, quick: bool) -> tuple[tuple[int, int], ...]:
    if text is None:
        return QUICK_RATIOS if quick else RATIOS
    out = []
    for part in text.split(","):
        p, _, d = part.partition(":")
        if not (p.strip().isdigit() and d.strip().isdigit()) or int(p) < 1 or int(d) < 1:
            raise InvalidArgument(f"bad P:D ratio {part!r} (want e.g. 1:2)")
        out.append((int(p), int(d)))
    return tuple(out)


def build(args: argparse.Namespace):
    """(config, workload, SLO, ratios) from the arguments; InvalidArgument/ConfigError on bad input."""
    from .recorded import shared_agentic_dir
    cfg = load(args.config)
    if args.preset:
        cfg = replace(cfg, model={"preset": args.preset})
    if args.arrivals == "trace":
        if args.table2:
            raise InvalidArgument("--arrivals trace needs a trace (--trace), not --table2")
        args.online = True
    elif args.online and not args.aps:
        raise InvalidArgument("--online needs --aps")
    if not args.online and args.jct is None:
        raise InvalidArgument("offline planning needs --jct SECONDS (or --online --aps X)")
    slo = SLO(online=args.online, percentile=args.percentile, ttft_s=args.ttft, tpot_s=args.tpot,
              jct_s=args.jct if args.jct is not None else float("inf"))
    aps = args.aps if args.online else None
    if args.table2:
        wl = PlanWorkload(dataset=args.dataset, agents=args.agents, turns_scale=args.turns_scale, aps=aps)
    else:
        if args.trace is None:
            args.trace = str(shared_agentic_dir())
        wl = PlanWorkload(trace=load_trace(args, cfg), repeat=args.repeat, aps=aps, think_scale=args.think_scale,
                          policy=args.context_policy, max_context=args.max_context,
                          arrivals=args.arrivals, speed=args.speed)
    return cfg, wl, slo, parse_ratios(args.ratios, args.quick)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg, wl, slo, ratios = build(args)
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        print(f"plan: {wl.describe()}; SLO {slo.describe()}; {cfg.model.preset} on "
              f"{cfg.hardware.gpus_per_node} GPUs/node, SNIC {cfg.hardware.snic_bytes_per_s / 1e9:g} GB/s",
              flush=True)
        with _progress(not args.no_progress) as step:
            result = plan(cfg, wl, slo, modes=modes, ratios=ratios, max_gpus=args.max_gpus, on_step=step)
    except (InvalidArgument, ConfigError, ValueError) as e:
        return input_error("plan", e)
    render(result)
    out = args.out or Path("results/plan") / f"{Path(args.config).stem}-{'online' if slo.online else 'offline'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"plan written to {out}")
    if not args.no_png:
        print(plot_frontier(result, args.png or out.with_suffix(".png")))
    return 0 if result["modes"].get("dualpath", next(iter(result["modes"].values())))["met"] else 1


class _progress:
    """A rich progress bar over the simulations (stderr; silent when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = None
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True))
            self.bar.start()
        return self.step

    def step(self, mode: str, done: int, total: int) -> None:
        if self.bar is None:
            print(f"  {mode}: {done}/{total} shapes simulated", file=sys.stderr, flush=True)
            return
        if mode not in self.tasks:
            self.tasks[mode] = self.bar.add_task(f"plan {mode}", total=total)
        self.bar.update(self.tasks[mode], completed=done)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _attained(row: dict, slo: dict) -> str:
    a = row["attained"]
    if slo["online"]:
        return f"TTFT {a['ttft_s']:.2f} s, TPOT {a['tpot_s'] * 1e3:.1f} ms"
    return f"JCT {a['jct_s']:.0f} s"


def render(p: dict, file=None) -> None:
    f = file or sys.stdout
    print(f"\nSLO: {p['slo']['text']}   workload: {p['workload']}", file=f)
    print(f"{'mode':9s} {'shape':>8s} {'GPUs':>5s} {'SLO':>7s} {'attained':>28s} "
          f"{'binding resource (mean TTFT part)':>44s} {'eq. (9)':>8s} {'tried':>5s}", file=f)
    for mode, m in p["modes"].items():
        c = m["chosen"]
        b = c["binding"]
        bind = f"{b['resource']} ({b['ttft_part_s']:.2f} s)"
        print(f"{mode:9s} {c['shape']:>8s} {c['gpus']:5d} {'met' if m['met'] else 'MISSED':>7s} "
              f"{_attained(c, p['slo']):>28s} {bind:>44s} "
              f"{'inside' if m['eq9']['inside'] else 'outside':>8s} {len(m['evaluated']):5d}", file=f)
        if not m["met"]:
            print(f"  {mode}: no shape up to {max(x['gpus'] for x in m['evaluated'])} GPUs meets the SLO; "
                  f"closest is {c['shape']} (worst metric at {c['worst_ratio']:.2f}x its target)", file=f)
        print(f"  storage read links p95 {b['snic_read_p95_util']:.0%} busy, PE compute "
              f"{b['pe_compute_util']:.0%}; eq. (9) at {c['shape']}: {m['eq9']['summary']}", file=f)
    step = p["grid"]["step_at_dualpath"]
    res = f" (grid: next shape +{step['relative']:.0%} GPUs)" if step else ""
    for s in (p["saving"], p["saving_vs_basic"]):
        if s["ratio"] is not None:
            print(f"GPU saving ({s['baseline_mode']} ÷ dualpath): {'≥ ' if s['lower_bound'] else ''}"
                  f"{s['ratio']:.2f}x{res}", file=f)
    print(f"planner wall time {p['wall_s']:.1f} s", file=f)


def plot_frontier(p: dict, path: Path) -> str:
    """GPUs vs attained (worst metric ÷ target) per mode, best shape per GPU count; SLO at 1."""
    from .plots import _pyplot
    plt = _pyplot()
    if plt is None:
        return "matplotlib not installed: frontier plot skipped"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, m in p["modes"].items():
        best: dict[int, float] = {}
        for r in m["evaluated"]:
            best[r["gpus"]] = min(best.get(r["gpus"], float("inf")), r["worst_ratio"])
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], marker="o", label=mode)
        c = m["chosen"]
        ax.annotate(c["shape"], (c["gpus"], c["worst_ratio"]), textcoords="offset points", xytext=(4, 6))
    ax.axhline(1.0, color="grey", ls="--", label="SLO")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("attained ÷ SLO target (worst metric)")
    ax.set_title(f"Planner frontier — {p['slo']['text']}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"frontier plot written to {path}"


if __name__ == "__main__":
    sys.exit(main())
