"""``dualpath demo`` (``make demo``): the local 1P2D cluster, basic vs DualPath, in minutes.

Starts the storage-bound 1P2D emulation on the embedded defaults (the same cluster as
``configs/local-1p2d.toml``: directory storage under ``data/``, loopback, no GPU) as
subprocesses, replays a small agentic workload (paper Table 2 shape, 1/8 scale) once with
``basic`` (PE-side reads, whole-prompt prefill) and once with ``dualpath``, each on fresh
storage, prints the speedup table and where the plots are, and stops every service. Installs
nothing (``make demo`` installed the venv). Takes well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

MODES = ("basic", "dualpath")


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", choices=["emulator", "vllm"], default="emulator")
    engine, rest = pre.parse_known_args(argv)
    if engine.engine == "vllm":               # real vLLM behind the front (tools/demo_vllm.py)
        from tools.demo_vllm import main as vllm_main
        return vllm_main(rest)
    p = argparse.ArgumentParser(prog="dualpath demo", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["emulator", "vllm"], default="emulator",
                   help="vllm: real vLLM prefill/decode instances and the OpenAI front "
                        "(`dualpath demo --engine vllm --help`)")
    p.add_argument("-c", "--config", default=None, help="cluster TOML (default: embedded 1P2D)")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--out", default="results/demo", help="results and plots go here")
    a = p.parse_args(argv)
    from common.errors import DualpathError
    from common.logging import configure_logging
    from tools.cluster.config import load_cluster
    from tools.replay.cli import write_outputs
    from tools.replay.results import summary_rows
    from tools.replay.run import replay_fresh
    from tools.replay.workloads import AgenticSpec
    from tools.tables import print_table

    configure_logging("warning", None)
    t0 = time.monotonic()
    try:
        cluster = load_cluster(a.config)
    except DualpathError as e:
        print(f"dualpath demo: {e.message}", file=sys.stderr)
        return 2
    cluster = cluster.with_overrides(cluster={"name": f"{cluster.spec.name}-demo"})
    spec = AgenticSpec("32k", a.agents, seed=1, scale=0.125, max_turns=a.turns)
    c = cluster.spec
    print(f"dualpath demo: {c.shape} cluster on loopback ({sum(c.engines(n) for n in c.nodes)} "
          f"emulated engines, storage links {c.storage_link_bytes_per_s / 1e6:.0f} MB/s per node),"
          f" {a.agents} agents x {a.turns} turns of the 32K dataset at 1/8 scale")
    results = {}
    try:
        for mode in MODES:
            print(f"\n== {mode}: starting the cluster, replaying, stopping")
            results[mode] = asyncio.run(replay_fresh(
                cluster, spec, mode=mode, storage_root=str(Path("data/demo") / mode),
                echo=print, progress=None, remove_storage=True))
            print("\n".join(summary_rows(mode, results[mode]["summary"])))
    except DualpathError as e:
        print(f"dualpath demo: {e.message}\n{getattr(e, 'log_tail', '')}", file=sys.stderr)
        return 1
    base = results["basic"]["summary"]["jct_s"]
    rows = [{"mode": m, "jct_s": r["summary"]["jct_s"], "speedup": base / r["summary"]["jct_s"],
             "snic_max_avg": r["summary"].get("links", {}).get("snic_max_avg"),
             "read_MB_pe_path": r["summary"]["bytes"]["storage_read_pe_path"] / 1e6,
             "read_MB_de_path": r["summary"]["bytes"]["storage_read_de_path"] / 1e6,
             "all_checks": all(v for k, v in r["summary"]["checks"].items()
                               if isinstance(v, bool))}
            for m, r in results.items()]
    print()
    print_table(rows, ["mode", "jct_s", "speedup", "snic_max_avg", "read_MB_pe_path",
                       "read_MB_de_path", "all_checks"])
    paths = write_outputs(results, Path(a.out))
    print(f"\nDualPath speedup over basic: {rows[-1]['speedup']:.2f}x "
          f"(paper: up to 1.87x offline)")
    print(f"results and plots: {', '.join(str(x) for x in paths)}")
    print(f"every service stopped; demo took {time.monotonic() - t0:.0f} s")
    return 0 if all(r["all_checks"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
