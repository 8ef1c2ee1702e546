"""One-sided UCX RMA (``common.transport.rma``) between real processes on loopback.

The peer is this file run as a module (``python -m tests.test_transport_rma NBYTES``): a ucxx
context, worker and listener on 127.0.0.1, an arena filled with ``pattern(SEED)`` and
registered, and a JSON line on stdout with its port, base, size and packed remote key. It
then progresses its worker (event-driven: with endpoint error handling on, UCX emulates RMA
with active messages, so the target must progress) and answers JSON commands on stdin.
The test process connects with endpoint error handling on (as ``create_endpoint`` does) using
ucxx's low-level blocking API and progresses its own worker in deadline-bound loops.
Every child is SIGKILLed (if still running) by the end of its test.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.transport import rma
from common.transport.ucx_env import apply_ucx_env

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
ARENA = 32 * MIB
SEED = 7
DEADLINE_S = 30.0
# the transport's default traffic class (common/config.py, "kv"): what our links run on
OPTIONS = {"TLS": "tcp,sm,self", "NET_DEVICES": "lo"}


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(parts: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(memoryview(part))
    return h.hexdigest()


def _ucx() -> Any:
    apply_ucx_env(shared_memory=True)   # before the first ucxx import (it reads UCX_*)
    from common.transport.ucx import ucxx
    return ucxx()


# ---------------------------------------------------------------- the peer process

def _child_main(nbytes: int) -> None:
    lib = _ucx().lib
    ctx = lib.UCXContext(OPTIONS)
    worker = lib.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    arena = pattern(SEED, nbytes)
    region = rma.LocalRegion.register(ctx.handle, arena)
    eps: list[Any] = []
    listeners: list[Any] = []

    def on_connect(conn_request: int) -> None:
        eps.append(listeners[0].create_endpoint_from_conn_request(conn_request, True))

    listeners.append(lib.UCXListener.create(worker, 0, on_connect))

    def send(msg: dict) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    send({"port": listeners[0].port, "base": region.base, "nbytes": region.nbytes,
          "rkey": region.rkey.hex(), "pid": os.getpid()})
    stdin, events, pending = sys.stdin.fileno(), worker.epoll_file_descriptor, b""
    while True:
        worker.progress()
        idle = worker.arm()   # False: events pending, progress again without sleeping
        ready, _, _ = select.select([stdin, events], [], [], 0.05 if idle else 0)
        if stdin not in ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            cmd = json.loads(line)
            if cmd["op"] == "sha":
                send({"sha": digest([arena[o:o + n] for o, n in cmd["ranges"]])})
            elif cmd["op"] == "exit":
                region.close()
                return
    region.close()


# ---------------------------------------------------------------- helpers (test process)

class Child:
    """The peer in a subprocess; ``info`` is its ready line, ``ask`` a command → reply."""

    def __init__(self, nbytes: int = ARENA) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_transport_rma", str(nbytes)], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.info = self.reply(timeout=60.0)
        except BaseException:
            self.kill()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def reply(self, timeout: float = DEADLINE_S) -> dict:
        msg = self._lines.get(timeout=timeout)
        if msg is None:
            raise ConnectionError(f"peer exited (rc={self.proc.poll()})")
        return msg

    def ask(self, **cmd: Any) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=DEADLINE_S)


def progress_until(worker: Any, cond: Any, what: str, timeout: float = DEADLINE_S) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        worker.progress()


def wait_all(worker: Any, requests: list[rma.Request | None], what: str) -> None:
    live = [r for r in requests if r is not None]
    progress_until(worker, lambda: all([r.done() for r in live]), what)


@pytest.fixture(scope="module")
def ucx() -> Any:
    u = _ucx()
    reason = rma.available()
    if reason is not None:
        pytest.skip(f"UCX RMA unavailable: {reason}")
    ctx = u.lib.UCXContext(OPTIONS)
    worker = u.lib.UCXWorker(ctx)
    yield u, ctx, worker


class Connection:
    """An endpoint (error handling on) to a child and the child's unpacked region."""

    def __init__(self, u: Any, worker: Any, child: Child) -> None:
        self.worker = worker
        self.ep = u.lib.UCXEndpoint.create(worker, "127.0.0.1", child.info["port"], True)
        self.closed: list[bool] = []
        self.ep.set_close_callback(self.closed.append, (True,))
        # wire-up first: a tag message completes locally once the endpoint's lanes exist
        hello = self.ep.tag_send(u.Array(np.zeros(8, np.uint8)), u.Tag(1))
        progress_until(worker, lambda: hello.completed, "the endpoint's wire-up")
        hello.check_error()
        self.remote = rma.RemoteRegion.unpack(self.ep.handle, bytes.fromhex(child.info["rkey"]),
                                              child.info["base"], child.info["nbytes"])

    def flush(self) -> None:
        wait_all(self.worker, [rma.flush(self.ep.handle)], "the endpoint flush")

    def close(self) -> None:
        self.remote.close()
        self.remote.close()   # idempotent
        if self.ep is not None:
            # as ucxx's async Endpoint.abort(): UCXEndpoint.close() on an endpoint that failed
            # (peer killed) segfaults in ucxx 0.52
            self.ep.close_blocking(period=10**10, max_attempts=1)
            self.ep.remove_close_callback()
            self.ep = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- tests

