"""Hosts as Linux namespaces: a private L2 network of "machines" on one box (issue #17 item 1).

Each :class:`Host` is a network namespace with one address on a veth whose other end hangs on
a bridge, plus its own UTS (hostname), IPC and mount namespace with a private ``/dev/shm`` —
what makes UCX treat two hosts as two machines (it keys "same node" on the hostname and finds
no shared memory segment to map: ``tools.hosts.ucx_lanes`` checks what it chose). The bridge
lives in a namespace the harness made (the "switch"), never in the machine's own namespace: no
interface there carries a harness address, so nothing in it routes to them and no harness
traffic leaves the switch. Addresses are from ``10.213.0.0/24`` only.

Every host has an *anchor*: a ``sleep`` process that holds its UTS/IPC/mount namespaces (made
with ``unshare`` inside the host's network namespace); services are started in them with
``nsenter -t ANCHOR``. Shared storage is a bind mount of one directory at the same path on
every host (what a distributed file system mount looks like to the services); a host made with
``storage=False`` has the mount point but not the mount.

Teardown (:meth:`HostNet.close`, also on an exception inside ``with``): every process started
through the harness is killed by pid (SIGTERM, then SIGKILL after a deadline), then the
anchors, then the namespaces (which removes their veths and the bridge). Namespace names carry
a per-run prefix, so parallel runs and other users' namespaces are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from common.errors import DualpathError

log = structlog.get_logger(__name__)

SUBNET = "10.213.0"        # the harness's private /24; host i gets SUBNET.(10 + i)
PREFIX_LEN = 24
STOP_DEADLINE_S = 10.0
SHM_BYTES = 512 * 2**20    # each host's private /dev/shm (tmpfs)


class NamespaceUnavailable(DualpathError):
    """Namespaces cannot be made here (not root, no ``ip``/``unshare``/``nsenter``)."""


def namespaces_available() -> tuple[bool, str]:
    """``(ok, reason)``: can this process make hosts? (Tests skip — or fail in CI — on False.)"""
    if os.geteuid() != 0:
        return False, "namespace hosts need root (ip netns, unshare, mount)"
    missing = [t for t in ("ip", "unshare", "nsenter", "mount") if shutil.which(t) is None]
    if missing:
        return False, f"missing tools: {', '.join(missing)}"
    probe = f"dpprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _run(*argv: str) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NamespaceUnavailable(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Host:
    """One namespace "machine": its name (= hostname), address and anchor process."""

    name: str
    netns: str
    address: str
    veth: str                         # the bridge-side end (in the switch namespace)
    root: Path                        # host-private files (etc/, logs/)
    anchor: subprocess.Popen[bytes] | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    def enter_argv(self) -> list[str]:
        """The argv prefix that runs a command inside this host's namespaces."""
        assert self.anchor is not None
        return ["nsenter", "-t", str(self.anchor.pid), "--net", "--uts", "--ipc", "--mount"]


class HostNet:
    """A bridge namespace plus ``n`` hosts; a context manager that always tears down."""

    def __init__(self, names: list[str], *, storage_on: set[str] | None = None,
                 base: Path | None = None) -> None:
        self.prefix = f"dp{os.getpid() % 100000}x{int(time.monotonic() * 1000) % 1000}"
        self.dir = Path(tempfile.mkdtemp(prefix="dualpath-hosts-", dir=base))
        self.store = self.dir / "store"                 # the "file system" every host mounts
        self.mount_point = self.dir / "mnt" / "kvstore"  # empty here; the mount is per host
        self.switch = f"{self.prefix}sw"
        self.hosts = {name: Host(name, f"{self.prefix}{name}", f"{SUBNET}.{10 + i}",
                                 f"{self.prefix}v{i}", self.dir / name)
                      for i, name in enumerate(names)}
        self.storage_on = set(names) if storage_on is None else storage_on
        self._made: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> HostNet:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        self.store.mkdir(parents=True)
        self.mount_point.mkdir(parents=True)
        self._netns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            self._make_host(host)
        log.info("hosts_up", prefix=self.prefix,
                 hosts={h.name: h.address for h in self.hosts.values()})

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _make_host(self, host: Host) -> None:
        self._netns(host.netns)
        _run("ip", "-n", self.switch, "link", "add", host.veth, "type", "veth",
             "peer", "name", "eth0", "netns", host.netns)
        _run("ip", "-n", self.switch, "link", "set", host.veth, "master", "br0", "up")
        _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", "eth0")
        _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
        (host.etc).mkdir(parents=True)
        (host.root / "logs").mkdir()
        mounts = [f"mount -t tmpfs -o size={SHM_BYTES} tmpfs /dev/shm",
                  f"hostname {host.name}"]
        if host.name in self.storage_on:
            mounts.append(f"mount --bind {self.store} {self.mount_point}")
        ready = host.root / "anchor.ready"
        script = " && ".join([*mounts, f"touch {ready}", "exec sleep infinity"])
        host.anchor = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--ipc", "--mount",
             "--propagation", "private", "--", "sh", "-c", script],
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while not ready.exists():
            if host.anchor.poll() is not None or time.monotonic() > deadline:
                raise NamespaceUnavailable(f"host {host.name}: anchor failed to start")
            time.sleep(0.02)

    def close(self) -> None:
        """Kill every process (by pid), then the anchors, then delete the namespaces."""
        for host in self.hosts.values():
            for proc in host.procs:
                stop_process(proc)
        for host in self.hosts.values():
            if host.anchor is not None:
                stop_process(host.anchor, sig=signal.SIGKILL)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
        if not os.environ.get("DUALPATH_KEEP_HOSTS_DIR"):     # set: logs kept for a post-mortem
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ use
    def spawn(self, host: str, argv: list[str], *, env: dict[str, str] | None = None,
              log_name: str | None = None, cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (stdout+stderr to its log file); tracked for teardown."""
        h = self.hosts[host]
        out = open(h.root / "logs" / f"{log_name or Path(argv[0]).name}.log", "ab")  # noqa: SIM115
        with out:
            proc = subprocess.Popen([*h.enter_argv(), "--", *argv], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=cwd, start_new_session=True)
        h.procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], *, env: dict[str, str] | None = None,
            timeout: float = 120.0, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to completion (output captured)."""
        return subprocess.run([*self.hosts[host].enter_argv(), "--", *argv], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s veth down (a partition: its cable pulled at the switch) or up."""
        _run("ip", "-n", self.switch, "link", "set", self.hosts[host].veth,
             "up" if up else "down")

    def kill_host(self, host: str) -> None:
        """Kill every process started on ``host`` (the machine dies; its namespaces stay)."""
        for proc in self.hosts[host].procs:
            stop_process(proc, sig=signal.SIGKILL)

    def log_text(self, host: str, name: str) -> str:
        path = self.hosts[host].root / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_names(self, host: str) -> list[str]:
        return sorted(p.stem for p in (self.hosts[host].root / "logs").glob("*.log"))


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM,
                 deadline_s: float = STOP_DEADLINE_S) -> None:
    """Signal ``proc`` by pid, wait up to ``deadline_s``, then SIGKILL; never raises."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=deadline_s)


def root_has_harness_route(subnet: str = SUBNET) -> bool:
    """True when an interface of *this* (the machine's) namespace carries a harness address."""
    return f" {subnet}." in _run("ip", "-o", "addr", "show")
