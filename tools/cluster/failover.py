"""Scheduler failover on a live local cluster: two replicas elected through a 3-member etcd.

The cluster is the chaos one (:mod:`tools.cluster.chaos`: 1P2D subprocesses on loopback,
leases of 2 s, byte-verified agentic replays) with ``[etcd] endpoints`` pointing at real etcd
members this harness starts (:class:`~tools.cluster.etcd_members.EtcdMembers`). The
launcher's scheduler is the first leader; a second replica (same config, another port) waits
as the standby. Frontends (the replay's clients) and nodes find the leader in etcd.

:meth:`FailoverHarness.kill_leader` SIGKILLs the leader and measures, from the kill:

* ``election_s`` — until the standby is elected (its ready line appears);
* ``failover_s`` — until the new leader serves again: every node service has registered with
  it and it has sent its first plan (work flows);
* ``first_finish_s`` — until it has finished its first request (that includes one request's
  own run time, ~1-2 s here);

then starts a fresh standby from the killed replica's command line. :meth:`replay` runs one
agentic replay and judges it (every planned request finished with verified bytes, or it is
*lost*; a second final event reaching a client is a *duplicated completion*).
``bench/failover_bench.py`` compares a replay with kills against the same replay without.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import DualpathError

from .chaos import ChaosHarness, ChaosLauncher, _drive_classes, chaos_cluster
from .chaos_cases import DEADLINE_S, Submission
from .config import free_port
from .etcd_members import EtcdMembers


@dataclass
class Replica:
    """One scheduler replica process; ``ready`` appears when it is elected."""

    proc: Any                   # subprocess.Popen, or the launcher's Proc (pid only)
    ready: Path | None
    argv: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def elected(self) -> dict[str, Any] | None:
        if self.ready is None or not self.ready.exists():
            return None
        return json.loads(self.ready.read_text())


@dataclass
class Kill:
    t_s: float                          # since the replay started
    old_epoch: int | None = None
    new_epoch: int | None = None
    election_s: float | None = None     # kill → standby elected
    failover_s: float | None = None     # kill → nodes re-registered and a plan sent
    first_finish_s: float | None = None  # kill → the new leader finished a request
    in_flight: int | None = None        # requests the leader held (not ended) just before


@dataclass
class ReplayResult:
    label: str
    planned: int = 0                    # requests the workload holds (agents × turns)
    finished: int = 0                   # distinct requests finished with verified bytes
    lost: int = 0                       # planned - finished, plus wrong outputs
    submissions: int = 0
    duplicate_finals: int = 0           # a second final event for one request at a client
    resubmits: int = 0                  # the clients' reconnect-and-resubmit count
    jct_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    kills: list[Kill] = field(default_factory=list)
    lost_detail: list[str] = field(default_factory=list)


class FailoverHarness(ChaosHarness):
    """A chaos cluster in etcd mode with a standby scheduler (see the module docstring)."""

    def __init__(self, config: str | None = None, echo: Any = None, members: int = 3,
                 rpc: dict[str, Any] | None = None) -> None:
        """``rpc``: ``[rpc]`` settings for every process and the harness's own clients
        (``bench failover --tls`` passes the certificates of :func:`mutual_tls_settings`)."""
        super().__init__(config, echo)
        self.etcd = EtcdMembers(self._tmp / "etcd", members)    # ports chosen, not started
        self.cluster = chaos_cluster(config, self._tmp).with_overrides(
            etcd={"endpoints": self.etcd.endpoints}, **({"rpc": rpc} if rpc else {}))
        self.launcher = ChaosLauncher(self.cluster)
        self.leader: Replica | None = None
        self.standby: Replica | None = None
        self._spawned: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> FailoverHarness:
        try:
            self.up()
        except BaseException:
            self.down()             # etcd members and any replica started: stopped by pid
            raise
        return self

    def up(self) -> float:
        self.etcd.start()
        t = super().up()
        p = self.launcher.state.proc("scheduler")
        self.leader = Replica(p, None, list(self.launcher.commands["scheduler"].argv))
        self.standby = self._spawn_standby(self.leader.argv)
        return t

    def down(self) -> None:
        for proc in self._spawned:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        try:
            super().down()
        finally:
            self.etcd.stop()

    def _spawn_standby(self, argv: list[str]) -> Replica:
        replica = spawn_standby(argv, self._tmp, len(self._spawned))
        self._spawned.append(replica.proc)
        return replica

    def resolver(self) -> Any:
        from services.scheduler.client.leader import LeaderResolver
        return LeaderResolver(self.cluster.cfg.etcd)

    async def status(self):
        from services.scheduler.client.client import SchedulerClient
        async with SchedulerClient("", 0, rpc=self.rpc, client_id="failover",
                                   resolve=self.resolver()) as c:
            return await c.cluster_status(timeout=5.0)

    # ------------------------------------------------------------------ one kill
    async def kill_leader(self, t0: float) -> Kill:
        assert self.leader is not None and self.standby is not None
        old, new = self.leader, self.standby
        k = Kill(time.monotonic() - t0)
        with contextlib.suppress(DualpathError, OSError):
            before = await self.status()
            k.old_epoch, self._nodes_before = before.counters.get("epoch"), len(before.nodes)
            k.in_flight = sum(before.requests.values())
        t_kill = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(old.pid, signal.SIGKILL)
        info = await poll_until(new.elected, DEADLINE_S)
        if info is not None:
            k.election_s, k.new_epoch = time.monotonic() - t_kill, info.get("epoch")
        if await poll_until(self._new_leader_placing, DEADLINE_S * 2, interval=0.02):
            k.failover_s = time.monotonic() - t_kill
        if await poll_until(self._new_leader_finished, DEADLINE_S * 2, interval=0.05):
            k.first_finish_s = time.monotonic() - t_kill
        self._reap(old)
        self.leader, self.standby = new, self._spawn_standby(old.argv)
        self.echo(f"   leader killed at {k.t_s:.1f} s: elected in {_r(k.election_s)} s, placing "
                  f"again in {_r(k.failover_s)} s, first request finished in "
                  f"{_r(k.first_finish_s)} s (epoch {k.old_epoch} → {k.new_epoch})")
        return k

    async def _new_leader_placing(self) -> bool:
        with contextlib.suppress(DualpathError, OSError):
            st = await self.status()
            return len(st.nodes) >= self._nodes_before and st.counters.get("plans_sent", 0) > 0
        return False

    async def _new_leader_finished(self) -> bool:
        with contextlib.suppress(DualpathError, OSError):
            return (await self.status()).counters.get("finished", 0) > 0
        return False

    def _reap(self, r: Replica) -> None:
        pop = r.proc if isinstance(r.proc, subprocess.Popen) else self.launcher.popen("scheduler")
        if pop is not None and alive_popen(pop):
            pop.kill()
        if pop is not None:
            pop.wait(timeout=10)

    # ------------------------------------------------------------------ one replay
    async def replay(self, label: str, agents: int, turns: int, kills: int,
                     first_kill_s: float = 2.0, kill_every_s: float = 6.0,
                     etcd_member_kill: bool = False) -> ReplayResult:
        """One byte-verified agentic replay, killing the leader ``kills`` times in it — or,
        with ``etcd_member_kill``, one etcd member (SIGKILL, back after ``kill_every_s``)."""
        from tools.replay.driver import ClientPool, _agent
        from tools.replay.workloads import AgenticSpec, AgenticWorkload
        self._seed += 1
        w = AgenticWorkload(AgenticSpec("32k", agents, seed=self._seed, scale=0.125,
                                        max_turns=turns))
        trajs = w.trajectories()
        res = ReplayResult(label, planned=sum(len(t.turns) for t in trajs))
        log: list[Submission] = []
        t0 = time.monotonic()
        async with ClientPool("", 0, agents, self.rpc, resolve_factory=self.resolver) as pool:
            r = _drive_classes()(pool, deadline_s=DEADLINE_S, retries=3, log=log)
            load = asyncio.gather(*(_agent(r, t, self.block_tokens, i)
                                    for i, t in enumerate(trajs)))
            if etcd_member_kill:
                killer = asyncio.create_task(self._etcd_member_kill(res, t0, first_kill_s,
                                                                    kill_every_s))
            else:
                killer = asyncio.create_task(self._kills(res, kills, t0, first_kill_s,
                                                         kill_every_s, load))
            try:
                await load
            finally:
                await killer
            res.wall_s = time.monotonic() - t0
            for c in pool.clients:
                res.resubmits += c.stream_counts["resubmits"]
                res.duplicate_finals += c.stream_counts["duplicate_finals"]
        _judge(res, log)
        return res

    async def burst_kill(self, agents: int, turns: int = 2, kill_after_s: float = 0.3
                         ) -> ReplayResult:
        """Chaos case "leader kill during a burst" (issue 16): every agent submits its first
        turn at once and the leader is SIGKILLed ``kill_after_s`` into it, while the burst is
        queued and in flight (``Kill.in_flight``: how many it held); the standby takes over and
        every request must still finish once with verified bytes."""
        return await self.replay("leader-kill-burst", agents, turns, kills=1,
                                 first_kill_s=kill_after_s)

    async def _etcd_member_kill(self, res: ReplayResult, t0: float, at_s: float,
                                down_s: float) -> None:
        """SIGKILL the etcd member the cluster lists first, restart it ``down_s`` later; the
        leader must keep its lease through the other two (``res.kills`` records the epochs:
        unchanged when no failover happened)."""
        await asyncio.sleep(at_s)
        k = Kill(time.monotonic() - t0)
        with contextlib.suppress(DualpathError, OSError):
            k.old_epoch = (await self.status()).counters.get("epoch")
        self.etcd.kill(0)
        await asyncio.sleep(down_s)     # longer than the 2 s lease: renewals went elsewhere
        await asyncio.to_thread(self.etcd.restart, 0)
        with contextlib.suppress(DualpathError, OSError):
            k.new_epoch = (await self.status()).counters.get("epoch")
        res.kills.append(k)
        self.echo(f"   etcd member m0 killed at {k.t_s:.1f} s, back {down_s} s later; leader "
                  f"epoch {k.old_epoch} → {k.new_epoch}")

    async def _kills(self, res: ReplayResult, kills: int, t0: float, first_s: float,
                     every_s: float, load: asyncio.Future) -> None:
        for n in range(kills):
            at = t0 + first_s + n * every_s
            while time.monotonic() < at and not load.done():
                await asyncio.sleep(0.05)
            if load.done():
                self.echo(f"   the replay ended before kill {n + 1}")
                return
            res.kills.append(await self.kill_leader(t0))


def _judge(res: ReplayResult, log: list[Submission]) -> None:
    res.submissions = len(log)
    done = {_base_id(s.request_id) for s in log
            if s.outcome == "finished" and s.output_ok is not False}
    wrong = [s for s in log if s.outcome == "finished" and s.output_ok is False]
    res.finished = len(done)
    res.lost = res.planned - res.finished + len(wrong)
    res.jct_s = [s.t_end - s.t_start for s in log
                 if s.outcome == "finished" and s.t_end is not None]
    res.lost_detail = [f"{s.request_id}: {s.outcome} {s.code or ''} {s.message or ''}"
                       for s in log if s.lost][:20]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _base_id(rid: str) -> str:
    """The replay's request id without its retry suffix (``-r<n>``)."""
    head, sep, tail = rid.rpartition("-r")
    return head if sep and tail.isdigit() else rid


