"""Local launcher: every service of a cluster as a subprocess on loopback, then stop by pid.

``up``: preflight (fixed ports free, memory fits, P/D window warning), write the effective
cluster file (mode applied, paths absolute) to ``<data_dir>/<name>/cluster.toml``, then start
in three waves, each waited for before the next (a ready file per service, process alive):

1. one storage gateway per node (they share ``storage_root``);
2. the scheduler, its hit lookup given every gateway (asked in turn, the next on a failure);
3. per node the PE receiver / DE loader with its emulated engines, given the scheduler's and
   its gateway's ports (with ``[cluster] remote_engines`` the engines run in a fourth wave,
   one ``dualpath serve engine_sim`` process per node attached over the node's engine socket;
   with ``[cluster] engine = "vllm"`` instead a vLLM OpenAI server per engine, and once every
   node holds a lease the OpenAI front: :mod:`.real_engines`);

and polls the scheduler until every node service holds a lease. The state file
(``state.json``: pids with their kernel start times, ports, log paths) is rewritten after each
wave, so ``down`` can stop a half-started cluster. A service that fails to start makes ``up``
stop the others and raise :class:`LaunchError` carrying that service's log tail.

``down``: SIGTERM every live pid of the state file (front, vLLM instances — their whole process
group —, node services, scheduler, gateways), wait ``stop_grace_s``, SIGKILL what is left,
unlink the ``/dev/shm`` segments the vLLM instances left, remove the state file. A pid whose start time differs
from the recorded one belongs to someone else now and is left alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError, DualpathError

from tools.proc_group import group_files, group_pids, private_ipc_env, remove_files

from . import real_engines
from .config import (ROLE_SERVICE, Cluster, check_local_resources, check_ports_free,
                     free_port, pd_warning)
from .toml_write import dumps

STATE_FILE = "state.json"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1"}


class LaunchError(DualpathError):
    """A service did not start; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


@dataclass
class Proc:
    """One started service (what the state file records)."""

    name: str
    service: str
    node: str
    pid: int
    start_ticks: int
    log: str
    ready_file: str
    host: str = "127.0.0.1"
    rpc_port: int | None = None
    ucx_port: int | None = None
    metrics_port: int | None = None
    engines: list[str] = field(default_factory=list)
    url: str | None = None                  # a vLLM instance's / the front's HTTP endpoint
    left_files: list[str] = field(default_factory=list)  # its group's /dev/shm files, sockets
    ipc_dir: str = ""                       # a vLLM instance's IPC socket directory


@dataclass
class State:
    cluster: str
    config: str
    mode: str | None
    state_dir: str
    storage_root: str
    started_at: float
    procs: list[Proc] = field(default_factory=list)
    ready: bool = False

    @property
    def scheduler(self) -> tuple[str, int]:
        p = self.proc("scheduler")
        return p.host, int(p.rpc_port)

    def proc(self, name: str) -> Proc:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(name)

    def gateways(self) -> dict[str, tuple[str, int]]:
        return {p.node: (p.host, int(p.rpc_port)) for p in self.procs if p.service == "gateway"}

    def instance_urls(self) -> dict[str, str]:
        """Engine id -> URL of every vLLM instance (what the front is given)."""
        return {p.name.split(":", 1)[1]: str(p.url) for p in self.procs if p.service == "vllm"}

    def node_services(self) -> dict[str, tuple[str, int]]:
        return {p.node: (p.host, int(p.rpc_port)) for p in self.procs
                if p.service in ("pe_receiver", "de_loader")}

    def save(self) -> None:
        path = Path(self.state_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, state_dir: str | Path) -> State | None:
        path = Path(state_dir) / STATE_FILE
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise DualpathError(f"unreadable state file {path}: {e}") from e
        for p in d.get("procs", []):
            p.pop("shm", None)          # written before 2026-12-06 (now left_files), always []
        d["procs"] = [Proc(**p) for p in d.get("procs", [])]
        return cls(**d)


# --------------------------------------------------------------------------- process identity