SLOTS = [(0, MIB), (3 * MIB + 4096, 2 * MIB), (9 * MIB + 17, 4 * MIB + 3),
         (20 * MIB, 1), (ARENA - 5 * MIB, 5 * MIB)]   # gaps between them stay untouched


@pytest.mark.slow
def test_put_lands_byte_exact(ucx: Any) -> None:
    u, _, worker = ucx
    child = Child()
    try:
        with Connection(u, worker, child) as conn:
            srcs = [pattern(100 + i, n) for i, (_, n) in enumerate(SLOTS)]
            requests = [conn.remote.put(src, off) for src, (off, _) in zip(srcs, SLOTS)]
            wait_all(worker, requests, "the puts")
            conn.flush()
            assert child.ask(op="sha", ranges=SLOTS)["sha"] == digest(srcs)
            gaps = [(MIB, 3 * MIB + 4096 - MIB), (20 * MIB + 1, 4096)]
            theirs = pattern(SEED, ARENA)
            assert child.ask(op="sha", ranges=gaps)["sha"] == digest(
                [theirs[o:o + n] for o, n in gaps])
    finally:
        child.kill()


@pytest.mark.slow
def test_get_reads_byte_exact(ucx: Any) -> None:
    u, _, worker = ucx
    child = Child()
    try:
        abandoned = np.zeros(MIB, np.uint8)   # alive until the endpoint is closed
        with Connection(u, worker, child) as conn:
            dsts = [np.zeros(n, np.uint8) for _, n in SLOTS]
            requests = [conn.remote.get(dst, off) for dst, (off, _) in zip(dsts, SLOTS)]
            freed = conn.remote.get(abandoned, 0)
            if freed is not None:
                freed.free()   # in flight: UCX completes it internally
                freed.free()   # idempotent
                assert freed.done()
            wait_all(worker, requests, "the gets")
            theirs = pattern(SEED, ARENA)
            for dst, (off, n) in zip(dsts, SLOTS):
                assert np.array_equal(dst, theirs[off:off + n]), (off, n)
    finally:
        child.kill()


