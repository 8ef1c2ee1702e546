"""``tests/transport_peer.py`` (a PageTransport in its own process) driven from a test: the
harness the transport tests share (``test_transport``, ``test_transport_shm``,
``test_transport_rma_path``), and their slot layouts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class PeerProc:
    """``tests/transport_peer.py`` in a subprocess; ``await request(op, ...)`` → reply."""

    def __init__(self, cfg: dict) -> None:
        env = {**os.environ, "DUALPATH_TEST_TRANSPORT": json.dumps(cfg)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.transport_peer"], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._lock = threading.Lock()
        self._futures: dict[tuple[int, str], concurrent.futures.Future] = {}
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = self._ready.result(timeout=60)
        self.address, self.pid = tuple(ready["address"]), ready["pid"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:     # UCX-Py logs to stdout too ("[ts] [host:pid] UCXPY ERROR ..."): skip it
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            if msg.get("event") == "ready":
                self._ready.set_result(msg)
                continue
            key = (msg["id"], "posted" if msg.get("event") == "posted" else "done")
            with self._lock:
                fut = self._futures.pop(key, None)
            if fut is not None:
                fut.set_result(msg)
        with self._lock:
            pending, self._futures = list(self._futures.values()), {}
        for fut in [self._ready, *pending]:
            if not fut.done():
                fut.set_exception(ConnectionError("transport peer exited"))

    def call(self, op: str, **kw) -> dict[str, concurrent.futures.Future]:
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            futs = {k: concurrent.futures.Future() for k in ("posted", "done")}
            self._futures.update({(rid, k): f for k, f in futs.items()})
        self.proc.stdin.write(json.dumps({"id": rid, "op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return futs

    async def request(self, op: str, **kw) -> dict:
        return await asyncio.wrap_future(self.call(op, **kw)["done"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("exit")
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def gapped(count: int, size: int, gap: int = 4096) -> list[tuple[int, int]]:
    return [(i * (size + gap), size) for i in range(count)]
