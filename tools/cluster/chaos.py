"""Fault-injection harness: crash or pause one service of a live cluster mid-request, check
that nothing is lost, nothing leaks, and the service rejoins and works again.

The cluster is the ordinary local one (:class:`~tools.cluster.launcher.Launcher`:
subprocesses on loopback, directory storage in a temp dir) with leases and timeouts tuned so a
dead or paused service is noticed within a few seconds (:data:`CHAOS_SETTINGS`: config, not
code). Every child gets ``DUALPATH_FAILPOINTS_FILE``, so one victim can be armed at a chosen
moment without a restart (:mod:`common.faults`: write the spec, send SIGUSR1). One case
(:class:`Fault`) is:

1. arm the victim's failpoint (``kill`` / ``stop`` at the N-th hit), or send a SIGKILL /
   SIGSTOP from outside, no earlier than ``after_s`` into the load and only once the victim
   holds work while a submission is unanswered (never at an idle moment);
2. run an agentic replay (fresh sessions; every prompt's KV is verified byte for byte by the
   emulated engines) and wait for the victim to die or stop;
3. restart it (a new process: new ports, new epoch) — or SIGCONT it after ``pause_s``, past
   the lease, so the scheduler has dropped it and re-planned its requests and the stale
   process must notice (heartbeat/fetch rejected) and register again with a new epoch;
4. keep sending until a transfer went through the rejoined service (recovery time = restart
   or SIGCONT → its first completed transfer: DE loader ``handed_off``, PE receiver
   ``attempts_ok``, gateway ``reads_ok``/``writes_ok``);
5. when the cluster is quiet: every submission either finished with verified bytes or failed
   with a retryable error within its deadline (anything else is *lost*: hung past its
   deadline, a non-retryable failure, a stream that ended without an answer, wrong output),
   and every page pool of every service is entirely free again (*leaked pages*).

``CaseResult`` carries all of it (the records: :mod:`tools.cluster.chaos_cases`);
``bench/chaos_bench.py`` and ``tests/test_chaos.py`` run lists of cases on one shared cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Union

from common.errors import DualpathError
from common.faults import ENV, FILE_ENV
from common.protocol import ErrorReply, GetStats, GetStatsReply, Pong
from common.rpc import RpcClient

# The case records live in chaos_cases; users keep importing them from here.
from .chaos_cases import DEADLINE_S, LATE_S, CaseResult, Fault, Submission
from .config import Cluster, load_cluster
from .launcher import Launcher, Proc, alive, tail
from .real_engines import Command

# Detection in seconds, not tens of seconds: a paused service loses its lease after 2 s.
CHAOS_SETTINGS: dict[str, dict[str, Any]] = {
    "scheduler_service": {"lease_s": 2.0, "heartbeat_s": 0.3, "lease_check_s": 0.1},
    "pe_receiver": {"control_timeout_s": 3.0, "engine_release_timeout_s": 5.0,
                    "alloc_timeout_s": 5.0},
    "de_loader": {"control_timeout_s": 3.0, "engine_release_timeout_s": 5.0,
                  "alloc_timeout_s": 5.0, "writeback_timeout_s": 5.0},
    "rpc": {"connect_timeout_s": 2.0, "handshake_timeout_s": 2.0, "reconnect_max_s": 0.5},
    "transport": {"connect_timeout_s": 2.0},
}
MODE = "+dpl"                 # both read paths, alternating (dpl policy): every point gets traffic
FIRE_WITHIN_S = 45.0           # a failpoint the load never reaches in this long: not fired
RECOVERY_COUNTERS = {"de_loader": ("handed_off",), "pe_receiver": ("attempts_ok",),
                     "gateway": ("reads_ok", "writes_ok"),
                     "scheduler": ("finished",)}    # a restarted scheduler: first request done
_StatsReply = Union[GetStatsReply, Pong, ErrorReply]


# --------------------------------------------------------------------------- launcher

class ChaosLauncher(Launcher):
    """The launcher, plus per-child failpoint files and restart of one child."""

    def __init__(self, cluster: Cluster, **kw: Any) -> None:
        super().__init__(cluster, **kw)
        self.commands: dict[str, Command] = {}

    def fp_file(self, name: str) -> Path:
        return self.state_dir / f"failpoints-{name.replace(':', '-')}"

    def _spawn(self, cmd: Command) -> Proc:
        self.commands[cmd.name] = cmd
        path = self.fp_file(cmd.name)
        path.write_text("")
        saved = {k: os.environ.get(k) for k in (FILE_ENV, ENV)}
        os.environ[FILE_ENV] = str(path)          # inherited by this child only: restored
        os.environ.pop(ENV, None)
        try:
            return super()._spawn(cmd)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def log_tail(self, name: str, lines: int = 30) -> str:
        return tail(self.log_dir / f"{name.replace(':', '-')}.log", lines)

    def popen(self, name: str):
        return self._popen.get(name)

    def restart(self, name: str) -> Proc:
        """Start ``name`` again (SIGKILL first if it still runs); gateways and the scheduler
        keep their port (nodes and frontends dial it: a restart at the same address), node
        services get new ones (a new process: new ports, new epoch — unlike
        ``Launcher.restart``, a supervisor's restart in place)."""
        old = self.state.proc(name)
        if alive(old):
            os.kill(old.pid, signal.SIGKILL)
        p = self._popen.get(name)
        if p is not None:
            p.wait(timeout=10)
        self.state.procs.remove(old)
        cmd = self.commands[name]
        argv = cmd.argv
        if cmd.service in ("gateway", "scheduler") and "--port" not in argv:
            argv = argv + ["--port", str(old.rpc_port)]   # node services were given this port
        self._wave([dataclasses.replace(cmd, argv=argv)])
        return self.state.proc(name)

    def arm(self, name: str, spec: str) -> None:
        """Arm failpoints in the running child ``name`` (file + SIGUSR1)."""
        self.fp_file(name).write_text(spec)
        os.kill(self.state.proc(name).pid, signal.SIGUSR1)


def chaos_cluster(config: str | None = None, root: Path | None = None,
                  remote_engines: bool = False) -> Cluster:
    cluster = load_cluster(config)
    overrides = {k: dict(v) for k, v in CHAOS_SETTINGS.items()}
    if root is not None:
        overrides["cluster"] = {"name": f"{cluster.spec.name}-chaos",
                                "data_dir": str(root / "cluster"),
                                "storage_root": str(root / "storage")}
    if remote_engines:        # engines in their own processes: victims of their own
        overrides.setdefault("cluster", {})["remote_engines"] = True
    return cluster.with_overrides(**overrides).with_mode(MODE)


# --------------------------------------------------------------------------- load

def _drive_classes():
    from tools.replay.driver import Replayer

    class ChaosReplayer(Replayer):
        """The replay client, logging every submission with how and when it ended."""

        def __init__(self, *a: Any, log: list[Submission], **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.log = log

        async def _once(self, client, rec, rid, submit):
            sub = Submission(rid, time.monotonic())
            self.log.append(sub)
            try:
                async with asyncio.timeout(self.deadline_s + LATE_S + 5.0):
                    final, retry = await super()._once(client, rec, rid, submit)
            except TimeoutError:
                sub.outcome, sub.t_end = "hung", time.monotonic()
                rec.outcome, rec.code = "failed", "HUNG"
                return None, None
            sub.t_end = time.monotonic()
            sub.attempts, sub.read_side = rec.attempts, rec.read_side
            sub.pe_node, sub.de_node = rec.pe_node, rec.de_node
            if final is not None:
                sub.outcome, sub.output_ok = "finished", rec.output_ok
            else:
                sub.outcome, sub.code, sub.retryable = "failed", rec.code, retry is not None
                sub.message = (rec.message or "")[:300]
            return final, retry

    return ChaosReplayer


async def drive(scheduler: tuple[str, int], seed: int, agents: int, turns: int,
                log: list[Submission], rpc: Any, block_tokens: int) -> None:
    """An agentic replay (sessions ``agent-<seed>-<i>``) whose submissions land in ``log``."""
    from tools.replay.driver import ClientPool, _agent
    from tools.replay.workloads import AgenticSpec, AgenticWorkload
    w = AgenticWorkload(AgenticSpec("32k", agents, seed=seed, scale=0.125, max_turns=turns))
    async with ClientPool(*scheduler, agents, rpc) as pool:
        r = _drive_classes()(pool, deadline_s=DEADLINE_S, retries=3, log=log)
        trajs = w.trajectories()
        await asyncio.gather(*(_agent(r, t, block_tokens, i) for i, t in enumerate(trajs)))


# --------------------------------------------------------------------------- harness

class ChaosHarness:
    """One chaos cluster; :meth:`run_case` injects one :class:`Fault` and judges it."""

    def __init__(self, config: str | None = None, echo: Any = None,
                 remote_engines: bool = False) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix="dualpath-chaos-"))
        self.cluster = chaos_cluster(config, self._tmp, remote_engines)
        self.launcher = ChaosLauncher(self.cluster)
        self.echo = echo or (lambda msg: None)
        self._seed = 1000
        self._nodes_before = 0
        self.not_quiet: dict[str, Any] = {}    # what _quiet saw last when it gave up
        from common.kv import spec_from_config
        self.block_tokens = spec_from_config(self.cluster.cfg.kv).block_tokens

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> float:
        t0 = time.monotonic()
        self.launcher.up()
        return time.monotonic() - t0

    def down(self) -> None:
        st = self.launcher.state
        for p in (st.procs if st else []):
            if alive(p):
                _signal(p.pid, signal.SIGCONT)     # a paused child must be able to stop
        self.launcher.down()
        if os.environ.get("DUALPATH_KEEP_CHAOS_DIR") == "1":    # its services' logs, to read
            self.echo(f"   kept {self._tmp} (DUALPATH_KEEP_CHAOS_DIR=1)")
            return
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> ChaosHarness:
        try:
            self.up()
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def rpc(self):
        return self.cluster.cfg.rpc

    # ------------------------------------------------------------------ probes
    def node_of(self, name: str) -> str:
        """The node service an engine process (``engine_sim:p0``) attaches to; else ``name``."""
        p = self.launcher.state.proc(name)
        if p.service != "engine_sim":
            return name
        return next(q.name for q in self.launcher.state.procs
                    if q.node == p.node and q.service in RECOVERY_COUNTERS and
                    q.service != "gateway")

    async def stats(self, name: str, timeout: float = 5.0) -> dict[str, float] | None:
        p = self.launcher.state.proc(self.node_of(name))
        client = RpcClient(self.rpc, p.host, int(p.rpc_port), role="monitor", node_id="chaos",
                           reply_type=_StatsReply)
        try:
            reply = await client.call(GetStats(), timeout=timeout)
            return dict(reply.counters)
        except (DualpathError, OSError):
            return None
        finally:
            await client.close()

    async def status(self):
        """The scheduler's cluster status. A call that times out or finds the scheduler away
        is tried again (3 tries in all): on a loaded host one reply can miss its 5 s (ci82: the
        whole VM stood still ~3.5 s), and a case must not fail on the harness's own probe."""
        from services.scheduler.client.client import SchedulerClient
        for tries_left in (2, 1, 0):
            try:
                async with SchedulerClient(*self.launcher.state.scheduler, rpc=self.rpc,
                                           client_id="chaos") as c:
                    return await c.cluster_status(timeout=5.0)
            except DualpathError as e:
                if not e.retryable or not tries_left:
                    raise
                await asyncio.sleep(0.2)

    async def epoch(self, name: str) -> int | None:
        p = self.launcher.state.proc(name)
        if p.service in ("gateway", "engine_sim"):
            return None
        for n in (await self.status()).nodes:
            if n.node_id == p.node and n.service == p.service and n.engines:
                return n.epoch
        return None

    # ------------------------------------------------------------------ one case
    async def run_case(self, fault: Fault) -> CaseResult:
        t0 = time.monotonic()
        res = CaseResult(fault.case, fault.target, fault.where, fault.action)
        victim = self.launcher.state.proc(fault.target)
        res.old_epoch = await self.epoch(fault.target)
        status0 = await self.status()
        c0 = status0.counters
        self._nodes_before = len(status0.nodes)
        log: list[Submission] = []
        drivers: list[asyncio.Task] = []
        stop_load = asyncio.Event()
        keeper = asyncio.create_task(self._keep_load(fault, log, drivers, stop_load))
        t_fault = None
        try:
            if fault.point is not None:
                self.launcher.arm(fault.target, fault.spec)
            t_fault = await self._inject(fault, victim, log)
            if t_fault is None:
                res.outcome = ("failpoint never fired" if fault.point is not None else
                               f"{fault.target} never held a request in flight within "
                               f"{FIRE_WITHIN_S:g} s: not signalled")
                self.launcher.arm(fault.target, "")
            else:
                res.fired, res.t_fault_s = True, t_fault - t0
                t_back = await self._bring_back(fault, victim)
                if victim.service == "scheduler":
                    c0 = {}                 # a restarted scheduler counts from 0
                await self._rejoined(fault.target, res)
                res.recovery_s = await self._recovery(fault, t_back)
            stop_load.set()
            await keeper
            await asyncio.wait_for(asyncio.gather(*drivers), (DEADLINE_S + LATE_S) * 5)
        finally:
            stop_load.set()
            for d in [keeper, *drivers]:
                d.cancel()
            await asyncio.gather(keeper, *drivers, return_exceptions=True)
        await self._judge(res, log, t_fault, c0)
        res.wall_s = time.monotonic() - t0
        return res

    async def _keep_load(self, fault: Fault, log: list[Submission], drivers: list,
                         stop: asyncio.Event) -> None:
        """The case's replay, then more small ones, until the case says stop: requests are
        in flight when the fault hits and while the victim comes back."""
        first = True
        while not stop.is_set():
            if all(d.done() for d in drivers):
                self._seed += 1
                agents, turns = (fault.agents, fault.turns) if first else (2, 3)
                first = False
                drivers.append(asyncio.create_task(drive(
                    self.launcher.state.scheduler, self._seed, agents, turns, log, self.rpc,
                    self.block_tokens)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)

    async def _inject(self, fault: Fault, victim: Proc, log: list[Submission]) -> float | None:
        """Wait for the failpoint to act (or act from outside); the time it did, or None."""
        if fault.point is None:
            await asyncio.sleep(fault.after_s)     # the fault's moment: not before this
            if not await self._until_holding(fault.target, log, FIRE_WITHIN_S):
                return None
            # no await since the check: a submission pending then is in flight at the signal
            _signal(victim.pid, signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
            t = time.monotonic()
            await self._wait_state(victim, fault.action, 5.0)
            return t
        want = {"kill": "dead", "stop": "stopped"}.get(fault.action)
        limit = time.monotonic() + FIRE_WITHIN_S
        while time.monotonic() < limit:
            if want is not None and self._state(victim) == want:
                return time.monotonic()
            if want is None and f"FAILPOINT {fault.point} {fault.action}" in \
                    self.launcher.log_tail(fault.target, 400):    # it runs on: see its log
                return time.monotonic()
            await asyncio.sleep(0.02)
        return None

    async def _until_holding(self, name: str, log: list[Submission], timeout: float) -> bool:
        """Until ``name`` demonstrably holds work in flight, or False after ``timeout``: a
        signal from outside must hit a request, not an idle moment of a loaded host.

        Held: the victim's own count of live work (``attempts_live`` of a node service,
        ``requests_live`` of the scheduler; a gateway has none) is ≥ 1 in the reply just
        read, and a submission of the load is still unanswered. Returns right after that
        reply, so the caller signals within the same event-loop step: that submission is in
        flight at the signal (the case's ``affected`` ≥ 1). A stats call that got no answer
        is not "busy" — it is asked again (the old wait took it as busy and could kill an
        idle node)."""
        service = self.launcher.state.proc(self.node_of(name)).service
        key = {"de_loader": "attempts_live", "pe_receiver": "attempts_live",
               "scheduler": "requests_live"}.get(service)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(s.outcome == "pending" for s in log):
                st = await self.stats(name, timeout=2.0)
                if st is not None and (key is None or st.get(key, 0) >= 1) and \
                        any(s.outcome == "pending" for s in log):
                    return True
            await asyncio.sleep(0.02)
        return False

    def _state(self, p: Proc) -> str:
        pop = self.launcher.popen(p.name)
        if pop is not None and pop.poll() is not None:
            return "dead"
        try:
            stat = Path(f"/proc/{p.pid}/stat").read_text()
        except OSError:
            return "dead"
        s = stat[stat.rindex(")") + 2]
        return {"T": "stopped", "t": "stopped", "Z": "dead", "X": "dead"}.get(s, "running")

    async def _wait_state(self, p: Proc, action: str, timeout: float) -> None:
        want = "dead" if action == "kill" else "stopped"
        end = time.monotonic() + timeout
        while self._state(p) != want and time.monotonic() < end:
            await asyncio.sleep(0.02)

    async def _bring_back(self, fault: Fault, victim: Proc) -> float:
        """Restart a killed victim / SIGCONT a paused one; returns when it was back."""
        if fault.action in ("partition", "latency"):
            await asyncio.sleep(fault.pause_s)      # a partition heals by itself
            self.launcher.arm(fault.target, "")    # the disk is fast again
            return time.monotonic()
        self.launcher.fp_file(fault.target).write_text("")
        if fault.action == "stop":
            await asyncio.sleep(fault.pause_s)
            _signal(victim.pid, signal.SIGCONT)
            return time.monotonic()
        t = time.monotonic()
        await asyncio.to_thread(self.launcher.restart, fault.target)
        self.echo(f"   restarted {fault.target} in {time.monotonic() - t:.1f} s")
        return t

    async def _recovery(self, fault: Fault, t_back: float) -> float | None:
        """Seconds from ``t_back`` until a transfer went through the victim again (after it
        rejoined: a paused process's counters keep what it did before)."""
        name = self.node_of(fault.target)     # an engine process: its node's transfers
        keys = RECOVERY_COUNTERS[self.launcher.state.proc(name).service]
        # a restarted process counts from 0; a paused one, or the node of a restarted engine,
        # from what it showed when the victim came back
        base = 0.0 if fault.action == "kill" and name == fault.target else None
        end = time.monotonic() + DEADLINE_S * 2
        while time.monotonic() < end:
            st = await self.stats(name, timeout=1.0)
            if st is not None:
                total = sum(st.get(k, 0.0) for k in keys)
                if base is None:
                    base = total
                elif total > base:
                    return time.monotonic() - t_back
            await asyncio.sleep(0.05)
        return None

    async def _rejoined(self, name: str, res: CaseResult) -> None:
        """A node service registered again with a new epoch; a gateway answers again."""
        p = self.launcher.state.proc(name)
        end = time.monotonic() + 20.0
        while time.monotonic() < end:
            if p.service == "engine_sim":        # every engine attached to its node again
                st = await self.stats(name)
                if st is not None and st.get("engine_api_engines_attached") == len(p.engines):
                    res.rejoined = True
                    return
            elif p.service == "scheduler":    # back at its address, every node registered again
                with contextlib.suppress(DualpathError, OSError):
                    if len((await self.status()).nodes) >= self._nodes_before:
                        res.rejoined = True
                        return
            elif p.service == "gateway":
                if self._state(p) == "running" and await self.stats(name) is not None:
                    res.rejoined = True
                    return
            else:
                e = await self.epoch(name)
                if e is not None and e != res.old_epoch:
                    res.rejoined, res.new_epoch = True, e
                    return
            await asyncio.sleep(0.1)

    async def _judge(self, res: CaseResult, log: list[Submission], t_fault: float | None,
                     c0: dict[str, int]) -> None:
        res.submissions = len(log)
        res.finished = sum(s.outcome == "finished" for s in log)
        res.failed_retryable = sum(s.outcome == "failed" and not s.lost for s in log)
        lost = [s for s in log if s.lost]
        res.lost = len(lost)
        res.lost_detail = [f"{s.request_id}: {s.outcome} {s.code or ''} "
                           f"retryable={s.retryable} output_ok={s.output_ok}: {s.message}"
                           for s in lost][:20]
        if t_fault is not None:
            res.affected = sum(1 for s in log if s.outcome != "finished" or s.attempts > 1
                               or (s.t_start <= t_fault and (s.t_end or 1e18) >= t_fault))
        res.quiet_s = await self._quiet(t_fault)
        c1 = (await self.status()).counters
        res.replans = c1.get("replans", 0) - c0.get("replans", 0)
        res.leases_expired = c1.get("leases_expired", 0) - c0.get("leases_expired", 0)
        leaks, mismatches, res.orphaned_pages = await self._leaks()
        res.victim_leaked_pages = leaks.pop(res.target, 0) or 0
        res.unreachable = sorted(n for n, v in leaks.items() if v is None)
        res.unreachable_logs = {n: self.launcher.log_tail(n) for n in res.unreachable}
        res.leaked_pages = {n: v for n, v in leaks.items() if v is not None}
        res.prompt_mismatches = mismatches
        if not res.outcome:
            res.outcome = (f"{res.finished}/{res.submissions} finished, "
                           f"{res.failed_retryable} retryable failures (resubmitted), "
                           f"{res.replans} re-plans, lost {res.lost}, leaked "
                           f"{res.leaked_total} pages")

    async def _quiet(self, t_fault: float | None) -> float | None:
        """Until no request is live and every node pool is free; seconds since the fault, or
        None if that never happened. Waits past every deadline (``DEADLINE_S + LATE_S``): a
        page an attempt still holds then is leaked — before that it may be an attempt that
        ends at its deadline, which the outcome shows as a long ``quiet_s``."""
        start = t_fault if t_fault is not None else time.monotonic()
        end = time.monotonic() + DEADLINE_S + LATE_S
        while time.monotonic() < end:
            st = await self.status()
            self.not_quiet = {"requests": dict(st.requests)}
            if not any(st.requests.values()):
                leaks, _, _ = await self._leaks()
                self.not_quiet["pages_held"] = leaks
                if all(v == 0 for v in leaks.values()):
                    self.not_quiet = {}
                    return time.monotonic() - start
            await asyncio.sleep(0.2)
        return None

    async def _leaks(self) -> tuple[dict[str, int | None], int, dict[str, int]]:
        """Pages not free per service (every ``*_pages_total`` pool), prompt/hit mismatches,
        and per node the pages of those no live attempt owns (its ``pages_orphaned``: leaked
        for good, not held by a stuck attempt)."""
        out, mismatches, orphaned = {}, 0, {}
        names = [p.name for p in self.launcher.state.procs
                 if p.service not in ("scheduler", "engine_sim")]     # engines hold no pool
        got = await asyncio.gather(*(self.stats(n) for n in names))
        # one more try for a survivor that did not answer: on a loaded 2-core host a connect +
        # handshake can miss one deadline; one that misses twice is reported unreachable
        got = [st if st is not None else await self.stats(n, timeout=10.0)
               for n, st in zip(names, got)]
        for name, st in zip(names, got):
            if st is None:
                out[name] = None            # unreachable: reported, never counted as clean
                continue
            out[name] = int(sum(v - st.get(k[:-len("total")] + "free", v)
                                for k, v in st.items() if k.endswith("_pages_total")))
            if st.get("pages_orphaned"):
                orphaned[name] = int(st["pages_orphaned"])
            mismatches += int(st.get("engine_prompt_mismatches", 0)
                              + st.get("engine_hit_mismatches", 0))
        return out, mismatches, orphaned


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