def proc_start_ticks(pid: int) -> int | None:
    """The kernel start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def proc_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) ``pid`` has used so far; OSError if it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(p: Proc) -> bool:
    return proc_start_ticks(p.pid) == p.start_ticks


# --------------------------------------------------------------------------- up

class Launcher:
    """Starts and stops the services of one cluster as subprocesses."""

    def __init__(self, cluster: Cluster, *, python: str | None = None,
                 echo: Any = None) -> None:
        self.cluster = cluster
        self.python = python or sys.executable
        self.echo = echo or (lambda msg: None)
        c = cluster.spec
        self.state_dir = c.state_dir().resolve()
        self.log_dir = self.state_dir / "logs"
        self._popen: dict[str, subprocess.Popen] = {}
        self.removed_files: list[str] = []   # what `down` unlinked of vLLM's (shm, sockets)
        self.state: State | None = None

    def is_local(self) -> bool:
        return {self.cluster.spec.node_host(n) for n in self.cluster.spec.nodes} <= LOCAL_HOSTS

    def preflight(self) -> None:
        """Everything checkable before a process starts; ConfigError names the problem."""
        old = State.load(self.state_dir)
        if old is not None and any(alive(p) for p in old.procs):
            raise ConfigError(f"cluster {old.cluster!r} is already running (state file "
                              f"{self.state_dir / STATE_FILE}); run `dualpath cluster down"
                              f" -c ...` first")
        hosts = {self.cluster.spec.node_host(n) for n in self.cluster.spec.nodes}
        if not hosts <= LOCAL_HOSTS:
            raise ConfigError(f"{self.cluster.source}: `cluster up` starts every service on "
                              f"this machine, but nodes name hosts {sorted(hosts - LOCAL_HOSTS)}"
                              " — run `dualpath serve` on each node instead (docs/deploy.md)")
        check_ports_free(self.cluster)
        check_local_resources(self.cluster)
        warning = pd_warning(self.cluster)
        if warning:
            self.echo(f"warning: {warning}")

    def up(self) -> State:
        self.preflight()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        c = self.cluster.spec
        cfg_path = self._write_effective()
        self.state = State(c.name, str(cfg_path), self.cluster.mode, str(self.state_dir),
                           str(c.storage_dir().resolve()), time.time())
        try:
            self._wave([self._argv("gateway", n.id) for n in c.nodes])
            self._wave([self._argv("scheduler", None, self._lookup_gateways())])
            sched = self.state.proc("scheduler")
            self._wave([self._argv(ROLE_SERVICE[n.role], n.id,
                                   ["--scheduler", f"{sched.host}:{sched.rpc_port}",
                                    "--gateway-port",
                                    str(self.state.proc(f"gateway:{n.id}").rpc_port)])
                        for n in c.nodes])
            if c.engine == "vllm":        # real engines on the nodes' sockets, then the front
                model = real_engines.resolve_model(self.cluster)
                self._wave(real_engines.instance_commands(self.cluster, model),
                           c.engine_start_timeout_s)
                self._wait_registered()
                self._wave([real_engines.front_command(self.cluster, model,
                                                       self.state.scheduler,
                                                       self.state.instance_urls())])
            else:
                if c.remote_engines:      # each node's emulated engines in their own process
                    self._wave([self._argv("engine_sim", n.id) for n in c.nodes])
                self._wait_registered()
        except BaseException:
            self.down()
            raise
        self.state.ready = True
        self.state.save()
        return self.state

    def restart(self, name: str) -> Proc:
        """Start service ``name`` of the running cluster again after it died (or was killed),
        on the port it had — what a supervisor (systemd, Kubernetes) does: its peers find it
        where they knew it. Node services re-register; a vLLM instance loads again."""
        state = self.state = self.state or State.load(self.state_dir)
        if state is None:
            raise ConfigError(f"cluster {self.cluster.spec.name} is not running")
        old = state.proc(name)
        if _running(old):
            raise ConfigError(f"{name} is still running (pid {old.pid}): stop it first")
        state.procs.remove(old)
        if old.ipc_dir:                  # the dead instance's sockets; the new one gets its own
            remove_files({old.ipc_dir})
        cmd = self._command_again(old)
        self._wave([cmd], self.cluster.spec.engine_start_timeout_s
                   if old.service == "vllm" else None)
        if old.service in ("pe_receiver", "de_loader", "scheduler"):
            self._wait_registered()
        return state.proc(name)

    def reconfigure(self, cluster: Cluster, names: list[str],
                    between: Any = None) -> None:
        """Run services ``names`` of the running cluster on a changed config ``cluster`` —
        another scheduler policy, another storage-link rate; the same nodes, ports and engines
        (checked) — while the rest keeps running: the effective file every service reads is
        rewritten, ``names`` are stopped (SIGTERM, SIGKILL after the grace), ``between()`` runs
        while they are down (e.g. the storage emptied), then they start again where they were,
        gateways first. How ``bench engine_agents`` switches modes without reloading its vLLM
        instances."""
        state = self.state = self.state or State.load(self.state_dir)
        if state is None:
            raise ConfigError(f"cluster {self.cluster.spec.name} is not running")
        old, new = self.cluster.spec, cluster.spec
        same = ([(n.id, n.role) for n in old.nodes] == [(n.id, n.role) for n in new.nodes]
                and (old.engine, old.data_dir, old.storage_root)
                == (new.engine, new.data_dir, new.storage_root))
        if not same:
            raise ConfigError(f"{cluster.source}: reconfigure keeps the nodes, engine and "
                              "directories of the running cluster; run `cluster down` + `up`")
        procs = [state.proc(name) for name in names]
        self.cluster = cluster
        self._write_effective()
        stop_procs(procs, self.cluster.spec.stop_grace_s)
        for p in procs:
            popen = self._popen.get(p.name)
            if popen is not None:
                popen.wait()
        if between is not None:
            between()
        for p in sorted(procs, key=lambda p: -_STOP_ORDER.get(p.service, 3)):
            self.restart(p.name)

    def _command_again(self, old: Proc) -> real_engines.Command:
        state = self.state
        assert state is not None
        if old.service in GROUPS:
            model = real_engines.resolve_model(self.cluster)
            if old.service == "front":
                return real_engines.front_command(self.cluster, model, state.scheduler,
                                                  state.instance_urls(),
                                                  port=real_engines.url_port(str(old.url)))
            engine = old.name.split(":", 1)[1]
            return next(c for c in real_engines.instance_commands(
                self.cluster, model, {engine: real_engines.url_port(str(old.url))})
                if c.name == old.name)
        port = ["--port", str(old.rpc_port)]
        if old.service == "scheduler":
            return self._argv("scheduler", None, self._lookup_gateways() + port)
        if old.service in ("gateway", "engine_sim"):
            return self._argv(old.service, old.node, port if old.service == "gateway" else [])
        sched = state.proc("scheduler")
        return self._argv(old.service, old.node,
                          ["--scheduler", f"{sched.host}:{sched.rpc_port}", "--gateway-port",
                           str(state.proc(f"gateway:{old.node}").rpc_port)] + port)

    def _lookup_gateways(self) -> list[str]:
        """``--lookup-gateway`` for every gateway started: the scheduler's hit lookup asks any
        of them (the store is shared) and goes on to the next when one fails."""
        gateways = [self.state.proc(f"gateway:{n.id}") for n in self.cluster.spec.nodes]
        return ["--lookup-gateway",
                ",".join(f"{p.node}={p.host}:{p.rpc_port}" for p in gateways)]

    def _write_effective(self) -> Path:
        """The cluster file every child reads: mode applied, relative paths made absolute."""
        c = self.cluster.spec
        data = json.loads(json.dumps(self.cluster.data))      # deep copy of plain data
        sect = data.setdefault("cluster", {})
        sect["data_dir"] = str(Path(c.data_dir).resolve())
        sect["storage_root"] = str(c.storage_dir().resolve())
        if "name" not in sect:
            sect["name"] = c.name
        c.storage_dir().resolve().mkdir(parents=True, exist_ok=True)
        path = self.state_dir / "cluster.toml"
        path.write_text(f"# effective config of cluster {c.name!r} (mode: "
                        f"{self.cluster.mode or 'as configured'}), from {self.cluster.source}\n"
                        + dumps(data))
        return path

    def _argv(self, service: str, node: str | None, extra: list[str] | None = None
              ) -> real_engines.Command:
        c = self.cluster.spec
        name = service if node is None else f"{service}:{node}"
        argv = [self.python, "-m", "tools.cluster.serve", service, "-c", self.state.config]
        if node is not None:
            argv += ["--node", node]
        extra = extra or []
        if "--port" not in extra:
            argv += self._rpc_port(service, node)
        if c.metrics and c.metrics_port(service, node) is None:
            # 0: the service binds any free port and reports it in its ready file; a port
            # picked here and bound there can be taken in between (seen: a de_loader exited
            # "Address already in use" while another test started services)
            argv += ["--metrics-port", "0"]
        return real_engines.Command(name, service, node or "scheduler", argv + extra, {}, None)

    def _rpc_port(self, service: str, node: str | None) -> list[str]:
        """``--port`` for a service whose port the cluster file leaves open: picked below the
        kernel's ephemeral range (``free_port``). ``restart`` binds a killed service's old port
        again; one the kernel had handed out (bound at 0) could meanwhile be any outgoing
        connection's local port, and the restart failed "address already in use" (ci123)."""
        c = self.cluster.spec
        if service not in ("scheduler", "gateway", "pe_receiver", "de_loader") \
                or c.rpc_port(service, node):
            return []                   # no control port of its own (engine_sim), or fixed
        return ["--port", str(free_port(c.service_host(service, node)))]

    def _wave(self, items: list[real_engines.Command], timeout_s: float | None = None) -> None:
        started = [self._spawn(cmd) for cmd in items]
        self.state.save()
        timeout_s = timeout_s or self.cluster.spec.start_timeout_s
        deadline = time.monotonic() + timeout_s
        pending = list(started)
        while pending:
            for p in list(pending):
                if self._ready(p):
                    pending.remove(p)
                    self.echo(f"  {p.name:<22} pid {p.pid:<7} " + (
                        p.url if p.url else f"rpc {p.host}:{p.rpc_port}")
                        + (f"  metrics :{p.metrics_port}" if p.metrics_port else ""))
            if pending and time.monotonic() > deadline:
                p = pending[0]
                raise LaunchError(f"{p.name} did not become ready within "
                                  f"{timeout_s:.0f} s (log: {p.log})", tail(p.log))
            if pending:
                time.sleep(0.05 if all(p.ready_file for p in pending) else 0.5)
        self.state.save()

    def _spawn(self, cmd: real_engines.Command) -> Proc:
        """Start ``cmd`` in its own session, its output appended to its log. Our services are
        told a ready file; a vLLM instance or the front is ready when its URL answers."""
        name, argv = cmd.name, cmd.argv
        safe = name.replace(":", "-")
        log = self.log_dir / f"{safe}.log"
        ready = self.state_dir / f"{safe}.ready" if cmd.service in SERVICES else None
        # PYTHONNODEBUGRANGES: Python 3.11's tracebacks race in the ast module across threads
        # (docs/deploy.md, "Python 3.11"); a caller's own setting wins
        env = {"PYTHONNODEBUGRANGES": "1", **os.environ, **cmd.env}
        if cmd.service == "vllm":       # its ZeroMQ socket files, removed with it (down)
            env.update(private_ipc_env())
        if ready is not None:
            ready.unlink(missing_ok=True)
            argv = argv + ["--ready-file", str(ready)]
        with open(log, "ab") as out:
            out.write(f"\n==== {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True, cwd=os.getcwd(), env=env)
        self._popen[name] = proc
        ticks = proc_start_ticks(proc.pid) or 0
        p = Proc(name, cmd.service, cmd.node, proc.pid, ticks, str(log),
                 str(ready) if ready else "", url=cmd.url,
                 ipc_dir=env.get("VLLM_RPC_BASE_PATH", "") if cmd.service == "vllm" else "")
        self.state.procs.append(p)
        return p

    def _ready(self, p: Proc) -> bool:
        popen = self._popen.get(p.name)
        if popen is not None and popen.poll() is not None:
            raise LaunchError(f"{p.name} exited with status {popen.returncode} while starting "
                              f"(log: {p.log})", tail(p.log))
        if p.service == "vllm":
            from tools.vllm_serve import healthy
            return healthy(str(p.url))
        if p.service == "front":
            p.url = real_engines.front_url(p.log)
            return p.url is not None
        try:
            info = json.loads(Path(p.ready_file).read_text())
        except (FileNotFoundError, ValueError):
            return False
        p.host = info.get("host") or p.host
        p.rpc_port, p.ucx_port = info.get("rpc_port"), info.get("ucx_port")
        p.metrics_port, p.engines = info.get("metrics_port"), info.get("engines") or []
        return True

    def _wait_registered(self) -> None:
        """Poll the scheduler until every PE receiver / DE loader holds a lease (on a restart,
        every one that runs: another may be down, waiting for its own restart). A status call
        that times out or finds the scheduler unreachable is tried again until the start
        timeout: on a loaded host one reply can take longer than its 5 s (ci82: the whole VM
        stood still ~3.5 s while three vLLM servers ran)."""
        from services.scheduler.client.client import SyncSchedulerClient
        nodes = [p for p in self.state.procs if p.service in ("pe_receiver", "de_loader")
                 and (not self.state.ready or alive(p))]
        want = {p.node for p in nodes}
        host, port = self.state.scheduler
        deadline = time.monotonic() + self.cluster.spec.start_timeout_s
        with SyncSchedulerClient(host, port, rpc=self.cluster.cfg.rpc,
                                 client_id="launcher") as client:
            while True:
                try:
                    status = client.cluster_status(timeout=5.0)
                except DualpathError as e:
                    if not e.retryable or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)         # the scheduler was slow or away: ask again
                    continue
                have = {n.node_id for n in status.nodes if n.engines}
                if want <= have:
                    return
                for p in nodes:
                    self._ready(p)               # a node that died while registering
                if time.monotonic() > deadline:
                    missing = sorted(want - have)
                    p = self.state.proc(next(x.name for x in self.state.procs
                                             if x.node == missing[0] and x.service != "gateway"))
                    raise LaunchError(f"node services {missing} did not register with the "
                                      f"scheduler within {self.cluster.spec.start_timeout_s:.0f}"
                                      f" s (log: {p.log})", tail(p.log))
                time.sleep(0.05)

    def down(self) -> list[str]:
        state = self.state or State.load(self.state_dir)
        if state is None:
            return []
        engines = [e for e in state.procs if e.service in GROUPS and alive(e)]
        for e in engines:                # what vLLM maps now, to unlink what it leaves
            e.left_files = sorted(group_files(e.pid))
        stopped = stop_procs(state.procs, self.cluster.spec.stop_grace_s)
        self.removed_files = remove_files({s for e in engines for s in e.left_files}
                                          | {p.ipc_dir for p in state.procs if p.ipc_dir})
        for p in self._popen.values():
            if p.poll() is None:      # pragma: no cover - stop_procs killed it already
                p.kill()
            p.wait()
        (Path(state.state_dir) / STATE_FILE).unlink(missing_ok=True)
        for proc in state.procs:
            if proc.ready_file:
                Path(proc.ready_file).unlink(missing_ok=True)
        self.state = None
        return stopped