@pytest.mark.slow
def test_out_of_bounds_is_refused_before_ucx(ucx: Any) -> None:
    u, _, worker = ucx
    child = Child()
    conn: Connection | None = None
    try:
        conn = Connection(u, worker, child)   # closed below; the finally is for failures
        nbytes = conn.remote.nbytes
        junk = np.full(4096, 0xAB, np.uint8)
        for off in (nbytes - 4095, nbytes, -1, 1 << 62):
            with pytest.raises(ValueError):
                conn.remote.put(junk, off)
            with pytest.raises(ValueError):
                conn.remote.get(np.zeros(4096, np.uint8), off)
        with pytest.raises(ValueError):
            conn.remote.get(junk[::2], 0)   # not contiguous
        conn.flush()
        tail = [(nbytes - 8192, 8192), (0, 4096)]
        theirs = pattern(SEED, ARENA)
        assert child.ask(op="sha", ranges=tail)["sha"] == digest(
            [theirs[o:o + n] for o, n in tail])
        wait_all(worker, [conn.remote.put(junk, nbytes - 4096)], "a put to the last slot")
        conn.flush()
        assert child.ask(op="sha", ranges=[(nbytes - 4096, 4096)])["sha"] == digest([junk])
        conn.close()
        with pytest.raises(ValueError):
            conn.remote.put(junk, 0)   # closed
    finally:
        if conn is not None:
            conn.close()
        child.kill()


@pytest.mark.slow
def test_peer_killed_mid_put_fails_requests_not_process(ucx: Any) -> None:
    u, _, worker = ucx
    child = Child()
    fresh: Child | None = None
    conn: Connection | None = None
    try:
        conn = Connection(u, worker, child)
        # stopped first, so the puts are surely in flight (it cannot take or ack them)
        os.kill(child.proc.pid, signal.SIGSTOP)
        srcs = [pattern(200 + i, 2 * MIB) for i in range(8)]
        requests = [conn.remote.put(src, i * 2 * MIB) for i, src in enumerate(srcs)]
        flushed = rma.flush(conn.ep.handle)
        assert flushed is not None, "flush completed with the peer stopped"
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=DEADLINE_S)
        pending = [r for r in [*requests, flushed] if r is not None]
        errors: dict[int, rma.RmaError] = {}

        def settled() -> bool:
            for r in list(pending):
                try:
                    finished = r.done()
                except rma.RmaError as e:
                    errors[id(r)] = e
                    finished = True
                if finished:
                    pending.remove(r)
            return not pending

        progress_until(worker, settled, "the requests to end after the peer's death")
        assert id(flushed) in errors, "the flush did not report the peer's death"
        assert all(e.status < 0 and e.status_string for e in errors.values())
        with pytest.raises(rma.RmaError):   # the failed endpoint refuses new work at the call
            rma.flush(conn.ep.handle)
        conn.close()

        fresh = Child()
        with Connection(u, worker, fresh) as conn2:
            src = pattern(300, 3 * MIB)
            wait_all(worker, [conn2.remote.put(src, MIB)], "the put to a fresh peer")
            conn2.flush()
            assert fresh.ask(op="sha", ranges=[(MIB, 3 * MIB)])["sha"] == digest([src])
    finally:
        if conn is not None:
            conn.close()
        child.kill()
        if fresh is not None:
            fresh.kill()


def test_local_region_and_bad_arguments(ucx: Any) -> None:
    _, ctx, _ = ucx
    assert rma.available() is None
    arena = np.zeros(MIB, np.uint8)
    with rma.LocalRegion.register(ctx.handle, arena) as region:
        assert (region.base, region.nbytes) == (arena.ctypes.data, MIB)
        assert len(region.rkey) > 0
    region.close()   # idempotent
    with pytest.raises(TypeError):
        rma.LocalRegion.register(ctx.handle, np.zeros(4, np.int32))
    with pytest.raises(ValueError):
        rma.LocalRegion.register(ctx.handle, np.zeros(8, np.uint8)[::2])
    with pytest.raises(ValueError):
        rma.LocalRegion.register(ctx.handle, np.zeros(8, np.uint8)[::-1])


def test_unavailable_before_ucxx_is_loaded() -> None:
    code = "from common.transport import rma; print(rma.available())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=DEADLINE_S, check=True).stdout
    assert "libucp.so is not loaded" in out


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
