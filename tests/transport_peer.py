"""A PageTransport in its own process, driven by JSON lines (tests and benchmarks).

stdin: one command per line ``{"id": n, "op": ..., ...}``; stdout: one reply per line with the
same ``id``. Commands run concurrently. The first line printed is
``{"event": "ready", "address": [host, port], "pid": pid}``.

ops: ``send`` (peer, tid, slots, seed, nbytes?, split, deadline), ``new_id``, ``expect`` (peer,
tid, arena_bytes, slots, deadline; replies ``posted`` and later the result with a digest of the
received stream), ``stats``, ``exit``. With ``shm_arena_bytes`` in the config, ``expect`` receives
into a ``/dev/shm`` arena of that size that the transport advertises (the one-copy path, and
the arena registered for RMA with ``kv_mode = "rma"``); ``slow_copy_s`` sleeps that long
between the slots of a one-copy send, ``slow_put_s`` before each put of an RMA send (so a test
can kill this process mid-transfer).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys

import numpy as np

from common.config import TrafficClassConfig, TransportConfig
from common.errors import DualpathError
from common.logging import configure_logging
from common.shm import ShmSegment
from common.transport import PageTransport


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic test bytes (cheap: no RNG), different per seed and position."""
    x = np.arange(nbytes, dtype=np.uint32)
    mixed = x * np.uint32(2654435761) + np.uint32(seed * 97 + 13)
    return (mixed >> np.uint32(11)).astype(np.uint8)


def gather(arena: np.ndarray, slots: list[tuple[int, int]]) -> np.ndarray:
    """The transfer stream as laid out in ``arena`` by ``slots`` (a copy)."""
    if not slots:
        return np.empty(0, np.uint8)
    return np.concatenate([arena[o:o + n] for o, n in slots])


def split_views(buf: np.ndarray, parts: int) -> list[np.ndarray]:
    """``buf`` cut into ``parts`` views of uneven sizes (exercises the gather path)."""
    if parts <= 1:
        return [buf]
    cuts = sorted({int(c) for c in np.linspace(0, buf.nbytes, parts + 1)[1:-1] + 977} - {0})
    cuts = [c for c in cuts if c < buf.nbytes]
    return np.split(buf, cuts)


def slow_down_copies(pause_s: float) -> None:
    """Make one-copy sends of this process pause after each slot (tests kill it mid-copy):
    each copy thread copies the slots its share of the stream touches, one at a time."""
    import threading
    import time

    from common.transport import shm_transfers
    from common.transport.shm_path import share_bounds

    fast = shm_transfers.copy_stream

    def slow(src, dst, slots, stop: threading.Event, share: int = 0, shares: int = 1,
             runs=None) -> int:
        stream = np.concatenate(list(src)) if len(src) > 1 else src[0]
        lo, hi = share_bounds(sum(n for _, n in slots), share, shares)
        copies, pos = 0, 0
        for off, n in slots:
            if pos < hi and pos + n > lo:
                copies += fast([stream[pos:pos + n]], dst, [(off, n)], stop)
                time.sleep(pause_s)
                if stop.is_set():
                    break
            pos += n
        return copies

    shm_transfers.copy_stream = slow  # type: ignore[assignment]


def slow_down_puts(pause_s: float) -> None:
    """Make RMA sends of this process pause before each put (tests kill it mid-transfer)."""
    import time

    from common.transport import rma_path

    fast = rma_path._pieces

    def slow(src, slots):
        for piece in fast(src, slots):
            time.sleep(pause_s)
            yield piece

    rma_path._pieces = slow  # type: ignore[assignment]


def config_from_env() -> TransportConfig:
    raw = json.loads(os.environ.get("DUALPATH_TEST_TRANSPORT", "{}"))
    raw.pop("shm_arena_bytes", None)
    raw.pop("slow_copy_s", None)
    raw.pop("slow_put_s", None)
    options = raw.pop("options", None)
    if options is not None:
        raw["traffic_classes"] = {"kv": TrafficClassConfig(options=options)}
    return TransportConfig(**raw)


class PeerServer:
    def __init__(self, transport: PageTransport, shm_arena: np.ndarray | None = None) -> None:
        self.t, self.shm_arena = transport, shm_arena
        self.tasks: set[asyncio.Task] = set()
        self.done = asyncio.Event()

    def reply(self, msg: dict) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    async def handle(self, cmd: dict) -> None:
        op, rid = cmd["op"], cmd.get("id")
        try:
            result = await getattr(self, "op_" + op)(cmd)
            self.reply({"id": rid, "ok": True, **(result or {})})
        except DualpathError as e:
            self.reply({"id": rid, "ok": False, "error": type(e).__name__, "message": e.message})

    async def op_send(self, cmd: dict) -> dict:
        slots = [tuple(s) for s in cmd["slots"]]
        nbytes = cmd.get("nbytes", sum(n for _, n in slots))
        data = pattern(cmd["seed"], nbytes)
        await self.t.send(tuple(cmd["peer"]), cmd["tid"], split_views(data, cmd.get("split", 1)),
                          slots, cmd.get("deadline", 10.0))
        return {}

    async def op_new_id(self, cmd: dict) -> dict:
        return {"tid": self.t.new_transfer_id()}

    async def op_expect(self, cmd: dict) -> dict:
        slots = [tuple(s) for s in cmd["slots"]]
        arena = np.zeros(cmd["arena_bytes"], np.uint8) if self.shm_arena is None \
            else self.shm_arena[:cmd["arena_bytes"]]
        handle = await self.t.expect(tuple(cmd["peer"]), cmd["tid"], arena, slots,
                                     cmd.get("deadline", 10.0))
        self.reply({"id": cmd["id"], "event": "posted"})
        await handle.wait()
        return {"digest": hashlib.sha256(gather(arena, slots).tobytes()).hexdigest()}

    async def op_stats(self, cmd: dict) -> dict:
        return {"stats": self.t.stats()}

    async def op_exit(self, cmd: dict) -> dict:
        self.done.set()
        return {}


async def serve() -> None:
    configure_logging(os.environ.get("DUALPATH_TEST_LOG", "warning"), json=False)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    raw = json.loads(os.environ.get("DUALPATH_TEST_TRANSPORT", "{}"))
    if raw.get("slow_copy_s"):
        slow_down_copies(raw["slow_copy_s"])
    if raw.get("slow_put_s"):
        slow_down_puts(raw["slow_put_s"])
    shm_bytes = raw.get("shm_arena_bytes")
    segment = ShmSegment.create(shm_bytes) if shm_bytes else None
    arena = segment.array if segment is not None else None
    async with PageTransport(config_from_env(), f"peer-{os.getpid()}", shm_arena=arena) as transport:
        server = PeerServer(transport, arena)
        server.reply({"event": "ready", "address": list(transport.address), "pid": os.getpid()})
        while not server.done.is_set():
            line = await reader.readline()
            if not line:
                break
            cmd = json.loads(line)
            task = asyncio.create_task(server.handle(cmd))
            server.tasks.add(task)
            task.add_done_callback(server.tasks.discard)
            if cmd["op"] == "exit":
                await task
        for task in list(server.tasks):
            task.cancel()


if __name__ == "__main__":
    asyncio.run(serve())