_STOP_ORDER = {"front": -3, "vllm": -2, "engine_sim": -1, "pe_receiver": 0, "de_loader": 0,
               "scheduler": 1, "gateway": 2}
SERVICES = {"gateway", "scheduler", "pe_receiver", "de_loader", "engine_sim"}  # dualpath serve
GROUPS = {"vllm", "front"}      # signalled as a process group: vLLM's engine core is a child
ENGINE_GRACE_S = 30.0           # vLLM's graceful shutdown (engine core, its shm queues)


def stop_procs(procs: list[Proc], grace_s: float) -> list[str]:
    """SIGTERM in order (front, vLLM instances, node services, scheduler, gateways), SIGKILL
    after ``grace_s`` (vLLM's own shutdown gets at least ``ENGINE_GRACE_S``). A vLLM instance or
    the front is stopped when no process of its group is left (its engine core included)."""
    live = [p for p in sorted(procs, key=lambda p: _STOP_ORDER.get(p.service, 3)) if alive(p)]
    for p in live:
        _signal(p, signal.SIGTERM)
    grace = {p.name: max(grace_s, ENGINE_GRACE_S) if p.service in GROUPS else grace_s
             for p in live}
    start = time.monotonic()
    while True:
        running = [p for p in live if _running(p)]
        for p in running:
            if time.monotonic() - start > grace[p.name]:
                _signal(p, signal.SIGKILL)
        if not running or time.monotonic() - start > max(grace.values(), default=0) + 5.0:
            break
        time.sleep(0.05)
    return [p.name for p in live]


