"""``tests/transport_peer.py`` (a PageTransport in its own process) driven from a test: the
harness the transport tests share (``test_transport``, ``test_transport_connect``,
``test_transport_shm``, ``test_transport_rma_path``), and their slot layouts."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


class OpEndedUnposted(RuntimeError):
    """The op replied its result before it ever posted (an expect whose connect failed)."""

    def __init__(self, reply: dict) -> None:
        super().__init__(f"the peer's op ended before posting: {reply}")
        self.reply = reply


class PeerProc:
    """``tests/transport_peer.py`` in a subprocess; ``await request(op, ...)`` → reply."""

    def __init__(self, cfg: dict) -> None:
        # the peer's info lines (connect retries, aborted endpoints) go to the test's captured
        # stderr, shown when a test fails
        env = {"DUALPATH_TEST_LOG": "info", **os.environ,
               "DUALPATH_TEST_TRANSPORT": json.dumps(cfg)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.transport_peer"], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._lock = threading.Lock()
        self._futures: dict[tuple[int, str], concurrent.futures.Future] = {}
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._next_id = 0
        self.other_output: collections.deque[str] = collections.deque(maxlen=40)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = self._ready.result(timeout=60)
        self.address, self.pid = tuple(ready["address"]), ready["pid"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:     # UCX-Py logs to stdout too ("[ts] [host:pid] UCXPY ERROR ..."): skip it
                msg = json.loads(line)
            except ValueError:
                self.other_output.append(line.rstrip())
                continue
            if not isinstance(msg, dict):
                continue
            if msg.get("event") == "ready":
                self._ready.set_result(msg)
                continue
            posted = msg.get("event") == "posted"
            with self._lock:
                fut = self._futures.pop((msg["id"], "posted" if posted else "done"), None)
                # an op that ends without having posted (expect: its connect failed) never
                # will: its "posted" fails with the op's reply instead of waiting forever
                unposted = None if posted else self._futures.pop((msg["id"], "posted"), None)
            if fut is not None:
                fut.set_result(msg)
            if unposted is not None:
                unposted.set_exception(OpEndedUnposted(msg))
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
        """``op``'s reply, waited for at most 30 s past the op's own deadline."""
        return await self.reply(self.call(op, **kw), "done", kw.get("deadline", 10.0) + 30.0)

    async def reply(self, futs: dict[str, concurrent.futures.Future], which: str = "done",
                    wait_s: float = 90.0) -> dict:
        """One reply of :meth:`call` (``posted`` or ``done``), waited for at most ``wait_s``
        (the peer's ops carry their own deadlines: this bounds a peer that stopped answering,
        and says what it printed besides its replies, e.g. UCX-Py's errors)."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(futs[which]), wait_s)
        except TimeoutError:
            alive = "alive" if self.proc.poll() is None else f"exited {self.proc.returncode}"
            raise TimeoutError(f"transport peer {self.pid} ({alive}) sent no {which!r} in "
                               f"{wait_s:g}s; its other output: {list(self.other_output)}"
                               ) from None

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


def arena_for(slots) -> np.ndarray:
    """A zeroed arena that holds ``slots`` (and a page past them)."""
    return np.zeros(max((o + n for o, n in slots), default=0) + 4096, np.uint8)
