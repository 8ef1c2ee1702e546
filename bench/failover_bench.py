"""``dualpath bench failover [--quick] [--out FILE]``: kill the scheduler leader mid-replay.

Local 1P2D (subprocesses on loopback, byte-verified agentic replays) with two scheduler
replicas elected through a 3-member etcd that the benchmark starts (Debian ``etcd-server``,
``make etcd``; ``tools.cluster.failover``). The same workload shape runs twice in one run:
once without faults (the baseline) and once with the leader SIGKILLed three times
(``--quick``: a shorter replay, one kill), then the chaos case "leader kill during a burst"
(twice the agents submit their first turns at once; the leader is killed 0.3 s into it).
Frontends and nodes find the leader in etcd; a
killed leader's standby takes over when the leader's etcd lease (``etcd.lease_s`` = 2 s)
runs out, the frontends resubmit their open requests, the nodes re-register.

``--tls``: the same with mutual TLS on every RPC hop (``[rpc] tls_*``: a CA and one
certificate for 127.0.0.1 made at start with trustme; every process presents it as server
and client) — the issue's "unchanged under TLS"; compare its failover p99 with a plain run.

Headline: ``requests_lost`` (goal 0) — planned requests that did not finish with verified
bytes. Also: failover time p50/p99 over the kills (kill → every node re-registered with the new
leader and it sent its first plan; goal p99 ≤ 3 s with the default 2 s lease), election time
(kill → standby elected) and first-completion time (kill → the new leader finished a request),
duplicated completions (a second final event for one request at a client; goal 0), leaked
pages (goal 0), and the JCT with kills against the baseline's (ratio, same run).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.report import bench_parser, headline, print_table, write_results


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _row(r) -> dict:
    return {"replay": r.label, "planned": r.planned, "finished": r.finished, "lost": r.lost,
            "kills": len(r.kills), "resubmits": r.resubmits, "dup_finals": r.duplicate_finals,
            "jct_mean_s": round(float(np.mean(r.jct_s)), 3) if r.jct_s else None,
            "jct_p99_s": round(_pct(r.jct_s, 99), 3) if r.jct_s else None,
            "wall_s": round(r.wall_s, 1)}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("failover", __doc__.splitlines()[0])
    p.add_argument("-c", "--config", default=None, help="cluster TOML (default: embedded 1P2D)")
    p.add_argument("--tls", action="store_true",
                   help="mutual TLS on every RPC hop (a CA and certificate made at start)")
    args = p.parse_args(argv)
    from common.logging import configure_logging
    from tools.cluster.etcd_members import etcd_missing
    from tools.cluster.failover import FailoverHarness, mutual_tls_settings
    configure_logging("error", None)
    missing = etcd_missing()
    if missing:
        print(f"dualpath bench failover: {missing}")
        return 2
    agents, turns, kills = (12, 8, 1) if args.quick else (32, 16, 3)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        rpc = mutual_tls_settings(Path(stack.enter_context(tempfile.TemporaryDirectory()))) \
            if args.tls else None
        h = stack.enter_context(FailoverHarness(args.config, echo=print, rpc=rpc))
        print(f"failover: {h.cluster.spec.shape} cluster + 3-member etcd + standby scheduler "
              f"up in {time.monotonic() - t0:.1f} s; {agents} agents × ≤{turns} turns"
              + ("; mutual TLS on every RPC hop" if args.tls else ""))
        base = asyncio.run(h.replay("baseline", agents, turns, kills=0))
        print(f"  baseline: {base.finished}/{base.planned} finished in {base.wall_s:.1f} s")
        hit = asyncio.run(h.replay("leader-kills", agents, turns, kills=kills))
        print(f"  with {len(hit.kills)} kills: {hit.finished}/{hit.planned} finished in "
              f"{hit.wall_s:.1f} s")
        burst = asyncio.run(h.burst_kill(agents * 2, turns=2))
        print(f"  leader kill during a burst of {agents * 2} first turns: "
              f"{burst.finished}/{burst.planned} finished")
        member = None
        if not args.quick:              # a 3-member etcd loses one member: nothing happens
            member = asyncio.run(h.replay("etcd-member-kill", agents // 2, turns // 2,
                                          kills=0, etcd_member_kill=True))
            print(f"  etcd member kill: {member.finished}/{member.planned} finished")
        quiet_s = asyncio.run(h._quiet(None))    # abandoned attempts' pages: freed by leases
        leaks, mismatches, _ = asyncio.run(h._leaks())
    failover = [k.failover_s for k in hit.kills if k.failover_s is not None]
    election = [k.election_s for k in hit.kills if k.election_s is not None]
    first = [k.first_finish_s for k in hit.kills if k.first_finish_s is not None]
    leaked = sum(v or 0 for v in leaks.values())
    jct_ratio = (float(np.mean(hit.jct_s)) / float(np.mean(base.jct_s))
                 if hit.jct_s and base.jct_s else None)
    print()
    rows = [_row(base), _row(hit), _row(burst)] + ([_row(member)] if member else [])
    print_table(rows, ["replay", "planned", "finished", "lost", "kills",
                                         "resubmits", "dup_finals", "jct_mean_s", "jct_p99_s",
                                         "wall_s"])
    summary = {
        "requests_lost": hit.lost, "baseline_lost": base.lost,
        "requests_planned": hit.planned, "kills": len(hit.kills),
        "failovers_completed": len(failover),
        "failover_s": {"p50": _pct(failover, 50), "p99": _pct(failover, 99),
                       "max": max(failover) if failover else None},
        "election_s": {"p50": _pct(election, 50), "p99": _pct(election, 99)},
        "first_finish_s": {"p50": _pct(first, 50), "p99": _pct(first, 99)},
        "duplicated_completions": hit.duplicate_finals + base.duplicate_finals,
        "leaked_pages": leaked, "quiet_s": quiet_s,
        "unreachable": [n for n, v in leaks.items() if v is None],
        "prompt_mismatches": mismatches,
        "jct_ratio_kills_vs_baseline": jct_ratio,
        "resubmits": hit.resubmits, "wall_s": time.monotonic() - t0,
        "burst_kill": {"lost": burst.lost, "planned": burst.planned,
                       "in_flight_at_kill": burst.kills[0].in_flight if burst.kills else None,
                       "failover_s": burst.kills[0].failover_s if burst.kills else None,
                       "duplicated_completions": burst.duplicate_finals},
        "etcd_member_kill": None if member is None else {
            "lost": member.lost, "planned": member.planned,
            "leader_epoch_kept": bool(member.kills) and
            member.kills[0].old_epoch == member.kills[0].new_epoch},
    }
    print(f"\nlost {hit.lost} of {hit.planned}; failover p50 {summary['failover_s']['p50']} s, "
          f"p99 {summary['failover_s']['p99']} s (goal ≤ 3); duplicated completions "
          f"{summary['duplicated_completions']}; leaked pages {leaked}; JCT ratio "
          f"{jct_ratio if jct_ratio is None else round(jct_ratio, 3)}")
    write_results(args.out, "failover", headline("requests_lost", hit.lost, 0,
                                                 higher_is_better=False),
                  {"quick": args.quick, "tls": args.tls, "summary": summary, "replays": rows,
                   "kills": [vars(k) for k in hit.kills], "leaked_pages_by_service": leaks,
                   "lost_detail": hit.lost_detail, "etcd_members": 3,
                   "etcd_lease_s": h.cluster.cfg.etcd.lease_s})
    ok = (hit.lost == 0 and leaked == 0 and summary["duplicated_completions"] == 0
          and burst.lost == 0 and burst.duplicate_finals == 0
          and (member is None or member.lost == 0))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