def _running(p: Proc) -> bool:
    if p.service in GROUPS:
        return alive(p) or bool(group_pids(p.pid))
    return alive(p)


def _signal(p: Proc, sig: signal.Signals) -> None:
    try:
        if p.service in GROUPS:       # its own session (start_new_session): the group is ours
            os.killpg(p.pid, sig)
        else:
            os.kill(p.pid, sig)
    except ProcessLookupError:
        pass


def tail(path: str | Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a service log's latest run (after its ``====`` header)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    run = text.rsplit("\n==== ", 1)[-1]
    return "\n".join(run.splitlines()[-lines:])


def load_state_or_none(cluster: Cluster) -> State | None:
    return State.load(cluster.spec.state_dir().resolve())


def endpoints_table(state: State) -> str:
    rows = [f"cluster {state.cluster} (mode {state.mode or 'as configured'}); "
            f"state {Path(state.state_dir) / STATE_FILE}; storage {state.storage_root}"]
    for p in state.procs:
        extra = f" metrics http://{p.host}:{p.metrics_port}/metrics" if p.metrics_port else ""
        where = p.url or f"{p.host}:{p.rpc_port}"
        rows.append(f"  {p.name:<22} pid {p.pid:<7} {where}{extra}")
    host, port = state.scheduler
    rows.append(f"frontend RPC: {host}:{port}  (services.scheduler.client.client.SchedulerClient)")
    front = next((p for p in state.procs if p.service == "front"), None)
    if front is not None:
        rows.append(f"OpenAI API: {front.url}/v1  (completions, chat; docs/vllm.md)")
    return "\n".join(rows)
