"""What the host was doing when a test stalled: a CI-side sampler of CPU, I/O and memory
pressure and of the processes that used the CPU.

CI runs (ci64, ci70, ci73) saw the test etcd, gateways and a scheduler unanswered for 1-7 s
at once while three vLLM processes ran, and the logs alone could not say why (docs/
contributing.md, flake table). ``.ci/run`` starts this beside the tests; it wakes every
``interval`` seconds and keeps a tick only when the host looked stalled: the sampler itself
woke late, tasks waited on I/O or memory for a large share of the tick, or many pages were
read back from disk on touch (major faults). A kept tick names the processes that used the
CPU and those that faulted most. This host's kernel pages out memory that went unused for a
minute (a DAMON ``pageout`` scheme, 128 MiB/s), so a process that idles and then wakes may
first wait on the disk for its own code. A failed run prints the worst ticks
(``--summary``), so the next stall names its cause. CPU contention alone is not kept: in a
CI run some task waits for a core nearly all the time.

    python -m tools.host_sampler --out FILE [--interval 0.5]    # until SIGTERM
    python -m tools.host_sampler --summary FILE [--top 15]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

PRESSURE = ("cpu", "io", "memory")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
LATE_S = 0.25            # a wake-up this much past due: the sampler itself did not run
STALL_SHARE = 0.3        # io/memory "full" (every task waiting) for this share of a tick
MAJFLT = 100             # major page faults per tick: pages read back from disk on touch


def pressure_totals() -> dict[str, int]:
    """Cumulative stall microseconds: ``cpu_some``, ``io_some``, ``io_full``, ... (PSI)."""
    out: dict[str, int] = {}
    for res in PRESSURE:
        try:
            text = Path(f"/proc/pressure/{res}").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            kind, *fields = line.split()
            total = dict(f.split("=") for f in fields).get("total")
            if total is not None:
                out[f"{res}_{kind}"] = int(total)
    return out


def process_cpu() -> dict[int, tuple[str, int, int]]:
    """pid → (name, cumulative user+system clock ticks, major page faults) of every process."""
    out: dict[int, tuple[str, int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue                       # exited meanwhile
        head, _, rest = raw.rpartition(")")
        fields = rest.split()
        out[int(entry.name)] = (head.partition("(")[2], int(fields[11]) + int(fields[12]),
                                int(fields[9]))
    return out


def cpu_times() -> dict[str, int]:
    """Cumulative clock ticks of all cores from /proc/stat: where the time went, ``steal``
    included (time the hypervisor ran something else while this machine's vCPUs waited)."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:1 + len(names)]
    except OSError:
        return {}
    return {n: int(v) for n, v in zip(names, fields)}


def vm_counters() -> dict[str, int]:
    """System-wide cumulative counters from /proc/vmstat: major faults, pages read in."""
    want = ("pgmajfault", "pgpgin", "pgsteal_kswapd", "pgsteal_direct")
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in want:
                out[key] = int(value)
    except OSError:
        pass
    return out


def command(pid: int, name: str, width: int = 80) -> str:
    """A process's command line, shortened (its name when it has none: kernel threads)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return name
    words = [Path(argv[0].decode(errors="replace")).name,
             *(a.decode(errors="replace") for a in argv[1:] if a)]
    text = " ".join(w for w in words if w)
    return (text or name)[:width]


def sample(out: Path, interval: float) -> None:
    """Write a JSON line for every stalled-looking tick until SIGTERM/SIGINT."""
    stop = False

    def on_signal(*_: Any) -> None:
        nonlocal stop
        stop = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    psi, procs, vm, cpu = pressure_totals(), process_cpu(), vm_counters(), cpu_times()
    last = time.monotonic()
    due = last + interval
    with out.open("a", encoding="utf-8") as f:
        while not stop:
            time.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            late, span = now - due, now - last
            psi2, procs2, vm2, cpu2 = pressure_totals(), process_cpu(), vm_counters(), cpu_times()
            delta = {k: (psi2[k] - psi.get(k, psi2[k])) / 1e6 / span for k in psi2}
            vm_delta = {k: v - vm.get(k, v) for k, v in vm2.items()}
            # seconds of core time per second of the tick, by kind (cores in all: their sum)
            cpu_share = {k: round((v - cpu.get(k, v)) / TICKS_PER_S / span, 2)
                         for k, v in cpu2.items()}
            used, faults = [], []
            for pid, (name, ticks, majflt) in procs2.items():
                _, ticks0, majflt0 = procs.get(pid, (name, ticks, majflt))
                used.append(((ticks - ticks0) / TICKS_PER_S / span, pid, name))
                faults.append((majflt - majflt0, pid, name))
            used.sort(reverse=True)
            faults.sort(reverse=True)
            if (late > LATE_S or delta.get("io_full", 0) > STALL_SHARE
                    or delta.get("memory_full", 0) > STALL_SHARE
                    or vm_delta.get("pgmajfault", 0) > MAJFLT):
                f.write(json.dumps({
                    "t": time.strftime("%H:%M:%S", time.gmtime()), "late_s": round(late, 3),
                    "span_s": round(span, 3), "load": os.getloadavg()[0],
                    "stall_share": {k: round(v, 2) for k, v in delta.items()},
                    "vm": vm_delta, "cpu": cpu_share,
                    "top": [[command(pid, n), pid, round(c, 2)] for c, pid, n in used[:5]
                            if c > 0.01],
                    "major_faults": [[command(pid, n), pid, k] for k, pid, n in faults[:3]
                                     if k > 0],
                }) + "\n")
                f.flush()
            psi, procs, vm, cpu, last, due = psi2, procs2, vm2, cpu2, now, now + interval


def summary(path: Path, top: int) -> str:
    """The ``top`` worst ticks (latest wake-up, then most I/O and CPU stall), in time order."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        return f"host sampler: no samples ({e})"

    def badness(r: dict[str, Any]) -> float:
        s = r["stall_share"]
        return (4 * r["late_s"] + s.get("io_full", 0) + s.get("memory_full", 0)
                + 0.25 * s.get("cpu_some", 0) + r.get("vm", {}).get("pgmajfault", 0) / 1000)
    worst = sorted(sorted(rows, key=badness)[::-1][:top], key=lambda r: r["t"])
    lines = [f"host sampler: {len(rows)} stalled-looking ticks; the {len(worst)} worst "
             f"(late_s: the sampler woke late; stall_share: PSI stall seconds per second)"]
    lines += [json.dumps(r) for r in worst]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.host_sampler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="sample into this file until SIGTERM")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--summary", type=Path, help="print the worst ticks of this file")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    if args.summary is not None:
        print(summary(args.summary, args.top))
        return 0
    if args.out is None or args.interval <= 0:
        ap.error("--out FILE (and a positive --interval) or --summary FILE")
    sample(args.out, args.interval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
