"""``dualpath bench multihost``: the ablation on namespace hosts (issue #17), real services.

The 1P2D cluster of ``configs/local-1p2d.toml`` (storage links shaped as there) on namespace
hosts (``tools.hosts``: etcd + scheduler on ``ctl``, ``p0``, ``d0``, ``d1``, the replay on
``cli``), every service started from its deploy/systemd unit, UCX between hosts over TCP. For
``basic`` and then ``dualpath``: a fresh store and fresh services in that mode, the same
agentic workload replayed with ``--check``. Then, on the same hosts in the same run, DE→PE
bandwidth: the page path (``PageTransport``) vs raw ucxx tag messages between ``d0`` (sender)
and ``p0`` (receiver) — ``bench.transport_bench``'s phases with its sender started on ``d0``.

Headline ``multihost_dualpath_speedup`` = JCT(basic) ÷ JCT(dualpath), goal ≥ 1.8, and only
counted when every check of both runs passed (else 0). ``oracle`` (the paper's bound: hits
resident, docs/datapath.md "Oracle") runs third; ``oracle_at_least_dualpath`` compares them.
Also reported: ``de_to_pe_vs_raw`` (page path ÷ raw ucxx GB/s at 1 MiB pages, 8 in flight;
goal ≥ 0.85), the UCX lane check of every node service (no shared memory or single copy across
hosts) and, per mode, CPU seconds per host during the replay and the stages' p50s (the profile
behind docs/deploy.md's multihost numbers).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import Any

from bench.report import bench_parser, headline, print_table, write_results

GOAL, PATH_GOAL = 1.8, 0.85
MODES = ("basic", "dualpath", "oracle")


def workload_args(quick: bool) -> list[str]:
    agents, turns = (16, 10) if quick else (24, 12)     # bench e2e's workload
    return ["--agents", str(agents), "--max-turns", str(turns), "--scale", "0.125",
            "--seed", "1"]


def run_mode(net: Any, mode: str, quick: bool) -> dict[str, Any]:
    """Fresh services in ``mode`` on an empty store; the replay's summary."""
    from tools.cluster.config import apply_mode
    from tools.hosts import cluster as hc
    from tools.hosts.netns import stop_process
    for host in net.hosts.values():
        for proc in host.procs:
            if "etcd" not in str(proc.args):
                stop_process(proc)
    shutil.rmtree(net.store / "dualpath", ignore_errors=True)
    hc.write_host_files(net, apply_mode(hc.cluster_data(net), mode))
    hc.start_cluster(net, etcd=False)
    out = net.hosts["cli"].root / "var" / f"bench-{mode}"
    cpu0, kids0, start = host_cpu_s(net), _children_cpu_s(), time.perf_counter()
    r = hc.replay(net, *workload_args(quick), "--check", "--out", str(out), timeout=600)
    wall = time.perf_counter() - start
    cpu = {h: round(v - cpu0.get(h, 0.0), 2) for h, v in host_cpu_s(net).items()}
    cpu["cli"] = round(_children_cpu_s() - kids0, 2)        # the replay driver (net.run)
    res = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() \
        else {}
    s = res.get("summary", {})
    c = s.get("checks", {})
    return {"mode": mode, "rc": r.returncode, "jct_s": s.get("jct_s"), "wall_s": wall,
            "read_sides": s.get("read_sides"), "snic_max_avg": s.get("links", {}).get(
                "snic_max_avg"), "checks_passed": r.returncode == 0,
            "all_finished": c.get("all_finished"), "hit_mismatches": c.get("hit_mismatches"),
            "every_prompt_verified": c.get("every_prompt_verified"),
            "pe_to_de_matches_new_tokens": c.get("pe_to_de_matches_new_tokens"),
            # where the time went (p50 s per stage) and the bytes per path (MB): the profile
            # docs/deploy.md's multihost numbers are read from
            "stage_p50_s": {k: v.get("p50") for k, v in s.get("latency", {}).items()},
            # CPU seconds per host during the replay (etcd excluded): vs wall x cores, how
            # CPU-bound the run was and who spent it
            "cpu_s": cpu, "cpu_s_total": round(sum(cpu.values()), 2),
            "bytes_MB": {k: round(v / 1e6, 1) for k, v in s.get("bytes", {}).items()},
            "tail": (r.stdout + r.stderr)[-1500:] if r.returncode else ""}


def host_cpu_s(net: Any) -> dict[str, float]:
    """user+sys seconds so far of every live service process (and its descendants) per host,
    from ``/proc`` (etcd left out: it only serves discovery)."""
    import os
    tick = os.sysconf("SC_CLK_TCK")
    stat: dict[int, tuple[int, float]] = {}           # pid -> (ppid, cpu s)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stat[int(d)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stat.items():
        kids.setdefault(ppid, []).append(pid)

    def tree(pid: int) -> float:
        return stat.get(pid, (0, 0.0))[1] + sum(tree(k) for k in kids.get(pid, []))
    return {name: sum(tree(p.pid) for p in host.procs
                      if p.poll() is None and "etcd" not in str(p.args))
            for name, host in net.hosts.items()}


