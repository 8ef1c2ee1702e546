"""Real etcd members for tests and benchmarks: 127.0.0.1, free ports, a temp data dir each.

``EtcdMembers(tmp, n).start()`` launches ``n`` members of one cluster (Debian ``etcd-server``,
``make etcd``) and waits until every one answers a health check; ``kill(i)`` SIGKILLs one,
``restart(i)`` brings it back on its ports and data; ``stop()`` ends them all, by pid;
``raft_leader()`` says which member etcd's own raft elected (its loss costs an election).
``etcd_missing()`` says why etcd cannot run here (tests skip loudly on it, and fail under
``CI=true``: ``tests.helpers.require_etcd``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from tools.cluster.config import free_port


def etcd_missing() -> str | None:
    """Why etcd cannot be started here (None: it can)."""
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        return "etcd is not installed (`make etcd` installs Debian's etcd-server and etcd-client)"
    return None


class EtcdMembers:
    """``n`` etcd members of one cluster, started and stopped by this object only."""

    def __init__(self, root: Path, n: int = 1) -> None:
        self.root = Path(root)
        self.n = n
        self.client_ports = [free_port() for _ in range(n)]
        self.peer_ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def _argv(self, i: int) -> list[str]:
        cluster = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
        c, p = self.client_ports[i], self.peer_ports[i]
        return ["etcd", "--name", f"m{i}", "--data-dir", str(self.root / f"m{i}"),
                "--listen-client-urls", f"http://127.0.0.1:{c}",
                "--advertise-client-urls", f"http://127.0.0.1:{c}",
                "--listen-peer-urls", f"http://127.0.0.1:{p}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"dualpath-test-{os.getpid()}",
                "--heartbeat-interval", "100", "--election-timeout", "1000",
                # warnings name what made etcd slow ("apply request took too long", "slow
                # fdatasync", "failed to send out heartbeat on time"): a test failing on an
                # unanswered etcd shows them in its log dump (docs/contributing.md flakes)
                "--logger", "zap", "--log-level", "warn"]

    def _spawn(self, i: int) -> None:
        log = open(self.root / f"m{i}.log", "ab")
        self.procs[i] = subprocess.Popen(self._argv(i), stdout=log, stderr=log)
        log.close()

    def start(self, timeout_s: float = 30.0) -> EtcdMembers:
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            self._spawn(i)
        self.wait_healthy(range(self.n), timeout_s)
        return self

    def healthy(self, i: int) -> bool:
        r = subprocess.run(["etcdctl", "--endpoints", self.endpoints[i], "--dial-timeout=1s",
                            "endpoint", "health"], capture_output=True,
                           env={**os.environ, "ETCDCTL_API": "3"})
        return r.returncode == 0

    def raft_leader(self) -> int:
        """The index of the member that is etcd's raft leader (``etcdctl endpoint status``)."""
        r = subprocess.run(["etcdctl", "--endpoints", ",".join(self.endpoints),
                            "--dial-timeout=1s", "endpoint", "status", "-w", "json"],
                           capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"})
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl endpoint status failed: {r.stderr[-500:]}")
        members = {s["Endpoint"]: s["Status"] for s in json.loads(r.stdout)}
        for i, ep in enumerate(self.endpoints):
            st = members.get(ep) or members.get(f"http://{ep}")
            if st is not None and st["header"]["member_id"] == st["leader"]:
                return i
        raise RuntimeError(f"no etcd member reports itself raft leader: {r.stdout[-500:]}")

    def wait_healthy(self, members, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for i in members:
            while not self.healthy(i):
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"etcd member m{i} exited: "
                                       f"{(self.root / f'm{i}.log').read_text()[-2000:]}")
                if time.monotonic() > end:
                    raise RuntimeError(f"etcd member m{i} not healthy in {timeout_s}s")
                time.sleep(0.1)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, i: int, timeout_s: float = 30.0) -> None:
        self.kill(i)
        self._spawn(i)
        self.wait_healthy([i], timeout_s)

    def stop(self) -> None:
        for i in range(self.n):
            self.kill(i)

    def __enter__(self) -> EtcdMembers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
