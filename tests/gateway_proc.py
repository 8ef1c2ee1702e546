"""A bare UCX receiver in its own process, for gateway failure tests (it can be SIGKILLed).

It plays the data side of a requester whose control side (the ReadBlocks call) runs in the test
process, so killing it fails the gateway's *send*, not its RPC connection.

stdout, first line: ``{"event": "ready", "address": [host, port], "pid": pid}``.
stdin, one JSON command per line:
  ``{"op": "new_ids", "n": k}`` → ``{"tids": [...]}`` (transfer ids come from the receiver);
  ``{"op": "expect", "peer": [h, p], "arena_bytes": n, "batches": [[tid, slots], ...],
  "deadline": s}`` → ``{"event": "posted"}``, later ``{"event": "done", "ok": bool, ...}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np

from common.config import TransportConfig
from common.errors import DualpathError
from common.logging import configure_logging
from common.transport import PageTransport


def _reply(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


async def _expect(t: PageTransport, cmd: dict) -> None:
    arena = np.zeros(cmd["arena_bytes"], np.uint8)
    handles = [await t.expect(tuple(cmd["peer"]), tid, arena, [tuple(s) for s in slots],
                              cmd.get("deadline", 30.0)) for tid, slots in cmd["batches"]]
    _reply({"event": "posted"})
    try:
        for h in handles:
            await h.wait()
        _reply({"event": "done", "ok": True})
    except DualpathError as e:
        _reply({"event": "done", "ok": False, "error": type(e).__name__})


async def serve() -> None:
    configure_logging("warning", json=False)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    cfg = TransportConfig(staging_bytes=16 * 1024 * 1024)
    tasks: set[asyncio.Task] = set()
    async with PageTransport(cfg, f"receiver-{os.getpid()}") as t:
        _reply({"event": "ready", "address": list(t.address), "pid": os.getpid()})
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "new_ids":
                _reply({"tids": [t.new_transfer_id() for _ in range(cmd["n"])]})
            elif cmd["op"] == "expect":
                task = asyncio.create_task(_expect(t, cmd))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()


if __name__ == "__main__":
    asyncio.run(serve())