def spawn_standby(argv: list[str], directory: Path, index: int) -> Replica:
    """A scheduler replica from ``argv`` (a replica's command line: the same config, so the
    same ``[etcd]``) on a free port, its ready file and log ``replica-<index>`` in
    ``directory``: it campaigns in etcd and is elected — its ready file appears — once the
    leader's lease lapses. The caller stops it (by pid)."""
    argv = _without(argv, ("--port", "--ready-file"))
    ready = directory / f"ready-replica-{index}"
    log = open(directory / f"replica-{index}.log", "ab")
    proc = subprocess.Popen(argv + ["--port", str(free_port()), "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    return Replica(proc, ready, argv)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


def alive_popen(p: subprocess.Popen) -> bool:
    return p.poll() is None


async def poll_until(cond: Any, timeout: float, interval: float = 0.02) -> Any:
    """``cond()`` (sync or async) until truthy; its value, or None after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)
    return None


def mutual_tls_settings(root: Path) -> dict[str, Any]:
    """A CA and one certificate for 127.0.0.1 made now (``trustme``, a dev dependency), as
    ``[rpc]`` settings for mutual TLS on every hop: every process presents the same
    certificate as server and as client (what ``tests/test_scheduler_failover.py`` does)."""
    import trustme

    root.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {name: str(root / name) for name in ("ca.pem", "cert.pem", "key.pem")}
    ca.cert_pem.write_to_path(files["ca.pem"])
    for blob in cert.cert_chain_pems:
        blob.write_to_path(files["cert.pem"], append=True)
    cert.private_key_pem.write_to_path(files["key.pem"])
    return {"tls_cert_file": files["cert.pem"], "tls_key_file": files["key.pem"],
            "tls_ca_file": files["ca.pem"], "tls_require_client_cert": True}
