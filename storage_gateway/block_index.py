"""Which Full Blocks this node stores, in LRU order, with pins and a capacity (sans-I/O).

Paper §2.1: KV is a trie of Full Blocks, and chained keys make a prefix of token blocks a path
in it, so "longest stored prefix" is a walk along the request's key list (``lookup_prefix``).

Memory: every Full Block of one KV spec has the same size, so an entry holds only its key (16
raw bytes) in an ``OrderedDict`` whose order *is* the LRU order (oldest first) — measured at
~155 B per block with tracemalloc (``measure_bytes_per_block``), i.e. ~1.5 GB for 10M blocks.
Pins live in a separate dict that only holds blocks being read right now.

The shell (``storage_gateway.store``) does the I/O: it asks ``reserve`` for room before a
write and deletes the victims it gets back; victims are already gone from the index, so no new
reader can find them.
"""

from __future__ import annotations

import tracemalloc
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from common.errors import InvalidArgument, ResourceExhausted


def _raw(key: str) -> bytes:
    return bytes.fromhex(key)


class BlockIndex:
    """Existence, LRU order, pins and capacity of one node's Full Blocks."""

    def __init__(self, block_bytes: int, capacity_bytes: int = 0, retry_after_s: float = 0.05):
        if block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be positive, got {block_bytes}")
        if 0 < capacity_bytes < block_bytes:
            raise InvalidArgument(f"capacity_bytes {capacity_bytes} cannot hold one block of {block_bytes} B")
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.retry_after_s = retry_after_s
        self._lru: OrderedDict[bytes, None] = OrderedDict()   # oldest first
        self._pins: dict[bytes, int] = {}
        self._reserved = 0
        self.evictions = 0

    # ------------------------------------------------------------------ membership
    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: str) -> bool:
        return _raw(key) in self._lru

    def keys_lru(self) -> Iterator[str]:
        """Keys from least to most recently used."""
        return (k.hex() for k in list(self._lru))

    @property
    def used_bytes(self) -> int:
        return len(self._lru) * self.block_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` present (LookupPrefix); does not count as an access."""
        lru = self._lru
        for i, key in enumerate(keys):
            if _raw(key) not in lru:
                return i
        return len(keys)

    def load(self, keys_oldest_first: Iterable[str]) -> int:
        """Add blocks found by a scan, oldest first; returns how many were new."""
        before = len(self._lru)
        for key in keys_oldest_first:
            self._lru[_raw(key)] = None
        return len(self._lru) - before

    def add(self, key: str, *, reserved: bool = False) -> bool:
        """Record a stored block as most recently used; ``reserved``: consume a ``reserve``."""
        if reserved:
            self.unreserve()
        k = _raw(key)
        if k in self._lru:
            self._lru.move_to_end(k)
            return False
        self._lru[k] = None
        return True

    def touch(self, key: str) -> bool:
        """Mark an access (read or duplicate write); False if the block is not stored."""
        k = _raw(key)
        if k not in self._lru:
            return False
        self._lru.move_to_end(k)
        return True

    def remove(self, key: str) -> bool:
        """Forget a block (deleted, corrupt, gone from the media); pins are left alone."""
        k = _raw(key)
        if k not in self._lru:
            return False
        del self._lru[k]
        return True

    # ------------------------------------------------------------------ pins
    def pin(self, key: str) -> None:
        """A read of ``key`` started: it is not evicted until the matching ``unpin``."""
        k = _raw(key)
        self._pins[k] = self._pins.get(k, 0) + 1

    def unpin(self, key: str) -> None:
        k = _raw(key)
        n = self._pins.get(k, 0)
        if n <= 0:
            raise InvalidArgument(f"unpin of block {key} that is not pinned")
        if n == 1:
            del self._pins[k]
        else:
            self._pins[k] = n - 1

    def pin_present(self, keys: Sequence[str]) -> list[int]:
        """Start a read: touch and pin every stored key; returns their positions in ``keys``."""
        lru, pins, present = self._lru, self._pins, []
        for i, key in enumerate(keys):
            k = _raw(key)
            if k in lru:
                lru.move_to_end(k)
                pins[k] = pins.get(k, 0) + 1
                present.append(i)
        return present

    def unpin_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.unpin(key)

    def pin_count(self, key: str) -> int:
        return self._pins.get(_raw(key), 0)

    @property
    def pinned_blocks(self) -> int:
        return len(self._pins)

    # ------------------------------------------------------------------ capacity
    def reserve(self) -> list[str]:
        """Make room for one more block: returns the evicted keys (already removed).

        Raises ResourceExhausted (retryable) when only pinned blocks could make room.
        """
        victims = self._victims(self.used_bytes + self._reserved + self.block_bytes)
        self._reserved += self.block_bytes
        return victims

    def unreserve(self) -> None:
        if self._reserved < self.block_bytes:
            raise InvalidArgument("unreserve without a matching reserve")
        self._reserved -= self.block_bytes

    def evict_to_capacity(self) -> list[str]:
        """Evict LRU blocks until the stored bytes fit (e.g. capacity lowered across a restart)."""
        return self._victims(self.used_bytes + self._reserved)

    def _victims(self, need_bytes: int) -> list[str]:
        if not self.capacity_bytes or need_bytes <= self.capacity_bytes:
            return []
        n_need = -(-(need_bytes - self.capacity_bytes) // self.block_bytes)
        picked: list[bytes] = []
        for k in self._lru:
            if k not in self._pins:
                picked.append(k)
                if len(picked) == n_need:
                    break
        if len(picked) < n_need:
            raise ResourceExhausted(
                f"storage full: {self.used_bytes} of {self.capacity_bytes} B used and the LRU "
                f"candidates are being read ({len(self._pins)} pinned); retry shortly or raise "
                "gateway.capacity_bytes", retry_after_s=self.retry_after_s)
        for k in picked:
            del self._lru[k]
        self.evictions += len(picked)
        return [k.hex() for k in picked]


def measure_bytes_per_block(n: int = 200_000) -> float:
    """Bytes of Python heap per indexed block for ``n`` random keys (tracemalloc)."""
    import os

    keys = [os.urandom(16).hex() for _ in range(n)]
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = BlockIndex(block_bytes=1)
    index.load(keys)
    used = tracemalloc.get_traced_memory()[0] - before
    if not was_tracing:
        tracemalloc.stop()
    del index
    return used / n
