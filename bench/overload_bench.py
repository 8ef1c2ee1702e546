"""``dualpath bench overload``: a burst of concurrent submissions against a local cluster.

Issue 8, item 4. Starts a cluster as subprocesses (``dualpath cluster up``) with scheduler
admission limits far below the burst (``scheduler_service.max_queued_requests`` /
``max_active_requests``), then submits N requests at once (default 10,000) over a few frontend
connections, each carrying thousands of concurrent streaming calls
(``rpc.max_inflight_calls`` is raised to fit, so admission is judged by the scheduler, not by
the per-connection call cap). Every submission must get a terminal answer:

* ``finished`` — ``RequestFinished`` with exactly ``gen_tokens`` output ids;
* ``OVERLOADED`` — the typed admission refusal, with a ``retry_after_s`` hint;
* another typed error the scheduler sent (a ``RequestFailed`` event or a call error);
* **lost** — anything else: the stream ended without an outcome, the connection dropped
  (``PEER_FAILED``), or the client's own deadline ran out first (``DEADLINE_EXCEEDED`` raised
  locally). Goal: 0.

While the burst runs the scheduler's ``VmRSS`` is sampled from ``/proc/<pid>/status``; reported
are RSS before, the peak (max of the samples and ``VmHWM``), and after the cluster drained.
Afterwards a small agentic replay must finish correctly (every prompt byte verified by the
emulated engines): the cluster recovered. Headline: ``requests_lost`` (goal 0); the RSS growth
sits next to it (``rss_growth_mb``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from pathlib import Path
from typing import Any

from bench.report import bench_parser, headline, print_table, write_results

MiB = 1 << 20
N_DEFAULT = 10_000


def cluster_data(root: Path, *, max_queued: int = 128, max_active: int = 256,
                 inflight: int = 4096) -> dict[str, Any]:
    """A light 1P1D cluster under ``root`` whose scheduler admits far fewer than the burst."""
    return {
        "cluster": {"name": "overload", "data_dir": str(root / "cluster"),
                    "storage_root": str(root / "storage"), "start_timeout_s": 90.0,
                    "time_scale": 0.05, "storage_link_bytes_per_s": 400e6,
                    "compute_link_bytes_per_s": 800e6,
                    "nodes": [{"id": "p0", "role": "prefill", "engines": 2},
                              {"id": "d0", "role": "decode", "engines": 2}]},
        "kv": {"preset": "test-small"},
        "rpc": {"max_inflight_calls": inflight},
        "transport": {"staging_bytes": 16 * MiB}, "gateway": {"io_threads": 2},
        "gateway_service": {"staging_bytes": 16 * MiB, "max_batch_bytes": 4 * MiB},
        "pe_receiver": {"buffer_bytes": 32 * MiB}, "de_loader": {"buffer_bytes": 32 * MiB},
        "scheduler_service": {"fetch_interval_s": 0.01, "heartbeat_s": 0.5,
                              "max_queued_requests": max_queued,
                              "max_active_requests": max_active},
        "logging": {"level": "warning"},
    }


# --------------------------------------------------------------------------- memory

def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


class RssSampler:
    """Samples ``VmRSS`` of one pid every ``interval_s`` while running; keeps the maximum."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak = 0
        self.samples = 0
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> RssSampler:
        self._task = asyncio.create_task(self._run(), name="rss-sampler")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss(self.pid)[0])
            self.samples += 1
            await asyncio.sleep(self.interval_s)


# --------------------------------------------------------------------------- the burst

async def burst(host: str, port: int, rpc: Any, *, n: int = N_DEFAULT, connections: int = 4,
                prompt_tokens: int = 100, gen_tokens: int = 4, deadline_s: float = 60.0,
                tag: str = "b") -> dict[str, Any]:
    """Submit ``n`` requests at once over ``connections`` clients; classify every answer."""
    from common.errors import DeadlineExceeded, DualpathError, Overloaded, PeerFailed
    from common.protocol import RequestFailed, RequestFinished
    from services.scheduler.client.client import SchedulerClient

    clients = [SchedulerClient(host, port, rpc=rpc, client_id=f"overload-{i}")
               for i in range(connections)]
    for c in clients:
        await c.connect(30.0)
    outcomes: collections.Counter[str] = collections.Counter()
    no_hint = 0
    hard_stop = deadline_s + 30.0          # past the stream's own budget: only a bug gets here

    async def one(i: int) -> None:
        nonlocal no_hint
        toks = [(i * 7919 + j) % 50_000 for j in range(prompt_tokens)]
        final = None
        try:
            async with asyncio.timeout(hard_stop):
                async with clients[i % connections].submit(
                        f"{tag}{i}", f"{tag}s{i}", prompt_tokens, gen_tokens, token_ids=toks,
                        deadline_s=deadline_s) as events:
                    async for ev in events:
                        if isinstance(ev, (RequestFinished, RequestFailed)):
                            final = ev
        except Overloaded as e:
            outcomes["OVERLOADED"] += 1
            no_hint += not (e.retry_after_s and e.retry_after_s > 0)
            return
        except (DeadlineExceeded, PeerFailed) as e:      # raised here: nobody answered
            outcomes[f"lost:{e.code.value}"] += 1
            return
        except DualpathError as e:
            outcomes[e.code.value] += 1
            return
        except TimeoutError:
            outcomes["lost:hang"] += 1
            return
        if isinstance(final, RequestFinished):
            ok = final.output_token_ids is not None and len(final.output_token_ids) == gen_tokens
            outcomes["finished" if ok else "lost:wrong_output"] += 1
        elif isinstance(final, RequestFailed):
            outcomes[f"failed:{final.code}"] += 1
        else:
            outcomes["lost:no_outcome"] += 1

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        for c in clients:
            await c.close()
    lost = sum(v for k, v in outcomes.items() if k.startswith("lost:"))
    return {"submitted": n, "connections": connections, "answered": sum(outcomes.values()),
            "finished": outcomes["finished"], "overloaded": outcomes["OVERLOADED"],
            "other": {k: v for k, v in outcomes.items()
                      if k not in ("finished", "OVERLOADED") and not k.startswith("lost:")},
            "lost": lost, "lost_by_kind": {k: v for k, v in outcomes.items()
                                           if k.startswith("lost:")},
            "overloaded_without_retry_after": no_hint,
            "burst_s": round(time.monotonic() - t0, 3)}


