"""In-memory backend for tests and development: same contract as ``fs``, nothing durable."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Executor

from common.kv import KVSpec
from storage_gateway.backends import ReadStatus, ScanResult, run_io
from storage_gateway.block_format import payload_checksum
from storage_gateway.destinations import Destination, as_views


class MemoryBackend:
    """Blocks as ``bytes`` in a dict, checksummed like files so corruption tests mean the same."""

    name = "memory"

    def __init__(self, spec: KVSpec, executor: Executor):
        self.spec = spec
        self.block_bytes = spec.full_block_bytes
        self.stored_bytes = self.block_bytes
        self._executor = executor
        self._blocks: dict[str, tuple[bytes, int]] = {}
        self._lock = threading.Lock()
        self._stats = {"checksum_failures": 0, "quarantined": 0, "temp_files_cleaned": 0}

    async def open(self) -> ScanResult:
        return ScanResult()

    async def write(self, key: str, payload: Sequence[memoryview]) -> None:
        await run_io(self._executor, self._write_sync, key, payload)

    def _write_sync(self, key: str, payload: Sequence[memoryview]) -> None:
        data = b"".join(payload)
        self._blocks[key] = (data, payload_checksum([data]))

    async def read(self, keys: Sequence[str],
                   dests: Sequence[Destination]) -> list[ReadStatus]:
        return await run_io(self._executor, self._read_sync, keys, dests)

    def _read_sync(self, keys, dests) -> list[ReadStatus]:
        return [self._read_one(k, d) for k, d in zip(keys, dests)]

    def _read_one(self, key: str, dest: Destination) -> ReadStatus:
        views = as_views(dest)
        entry = self._blocks.get(key)
        if entry is None:
            return ReadStatus.MISSING
        data, checksum = entry
        pos = 0
        for v in views:
            v[:] = data[pos:pos + len(v)]
            pos += len(v)
        if payload_checksum(views) != checksum:
            with self._lock:
                self._blocks.pop(key, None)
                self._stats["checksum_failures"] += 1
                self._stats["quarantined"] += 1
            return ReadStatus.CORRUPT
        return ReadStatus.OK

    async def delete(self, keys: Sequence[str]) -> int:
        return sum(self._blocks.pop(k, None) is not None for k in keys)

    async def probe(self, keys: Sequence[str]) -> list[bool]:
        return [k in self._blocks for k in keys]

    async def close(self) -> None:
        self._blocks.clear()

    def corrupt(self, key: str, offset: int = 0) -> None:
        """Test hook: flip one payload byte in place, as bit rot on a disk would."""
        data, checksum = self._blocks[key]
        flipped = bytearray(data)
        flipped[offset] ^= 0xFF
        self._blocks[key] = (bytes(flipped), checksum)

    def counters(self) -> dict[str, int]:
        return dict(self._stats)