def _children_cpu_s() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def lane_check(net: Any) -> dict[str, list[str]]:
    from tools.hosts import cluster as hc
    from tools.hosts import ucx_lanes
    return {nid: ucx_lanes.cross_host_violations(
        ucx_lanes.parse(net.log_text(nid, f"dualpath-node@{nid}"))) for nid in hc.NODES}


def de_to_pe(net: Any, quick: bool) -> dict[str, Any]:
    """Page path vs raw ucxx, sender on d0, receiver on p0 (this bench re-run there)."""
    from tools.hosts import cluster as hc
    env = hc.unit_env(net, "p0")
    env.pop("UCX_LOG_LEVEL", None)
    env.update(UCX_TLS="tcp,self", UCX_NET_DEVICES="eth0",
               DUALPATH_BENCH_TRANSPORT_HOST=net.hosts["p0"].address)
    prefix = [*net.hosts["d0"].enter_argv(), "--", "env",
              f"DUALPATH_BENCH_TRANSPORT_HOST={net.hosts['d0'].address}"]
    argv = [sys.executable, "-m", "bench.multihost_bench", "--pair-receiver",
            json.dumps(prefix)] + (["--quick"] if quick else [])
    r = net.run("p0", argv, env=env, timeout=300, cwd=str(hc.REPO))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{\"pair\"")]
    if r.returncode != 0 or not lines:
        return {"error": (r.stdout + r.stderr)[-2000:]}
    return json.loads(lines[-1])["pair"]


def pair_receiver(prefix: list[str], quick: bool) -> int:
    """In ``p0``: transport_bench's receiver; its sender started through ``prefix`` (d0)."""
    from functools import partial

    from bench import transport_bench as tb
    from common.logging import configure_logging
    from common.service import run

    async def measure() -> dict[str, Any]:
        async with tb.Bench(quick, child_prefix=prefix) as b:
            count, transfers = tb.per_size_plan(tb.MIB, 8, quick)
            slots = tb.layout("gapped", tb.MIB, count)
            raw, page = await b.best(
                partial(b.raw, "direct", slots, 8, count * transfers),
                partial(b.page, "direct", "gapped", tb.MIB, count, 8, transfers))
            return {"page_bytes": tb.MIB, "inflight": 8, **tb.compare(raw, page)}

    configure_logging("warning", json=False)
    print(json.dumps({"pair": run(measure())}), flush=True)
    return 0


def bench(quick: bool, modes: tuple[str, ...] = MODES
          ) -> tuple[list[dict], dict[str, Any], dict[str, Any]]:
    from tools.hosts import cluster as hc
    from tools.hosts.netns import HostNet
    with HostNet(hc.HOST_NAMES) as net:
        hc.write_host_files(net, hc.cluster_data(net))
        hc.start_etcd(net)
        rows, lanes = [], {}
        for mode in modes:
            rows.append(run_mode(net, mode, quick))
            print_table([rows[-1]], COLUMNS)
            lanes[mode] = lane_check(net)
        pair = de_to_pe(net, quick)
    return rows, lanes, pair


COLUMNS = ["mode", "jct_s", "wall_s", "snic_max_avg", "cpu_s_total", "read_sides",
           "checks_passed"]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("multihost", __doc__.splitlines()[0])
    parser.add_argument("--pair-receiver", default=None, help=_hidden())
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes (basic and dualpath give the headline)")
    args = parser.parse_args(argv)
    if args.pair_receiver is not None:
        return pair_receiver(json.loads(args.pair_receiver), args.quick)
    from tools.hosts.netns import namespaces_available
    ok, why = namespaces_available()
    if not ok:
        print(f"dualpath bench multihost: cannot make namespace hosts: {why}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows, lanes, pair = bench(args.quick, tuple(m for m in args.modes.split(",") if m))
    by = {r["mode"]: r for r in rows}
    lanes_ok = all(not v for m in lanes.values() for v in m.values())
    all_ok = all(by[m]["checks_passed"] for m in ("basic", "dualpath") if m in by) and lanes_ok
    b, d = (by.get(m, {}).get("jct_s") for m in ("basic", "dualpath"))
    o = by.get("oracle", {}).get("jct_s")
    oracle = {"oracle_checks_passed": by.get("oracle", {}).get("checks_passed"),
              "oracle_at_least_dualpath": (o <= d * 1.02) if o and d else None}
    speedup = (b / d) if (b and d and all_ok) else 0.0
    ratio = pair.get("ratio")
    print(f"\nbasic JCT {b} s, dualpath JCT {d} s: speedup {speedup:.3g} "
          f"(every check {'passed' if all_ok else 'NOT passed'}); DE→PE d0→p0: page "
          f"{pair.get('page_gbps')} GB/s vs raw ucxx {pair.get('raw_gbps')} GB/s = {ratio} "
          f"(goal ≥ {PATH_GOAL}); oracle JCT {o} s; {time.perf_counter() - start:.0f} s")
    write_results(args.out, "multihost",
                  headline("multihost_dualpath_speedup", speedup, GOAL, higher_is_better=True),
                  {"modes": rows, "lanes": lanes, "checks_passed": all_ok, **oracle,
                   "de_to_pe": pair, "de_to_pe_vs_raw": ratio,
                   "de_to_pe_goal": PATH_GOAL, "quick": args.quick,
                   "wall_s": time.perf_counter() - start})
    return 0


def _hidden() -> str:
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