async def drained(sched: Any, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until the scheduler holds no live request; its counters then."""
    end = time.monotonic() + timeout
    while True:
        status = await sched.cluster_status(timeout=10.0)
        if not status.requests and not any(status.queues.values()):
            return dict(status.counters)
        if time.monotonic() > end:
            raise TimeoutError(f"scheduler still holds requests {status.requests} after "
                               f"{timeout}s")
        await asyncio.sleep(0.1)


async def scheduler_stats(host: str, port: int, rpc: Any) -> dict[str, float]:
    """The scheduler's ``GetStats`` counters (its RPC layer's refusals among them)."""
    from typing import Union

    from common.protocol import ErrorReply, GetStats, GetStatsReply, Pong
    from common.rpc import RpcClient
    client = RpcClient(rpc, host, port, role="monitor", node_id="overload-bench",
                       reply_type=Union[GetStatsReply, Pong, ErrorReply])
    try:
        return dict((await client.call(GetStats(), timeout=15.0)).counters)
    finally:
        await client.close()


async def run(root: Path, *, n: int = N_DEFAULT, connections: int = 4,
              data: dict[str, Any] | None = None, echo: Any = print) -> dict[str, Any]:
    """Cluster up → RSS before → burst → drain → RSS after → recovery replay → down."""
    from tools.cluster.config import load_data
    from tools.cluster.launcher import Launcher
    from tools.replay.run import ClusterTarget, replay
    from tools.replay.workloads import AgenticSpec
    from services.scheduler.client.client import SchedulerClient

    cluster = load_data(data or cluster_data(root), "overload", environ={})
    launcher = Launcher(cluster)
    state = await asyncio.to_thread(launcher.up)
    try:
        pid = state.proc("scheduler").pid
        rpc = cluster.cfg.rpc
        await asyncio.sleep(0.5)
        before, _ = rss(pid)
        echo(f"cluster up; scheduler pid {pid}, RSS {before / MiB:.1f} MiB; "
             f"submitting {n} requests over {connections} connections")
        async with RssSampler(pid) as sampler:
            res = await burst(*state.scheduler, rpc, n=n, connections=connections)
            async with SchedulerClient(*state.scheduler, rpc=rpc) as sched:
                counters = await drained(sched)
            rpc_stats = await scheduler_stats(*state.scheduler, rpc)
        after, hwm = rss(pid)
        peak = max(sampler.peak, hwm)
        t_rec = time.monotonic()
        rec = await replay(ClusterTarget.from_state(cluster, state),
                           AgenticSpec("32k", agents=2, seed=5, scale=0.0625, max_turns=2),
                           progress=False, deadline_s=60.0)
        checks = rec["summary"]["checks"]
        recovered = bool(checks["all_finished"] and checks["hit_mismatches"] == 0
                         and checks["every_prompt_verified"])
        s = cluster.cfg.scheduler_service
        res.update({
            "limits": {"max_queued_requests": s.max_queued_requests,
                       "max_active_requests": s.max_active_requests,
                       "rpc_max_inflight_calls": rpc.max_inflight_calls},
            "rss_before_mb": round(before / MiB, 1), "rss_peak_mb": round(peak / MiB, 1),
            "rss_after_mb": round(after / MiB, 1),
            "rss_growth_mb": round((peak - before) / MiB, 1), "rss_samples": sampler.samples,
            "scheduler_counters": {k: counters.get(k, 0) for k in
                                   ("submitted", "finished", "failed", "rejected_overload",
                                    "deadline_exceeded", "cancelled")},
            "rpc_calls_rejected": int(rpc_stats.get("calls_rejected", 0)),
            "rpc_connections_open": int(rpc_stats.get("connections_open", 0)),
            "rpc_calls_inflight": int(rpc_stats.get("calls_inflight", 0)),
            "recovered": recovered, "recovery_requests": rec["summary"]["requests"],
            "recovery_s": round(time.monotonic() - t_rec, 3),
        })
        return res
    finally:
        await asyncio.to_thread(launcher.down)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("overload", __doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=N_DEFAULT, help="concurrent submissions")
    p.add_argument("--connections", type=int, default=4, help="frontend connections")
    p.add_argument("--dir", type=Path, default=Path("data/bench-overload"),
                   help="cluster state and storage (removed first)")
    args = p.parse_args(argv)
    import shutil

    from common.logging import configure_logging
    configure_logging("warning", None)
    shutil.rmtree(args.dir, ignore_errors=True)
    n = args.n
    res = asyncio.run(run(args.dir.resolve(), n=n, connections=args.connections))
    shutil.rmtree(args.dir, ignore_errors=True)
    print_table([res], ["submitted", "finished", "overloaded", "lost", "rss_before_mb",
                        "rss_peak_mb", "rss_after_mb", "rss_growth_mb", "burst_s", "recovered"])
    if res["other"]:
        print(f"other typed answers: {res['other']}")
    write_results(args.out, "overload",
                  headline("requests_lost", float(res["lost"]), 0.0, higher_is_better=False),
                  res)
    return 0 if res["lost"] == 0 and res["recovered"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
