"""Subprocess helper for the kill -9 test: write large blocks in a loop, print each acked key.

Usage: ``python tests/gateway_crash_writer.py ROOT NUM_LAYERS BYTES_PER_TOKEN_PER_LAYER``.
A key is printed (and flushed) only after ``write_block`` returned, i.e. once it is durable.
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

from common.kv import KVSpec
from common.logging import configure_logging
from storage_gateway.config import GatewayConfig
from storage_gateway.store import GatewayStore


async def main(root: str, layers: int, bpt: int) -> None:
    spec = KVSpec("crash-test", layers, bpt)
    rng = np.random.default_rng(os.getpid())
    cfg = GatewayConfig(backend="fs", root=root, io_threads=2)
    async with GatewayStore(cfg, spec) as store:
        print("ready", flush=True)
        while True:
            key = rng.bytes(16).hex()
            payload = rng.integers(0, 256, spec.full_block_bytes, dtype=np.uint8)
            await store.write_block(key, payload)
            print(key, flush=True)


if __name__ == "__main__":
    configure_logging("warning", json=False)
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
