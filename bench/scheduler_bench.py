"""``dualpath bench scheduler``: placement decisions per second of the scheduler core at paper scale.

Cluster: 48 prefill + 96 decode nodes × 8 engines (1,152 engines, the paper's 48P96D), KV and
cost model of DeepSeek-V3.2, requests shaped like Table 2's 64K dataset. Two runs, one core:

* **burst** — 10k requests queued on an idle cluster; DE and PE groups fetch in turn until the
  queue is empty. Every placement is a full decision: DE (phases 1 and 2), PE (Algorithm 1) and
  read side.
* **steady** — the queue is held at 10k: each round every group fetches *with* telemetry (engine
  reports and node read queues, as a live leader sends them); requests placed 2 rounds earlier
  get ``read_done``/``prefill_done``, those prefilled 6 rounds earlier ``complete``, and new
  ones refill the queue. DE HBM fills up, so the HBM stop and the Z threshold are exercised.

``placements_per_s`` = placements ÷ wall time spent inside fetch calls (the headline is the
steady run's). Fetch latency percentiles are per group-fetch call. ``cpu_cores_per_1k_rps`` =
process CPU seconds of *all* scheduler calls (submit, fetches, events) per request × 1000: the
cores the core needs at 1,000 requests/s (the paper: under 10 cores at 1,152 GPUs in total).
The round-robin baseline (``dpl``) runs the same burst for comparison; ``read_q_max_avg`` is
max ÷ mean of the nodes' read queues after the burst (how evenly the reads were spread, the
static analogue of the paper's SNIC max/avg 1.53 → 1.18; the simulator measures the real one).
"""

from __future__ import annotations

import random
import time
from collections import deque

import numpy as np

from bench.report import bench_parser, headline, print_table, write_results
from common.kv import PRESETS as KV_PRESETS
from services.scheduler.core.config import SchedulerConfig
from services.scheduler.core.records import EngineSpec, Request, Role, Telemetry
from services.scheduler.core.scheduler import Scheduler

P_NODES, D_NODES, PER_NODE = 48, 96, 8
QUEUED = 10_000
MODEL = "deepseek-v3.2"
DE_HBM_BYTES = 40 * 10**9        # HBM left for KV on one DE after weights (estimate)
GOAL = 20_000
PREFILL_ROUNDS = 2               # steady run: a request prefills for 2 fetch rounds …
DECODE_ROUNDS = 6                # … then decodes for 6 (so DE HBM and β both bind)


def build(policy: str = "dualpath") -> Scheduler:
    specs = [EngineSpec(f"p{n}.{i}", Role.PREFILL, f"P{n}")
             for n in range(P_NODES) for i in range(PER_NODE)]
    specs += [EngineSpec(f"d{n}.{i}", Role.DECODE, f"D{n}", hbm_capacity_bytes=DE_HBM_BYTES)
              for n in range(D_NODES) for i in range(PER_NODE)]
    return Scheduler(SchedulerConfig(policy=policy, model=MODEL), specs)


def make_requests(rng: random.Random, start: int, n: int) -> list[Request]:
    """Turns shaped like the 64K dataset: context up to 64K, append ~429, gen ~176 (means)."""
    bpt = KV_PRESETS[MODEL].bytes_per_token
    out = []
    for i in range(start, start + n):
        hit = rng.randrange(0, 64_000)
        new = 1 + int(rng.expovariate(1 / 429))
        gen = 1 + int(rng.expovariate(1 / 176))
        out.append(Request.sized(f"r{i}", f"s{i % 4096}", hit, new, gen, bpt))
    return out


def _pct(xs: list[float], q: float) -> float:
    """A measured sample at quantile ``q`` (numpy's ``higher``: for p50 and p99 the same
    sample as ``sorted(xs)[int(q * n)]``, the figure earlier runs recorded)."""
    return float(np.quantile(xs, q, method="higher")) if xs else 0.0


class _Meter:
    """Wall time inside fetch calls, per-call latencies, CPU time of all scheduler calls."""

    def __init__(self) -> None:
        self.fetch_s = 0.0
        self.lat: list[float] = []
        self.cpu_s = 0.0
        self.placed = 0

    def fetch(self, fn, *args):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t0
        self.cpu_s += time.process_time() - c0
        self.fetch_s += dt
        self.lat.append(dt)
        return out

    def call(self, fn, *args):
        c0 = time.process_time()
        out = fn(*args)
        self.cpu_s += time.process_time() - c0
        return out

    def summary(self, requests: int) -> dict[str, float]:
        return {"placements": self.placed,
                "placements_per_s": self.placed / self.fetch_s if self.fetch_s else 0.0,
                "fetches": len(self.lat),
                "fetch_p50_ms": _pct(self.lat, 0.50) * 1e3,
                "fetch_p99_ms": _pct(self.lat, 0.99) * 1e3,
                "fetch_max_ms": max(self.lat, default=0.0) * 1e3,
                "cpu_cores_per_1k_rps": self.cpu_s / max(requests, 1) * 1000}


