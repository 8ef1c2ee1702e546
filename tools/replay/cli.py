"""``dualpath replay``: replay a workload against a cluster, write results JSON + plots.

    dualpath cluster up -c configs/local-1p2d.toml
    dualpath replay -c configs/local-1p2d.toml --agents 16 --max-turns 6     # offline → JCT
    dualpath replay -c configs/local-1p2d.toml --online --aps 4 --agents 32  # TTFT/TPOT, SLO
    dualpath replay -c configs/local-1p2d.toml --trace ../shared/traces/conversation_trace.jsonl
    dualpath replay -c configs/local-1p2d.toml --start --trace ../shared/traces/agentic \
                    --conversations 2 --max-turns 6 --check                # recorded sessions
    dualpath replay -c configs/local-1p2d.toml --start --trace table2:32k --agents 4 --check
    dualpath replay -c configs/local-1p2d.toml --start --mode basic          # own cluster

Target: the cluster ``dualpath cluster up -c CONFIG`` started (its state file), ``--start``
(start it for this run, stop it after; ``--mode`` picks the ablation mode), ``--inprocess`` (the
same services in this process), or ``--scheduler HOST:PORT`` (any scheduler; no telemetry).
Output: ``results.json`` (workload, summary, per-request records, telemetry samples), PNGs
and a summary on stdout, in ``--out`` (default ``results/replay-<cluster>-<mode>``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from common.errors import DualpathError
from common.logging import configure_logging

DEFAULT_TRACE = "../shared/traces/conversation_trace.jsonl"


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("agentic workload (paper Table 2)")
    w.add_argument("--dataset", default="32k", choices=("32k", "48k", "64k"))
    w.add_argument("--agents", type=int, default=8)
    w.add_argument("--max-turns", type=int, default=6, help="real turns per agent at most "
                                                            "(0: the dataset's full length)")
    w.add_argument("--scale", type=float, default=0.125, help="× every token count")
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--append-scale", type=float, default=1.0)
    w.add_argument("--gen-scale", type=float, default=1.0)
    t = p.add_argument_group("Mooncake trace")
    t.add_argument("--trace", nargs="?", const=DEFAULT_TRACE, default=None,
                   help=f"replay a Mooncake JSONL trace (default file: {DEFAULT_TRACE})")
    t.add_argument("--limit", type=int, default=200, help="first N requests of the trace")
    t.add_argument("--speed", type=float, default=10.0, help="trace seconds per replay second")
    t.add_argument("--trace-scale", type=float, default=0.125,
                   help="× every token count (a 512-token Mooncake block becomes 512·scale tokens)")
    s = p.add_argument_group("recorded sessions (--trace DIR or FILE.json, docs/workloads.md)")
    s.add_argument("--format", default=None, choices=("agentic", "mooncake"), help="default: detected")
    s.add_argument("--conversations", type=int, default=4, help="first N sessions (0: all)")
    s.add_argument("--repeat", type=int, default=1, help="copies of every session, own key spaces")
    s.add_argument("--think-scale", type=float, default=0.0, help="× every think time")
    s.add_argument("--max-prompt", type=int, default=65_536,
                   help="scaled prompt + generation above it: the turn is dropped (counted)")
    s.add_argument("--arrivals", default="poisson", choices=("poisson", "trace"),
                   help="sessions at Poisson times (--online --aps) or at the trace's own start "
                        "and turn times ÷ --speed")


def workload_from_args(a: argparse.Namespace):
    from .workloads import AgenticSpec, TraceSpec
    if a.trace:
        from pathlib import Path

        from sim.recorded import detect_format

        from .sessions import SessionTraceSpec
        table2 = a.trace.lower().startswith("table2:")      # the generator as sessions
        fmt = "table2" if table2 else a.format or detect_format(Path(a.trace))
        if fmt in ("agentic", "table2"):
            return SessionTraceSpec(a.trace, fmt, a.conversations or None, a.max_turns or None,
                                    a.repeat, a.trace_scale, a.think_scale, a.max_prompt, a.seed,
                                    a.agents if table2 else None, a.arrivals, a.speed)
        return TraceSpec(a.trace, a.limit, speed=a.speed, scale=a.trace_scale)
    return AgenticSpec(a.dataset, a.agents, a.seed, a.scale, a.max_turns or None,
                       a.append_scale, a.gen_scale)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath replay", description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default=None, help="cluster TOML (default: embedded 1P2D)")
    p.add_argument("--mode", default=None, help="ablation mode for --start / --inprocess")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--start", action="store_true", help="start the cluster for this run")
    where.add_argument("--inprocess", action="store_true", help="run the cluster in-process")
    where.add_argument("--scheduler", default=None, help="HOST:PORT of a running scheduler")
    where.add_argument("--static", action="store_true",
                       help="the cluster runs elsewhere (bare metal, compose): every endpoint "
                            "from the config's hosts and fixed ports")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless every check passed (finished, hits, bytes, verified)")
    p.add_argument("--online", action="store_true", help="Poisson agent arrivals (needs --aps)")
    p.add_argument("--aps", type=float, default=None, help="agents arriving per second")
    p.add_argument("--duration", type=float, default=None,
                   help="online: no new agents after this many seconds (then drain)")
    p.add_argument("--deadline", type=float, default=300.0, help="per-request deadline (s)")
    p.add_argument("--out", default=None, help="output directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    add_workload_args(p)
    return p


async def _run(a: argparse.Namespace) -> dict:
    from tools.cluster.config import load_cluster
    from tools.cluster.launcher import load_state_or_none

    from .run import ClusterTarget, replay, replay_fresh
    cluster = load_cluster(a.config, mode=a.mode)
    workload = workload_from_args(a)
    kw = dict(aps=a.aps if a.online else None, deadline_s=a.deadline,
              progress=False if a.no_progress else None, stop_after_s=a.duration)
    if a.start or a.inprocess:
        root = tempfile.mkdtemp(prefix=f"replay-{cluster.spec.name}-", dir=_data_dir())
        return await replay_fresh(cluster, workload, mode=a.mode, storage_root=root,
                                  inprocess=a.inprocess, echo=print, remove_storage=True, **kw)
    if a.scheduler:
        host, _, port = a.scheduler.rpartition(":")
        target = ClusterTarget((host or "127.0.0.1", int(port)), slo_scale=cluster.spec.slo,
                               rpc=cluster.cfg.rpc, name=cluster.spec.name)
        return await replay(target, workload, **kw)
    if a.static:
        target = ClusterTarget.static(cluster)
        target.mode = cluster.mode or cluster.cfg.scheduler.policy
        return await replay(target, workload, **kw)
    state = load_state_or_none(cluster)
    if state is None:
        raise DualpathError(f"cluster {cluster.spec.name!r} is not running: start it with "
                            f"`dualpath cluster up{_cfg_flag(a)}`, or pass --start")
    target = ClusterTarget.from_state(cluster, state)
    target.mode = state.mode or cluster.cfg.scheduler.policy
    return await replay(target, workload, **kw)


def _cfg_flag(a: argparse.Namespace) -> str:
    return f" -c {a.config}" if a.config else ""


def _data_dir() -> str:
    d = Path("data/replay")
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def write_outputs(results: dict[str, dict], out: Path, plots: bool = True) -> list[Path]:
    """``results.json`` (one run) or ``<mode>.json`` per run, plus the PNGs."""
    from .results import to_json
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for mode, r in results.items():
        path = out / (f"{mode.replace('+', 'plus-')}.json" if len(results) > 1 else "results.json")
        path.write_bytes(to_json(r))
        paths.append(path)
    if plots:
        from .plots import plot_all
        paths += plot_all(results, out)
    return paths


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.online and not a.aps:
        print("dualpath replay: --online needs --aps X", file=sys.stderr)
        return 2
    configure_logging("warning", None)
    try:
        res = asyncio.run(_run(a))
    except DualpathError as e:
        print(f"dualpath replay: {e.message}", file=sys.stderr)
        return 1
    from .results import summary_rows
    mode = res.get("mode") or "as-configured"
    out = Path(a.out or f"results/replay-{res['cluster']}-{mode.replace('+', 'plus-')}")
    paths = write_outputs({mode: res}, out, plots=not a.no_plots)
    print("\n".join(summary_rows(f"{res['cluster']} [{mode}]", res["summary"])))
    print("wrote " + ", ".join(str(p) for p in paths))
    checks = res["summary"]["checks"]
    if a.check:
        failed = [k for k in ("all_finished", "storage_read_matches_hits", "every_prompt_verified")
                  if not checks.get(k)] + (["hit_mismatches"] if checks["hit_mismatches"] else [])
        if checks.get("pe_to_de_matches_new_tokens") is False:   # None: a retry's partial sends
            failed.append("pe_to_de_matches_new_tokens")
        if failed:
            print(f"dualpath replay: checks failed: {', '.join(failed)}", file=sys.stderr)
            return 1
        pe_de = ("PE->DE bytes as the read sides predict"
                 if checks.get("pe_to_de_matches_new_tokens") else
                 "PE->DE bytes check SKIPPED (an attempt failed: a retry's partial sends "
                 "make the bytes unpredictable)")
        print("checks passed: every request finished, hits as predicted, storage bytes = hits, "
              f"every prompt verified byte for byte; {pe_de}")
    return 0 if checks["all_finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
