"""``dualpath bench chaos [--quick] [--out FILE]``: kill and pause node services mid-request.

One local 1P2D cluster (subprocesses on loopback, directory storage in a temp dir, leases of
2 s: ``tools.cluster.chaos.CHAOS_SETTINGS``) runs agentic replays with byte-verified KV
while, one at a time, a service is SIGKILLed or SIGSTOPped at a named failpoint
(``common.faults``) — during a DE-path read, DE→PE forwarding, the PE→DE hand-off,
write-back, decode and the gateway's read path — or from outside at a chosen moment. After
each fault the victim is restarted (or SIGCONTed past its lease) and must rejoin with a new
epoch and carry a transfer again.

Headline: ``requests_lost`` summed over every fault (goal 0): a submission that neither
finished with verified bytes nor failed with a retryable error within its deadline. The JSON
also lists every fault (target, point, action, requests affected, outcome), leaked pages per
surviving service and the recovery times (restart → first transfer through the victim).
``--quick``: 7 faults — both read paths (PE-path and DE-path reads, the gateway's read), the
PE→DE hand-off, write-back, decode, and a pause past the lease;
the full run every failpoint, two repetitions at different hits, and outside signals.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from bench.report import bench_parser, headline, print_table, write_results


def faults(quick: bool) -> list:
    from tools.cluster.chaos import Fault as F
    # The dpl policy alternates the read side per DE node, so both d0 and d1 serve DE-path
    # reads (their gateways too); the DE-path points aim at d1.
    core = [
        F("de-read-kill", "de_loader:d1", "kill", "de.read.batch"),
        F("pe-handoff-kill", "pe_receiver:p0", "kill", "pe.handoff.send", at=3),
        F("gw-read-kill", "gateway:d1", "kill", "gw.read"),
        F("de-stop-past-lease", "de_loader:d0", "stop", None, after_s=0.5),
        F("pe-read-kill", "pe_receiver:p0", "kill", "pe.read.batch", at=2),
        F("de-writeback-kill", "de_loader:d0", "kill", "de.writeback", at=2),
        F("de-decode-kill", "de_loader:d1", "kill", "de.decode", at=2),
    ]
    if quick:
        return core
    full = core + [
        F("pe-pull-kill", "pe_receiver:p0", "kill", "pe.pull.recv"),
        F("de-pull-kill", "de_loader:d1", "kill", "de.pull.send", at=2),
        F("de-assemble-kill", "de_loader:d1", "kill", "de.assemble", at=2),
        F("gw-write-kill", "gateway:d0", "kill", "gw.write", at=2),
        F("gw-p0-read-kill", "gateway:p0", "kill", "gw.read", at=2),
        F("de-read-stop", "de_loader:d1", "stop", "de.read.batch"),
        F("pe-stop-past-lease", "pe_receiver:p0", "stop", None, after_s=0.5),
        F("gw-stop", "gateway:d0", "stop", None, after_s=0.5),
        F("de-sigkill-outside", "de_loader:d1", "kill", None, after_s=0.7),
        F("pe-sigkill-outside", "pe_receiver:p0", "kill", None, after_s=0.7),
    ]
    # a second repetition of the kills at a later hit: a different request, a later step
    again = [F(f"{f.case}-rep2", f.target, f.action, f.point, at=f.at + 3)
             for f in full if f.point is not None and f.action == "kill"][:6]
    return full + again


def engine_faults() -> list:
    """With ``--remote-engines``: the engine processes are victims too (SIGKILL from outside
    mid-request, then restarted; the node service keeps running)."""
    from tools.cluster.chaos import Fault as F
    return [F("pe-engine-sigkill", "engine_sim:p0", "kill", None, after_s=0.7),
            F("de-engine-sigkill", "engine_sim:d1", "kill", None, after_s=0.7)]


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("chaos", __doc__.splitlines()[0])
    p.add_argument("-c", "--config", default=None, help="cluster TOML (default: embedded 1P2D)")
    p.add_argument("--remote-engines", action="store_true",
                   help="engines in their own processes over the nodes' engine sockets; adds "
                        "engine-process kills to the faults")
    args = p.parse_args(argv)
    from common.logging import configure_logging
    from tools.cluster.chaos import CHAOS_SETTINGS, MODE, ChaosHarness
    configure_logging("error", None)
    plan = faults(args.quick) + (engine_faults() if args.remote_engines else [])
    t0 = time.monotonic()
    results = []
    with ChaosHarness(args.config, echo=print, remote_engines=args.remote_engines) as h:
        print(f"chaos: {h.cluster.spec.shape} cluster up in {time.monotonic() - t0:.1f} s, "
              f"mode {MODE}, {len(plan)} faults")
        for f in plan:
            r = asyncio.run(h.run_case(f))
            results.append(r)
            print(f"  {f.case:<24} {'ok ' if r.ok else 'BAD'} {r.outcome}; recovery "
                  f"{r.recovery_s if r.recovery_s is None else round(r.recovery_s, 2)} s")
    rows = [{"case": r.case, "target": r.target, "point": r.point, "action": r.action,
             "fired": r.fired, "affected": r.affected, "subs": r.submissions, "lost": r.lost,
             "leaked": r.leaked_total, "rejoined": r.rejoined,
             "recovery_s": r.recovery_s, "ok": r.ok} for r in results]
    print()
    print_table(rows, ["case", "target", "point", "action", "fired", "affected", "subs", "lost",
                       "leaked", "rejoined", "recovery_s", "ok"])
    lost = sum(r.lost for r in results)
    rec = [r.recovery_s for r in results if r.recovery_s is not None]
    summary = {
        "faults": len(results), "faults_ok": sum(r.ok for r in results),
        "not_fired": [r.case for r in results if not r.fired],
        "requests_submitted": sum(r.submissions for r in results),
        "requests_lost": lost,
        "leaked_pages_total": sum(r.leaked_total for r in results),
        "recovery_s": {"median": statistics.median(rec) if rec else None,
                       "max": max(rec) if rec else None},
        "wall_s": time.monotonic() - t0,
    }
    print(f"\n{summary['faults_ok']}/{summary['faults']} faults held; "
          f"{summary['requests_submitted']} submissions, lost {lost}, leaked pages "
          f"{summary['leaked_pages_total']}, recovery median {summary['recovery_s']['median']} s,"
          f" wall {summary['wall_s']:.0f} s")
    write_results(args.out, "chaos", headline("requests_lost", lost, 0, higher_is_better=False),
                  {"quick": args.quick, "summary": summary, "mode": MODE,
                   "remote_engines": args.remote_engines,
                   "settings": CHAOS_SETTINGS,
                   "faults": [{**row, "outcome": r.outcome} for row, r in zip(rows, results)],
                   "fault_details": [r.as_dict() for r in results],
                   "leaked_pages": {r.case: r.leaked_pages for r in results},
                   "recovery_s": {r.case: r.recovery_s for r in results}})
    return 0 if summary["faults_ok"] == summary["faults"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