def run_burst(policy: str = "dualpath", n: int = QUEUED, seed: int = 1) -> dict[str, float]:
    s, m = build(policy), _Meter()
    reqs = make_requests(random.Random(seed), 0, n)
    for r in reqs:
        m.call(s.submit, r)
    de_groups, pe_groups = s.group_ids(Role.DECODE), s.group_ids(Role.PREFILL)
    for _ in range(100):
        for g in de_groups:
            m.fetch(s.on_de_group_fetch, g)
        for g in pe_groups:
            m.placed += len(m.fetch(s.on_pe_group_fetch, g))
        if m.placed >= n:
            break
    queues = [s.read_queue(f"{k}{i}") for k, c in (("P", P_NODES), ("D", D_NODES)) for i in range(c)]
    balance = max(queues) / (sum(queues) / len(queues))
    return {"run": f"burst/{policy}", **m.summary(n), "read_q_max_avg": balance}


def _telemetry(s: Scheduler, engine_ids: list[str], node_ids: list[str]) -> Telemetry:
    """What a leader would report: its engines' figures and its nodes' read queues."""
    return Telemetry(tuple(s.engine_report(e) for e in engine_ids),
                     {nid: s.read_queue(nid) for nid in node_ids})


def run_steady(total: int, policy: str = "dualpath", seed: int = 2) -> dict[str, float]:
    s, m, rng = build(policy), _Meter(), random.Random(seed)
    for r in make_requests(rng, 0, QUEUED):
        m.call(s.submit, r)
    submitted = QUEUED
    de_groups, pe_groups = s.group_ids(Role.DECODE), s.group_ids(Role.PREFILL)
    members = {g: [f"d{g[1:]}.{i}" for i in range(PER_NODE)] for g in de_groups}
    members |= {g: [f"p{g[1:]}.{i}" for i in range(PER_NODE)] for g in pe_groups}
    prefilling: deque[list[str]] = deque()
    decoding: deque[list[str]] = deque()
    while m.placed < total:
        placed_now: list[str] = []
        for g in de_groups:
            m.fetch(s.on_de_group_fetch, g, _telemetry(s, members[g], [g]))
        for g in pe_groups:
            out = m.fetch(s.on_pe_group_fetch, g, _telemetry(s, members[g], [g]))
            placed_now += [a.request_id for a in out]
        m.placed += len(placed_now)
        prefilling.append(placed_now)
        if len(prefilling) > PREFILL_ROUNDS:
            done = prefilling.popleft()
            for rid in done:
                m.call(s.read_done, rid)
                m.call(s.prefill_done, rid)
            decoding.append(done)
        if len(decoding) > DECODE_ROUNDS:
            for rid in decoding.popleft():
                m.call(s.complete, rid)
        refill = QUEUED - s.queue_lengths()["global"] - s.queue_lengths()["private"]
        for r in make_requests(rng, submitted, max(refill, 0)):
            m.call(s.submit, r)
        submitted += max(refill, 0)
    return {"run": f"steady/{policy}", **m.summary(m.placed)}


def main(argv: list[str] | None = None) -> int:
    args = bench_parser("scheduler", __doc__.splitlines()[0]).parse_args(argv)
    total = 30_000 if args.quick else 200_000
    print(f"cluster {P_NODES}P{D_NODES}D x {PER_NODE} = {(P_NODES + D_NODES) * PER_NODE} engines, "
          f"{QUEUED} queued requests, model {MODEL}")
    rows = [run_burst("dualpath"), run_burst("dpl"), run_steady(total, "dualpath")]
    print_table(rows, ["run", "placements", "placements_per_s", "fetches", "fetch_p50_ms",
                       "fetch_p99_ms", "fetch_max_ms", "cpu_cores_per_1k_rps", "read_q_max_avg"])
    steady = rows[-1]
    head = headline("placements_per_s", steady["placements_per_s"], GOAL)
    write_results(args.out, "scheduler", head, {"runs": rows, "engines": (P_NODES + D_NODES) * PER_NODE,
                                                "queued": QUEUED, "quick": args.quick})
    return 0
