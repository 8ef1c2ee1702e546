"""Subprocess for tests/test_transport.py: connect on tiny budgets, again and again, then
churn the allocator and move real bytes. Run in its own process because the failure it
guards against (UCX writing a handshake into freed memory) is a segfault, not an exception.

    python -m tests.connect_stress N     # prints "connect attempts N failed F", then "ok"
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys

import numpy as np

from common.config import TransportConfig
from common.errors import DualpathError
from common.transport import PageTransport, handshake

BUDGETS = (1e-5, 1e-4, 3e-4, 1e-3, 3e-3)


async def main(n: int) -> None:
    cfg = TransportConfig(staging_bytes=32 << 20)
    rng = random.Random(7)
    async with PageTransport(cfg, "a") as a, PageTransport(cfg, "b") as b:
        failed = 0
        for i in range(n):
            try:
                await a.endpoint(b.address, deadline_s=rng.choice(BUDGETS))
            except DualpathError:
                failed += 1
            for link in list(a.links._all_links):      # the next attempt connects afresh
                a.links.abort(link, "connect stress")
            churn = [bytearray(16) for _ in range(200)]   # reuse freed pymalloc blocks
            del churn
            if i % 50 == 0:
                gc.collect()
            await asyncio.sleep(0.001)
        print(f"connect attempts {n} failed {failed}", flush=True)
        await asyncio.sleep(0.5)                  # late handshake bytes arrive now
        for _ in range(20):
            churn = [bytes(range(16)) for _ in range(2000)]
            del churn
            gc.collect()
        slots = [(0, 1 << 20), (2 << 20, 4096)]
        data = np.random.default_rng(1).integers(0, 256, (1 << 20) + 4096, np.uint8)
        arena, tid = np.zeros(3 << 20, np.uint8), a.new_transfer_id()
        handle = await a.expect(b.address, tid, arena, slots, 10.0)
        await b.send(a.address, tid, [data], slots, 10.0)
        await handle.wait()
        got = np.concatenate([arena[o:o + n_] for o, n_ in slots])
        assert np.array_equal(got, data), "bytes differ after the connect stress"
        print(f"handshakes still pending {handshake.pending()}", flush=True)
    print("ok", flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300))
