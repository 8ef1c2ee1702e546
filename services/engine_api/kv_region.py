"""Request regions ``[L, tokens, B]`` in a node's page pool (the PE buffer, the DE buffer).

A region keeps each layer of its request contiguous, so one layer moves as one UCX message
and an engine gets a layer as one array view. It is one contiguous extent when the pool has
one; otherwise one extent per layer (still one message per layer). :class:`RegionPool` waits,
up to a deadline, for room, and wakes waiters whenever a region is freed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from common.buffers import Allocation, PagePool
from common.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from common.kv import KVSpec


@dataclass(eq=False)
class KVRegion:
    """``tokens`` tokens of all layers; ``layer_offsets[l]`` = arena offset of ``[l, 0, 0]``."""

    pool: PagePool
    spec: KVSpec
    tokens: int
    allocs: list[Allocation]
    layer_offsets: list[int]
    freed: bool = field(default=False)

    @property
    def row_bytes(self) -> int:
        return self.tokens * self.spec.kv_bytes_per_token_per_layer

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.spec.num_layers

    @property
    def contiguous(self) -> bool:
        return len(self.allocs) == 1

    @property
    def arena(self):
        return self.pool.arena

    def _check(self, layer: int, t0: int, t1: int) -> None:
        if self.freed:
            raise InvalidArgument("KV region was freed")
        if not 0 <= layer < self.spec.num_layers:
            raise InvalidArgument(f"layer {layer} out of range [0, {self.spec.num_layers})")
        if not 0 <= t0 <= t1 <= self.tokens:
            raise InvalidArgument(f"tokens [{t0}, {t1}) outside the region's {self.tokens}")

    def slot(self, layer: int, t0: int = 0, t1: int | None = None) -> tuple[int, int]:
        """Arena ``(offset, nbytes)`` of tokens ``[t0, t1)`` of ``layer`` (one run)."""
        t1 = self.tokens if t1 is None else t1
        self._check(layer, t0, t1)
        b = self.spec.kv_bytes_per_token_per_layer
        return self.layer_offsets[layer] + t0 * b, (t1 - t0) * b

    def flat(self, layer: int, t0: int = 0, t1: int | None = None) -> np.ndarray:
        """Flat uint8 view of tokens ``[t0, t1)`` of ``layer`` (no copy)."""
        off, n = self.slot(layer, t0, t1)
        return self.pool.arena[off:off + n]

    def layer(self, layer: int, t0: int = 0, t1: int | None = None) -> np.ndarray:
        """``[t1 - t0, B]`` view of ``layer`` (no copy)."""
        return self.flat(layer, t0, t1).reshape(-1, self.spec.kv_bytes_per_token_per_layer)

    def whole(self) -> np.ndarray | None:
        """``[L, tokens, B]`` view when the region is one extent, else None."""
        if not self.contiguous or self.freed:
            return None
        off = self.layer_offsets[0]
        return self.pool.arena[off:off + self.nbytes].reshape(
            self.spec.num_layers, self.tokens, self.spec.kv_bytes_per_token_per_layer)

    def block_dest(self, block: int) -> list[tuple[int, int]]:
        """Per-layer slots of Full Block ``block`` (a storage read scatters into these)."""
        bt = self.spec.block_tokens
        return [self.slot(layer, block * bt, (block + 1) * bt) for layer in range(self.spec.num_layers)]

    def block_views(self, block: int) -> list[np.ndarray]:
        """The L Layer Blocks of Full Block ``block`` (a write-back gathers these)."""
        bt = self.spec.block_tokens
        return [self.flat(layer, block * bt, (block + 1) * bt) for layer in range(self.spec.num_layers)]


class RegionPool:
    """Allocates :class:`KVRegion` s from one PagePool; ``await allocate(...)`` waits for room."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._freed = asyncio.Event()
        self.live = 0

    def try_allocate(self, spec: KVSpec, tokens: int, owner: str,
                     one_extent: bool = False) -> KVRegion | None:
        """A region now (one extent, else one per layer), or None when there is no room."""
        if tokens <= 0:
            raise InvalidArgument(f"a region needs tokens > 0, got {tokens}")
        row = tokens * spec.kv_bytes_per_token_per_layer
        total = row * spec.num_layers
        if self.pool.pages_for(total) > self.pool.num_pages:
            raise InvalidArgument(f"{owner}: {total} B of KV can never fit pool {self.pool.name!r} "
                                  f"({self.pool.num_pages * self.pool.page_bytes} B) — raise its size")
        try:
            a = self.pool.alloc(total, owner, allow_split=False)
        except ResourceExhausted:
            return None if one_extent else self._per_layer(spec, tokens, row, owner)
        base = a.slots()[0][0]
        self.live += 1
        return KVRegion(self.pool, spec, tokens, [a], [base + i * row for i in range(spec.num_layers)])

    def _per_layer(self, spec: KVSpec, tokens: int, row: int, owner: str) -> KVRegion | None:
        if self.pool.pages_for(row) * spec.num_layers > self.pool.free_pages:
            return None
        allocs: list[Allocation] = []
        try:
            for _ in range(spec.num_layers):
                allocs.append(self.pool.alloc(row, owner, allow_split=False))
        except ResourceExhausted:
            for a in allocs:
                self.pool.free(a)
            return None
        self.live += 1
        return KVRegion(self.pool, spec, tokens, allocs, [a.slots()[0][0] for a in allocs])

    async def allocate(self, spec: KVSpec, tokens: int, owner: str, timeout_s: float,
                       one_extent: bool = False) -> KVRegion:
        """Wait up to ``timeout_s`` for room; DeadlineExceeded (retryable) when none came."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            region = self.try_allocate(spec, tokens, owner, one_extent)
            if region is not None:
                return region
            left = end - loop.time()
            if left <= 0:
                raise DeadlineExceeded(
                    f"pool {self.pool.name!r}: no room for {tokens} tokens of KV "
                    f"({tokens * spec.bytes_per_token} B) within {timeout_s:.3g}s "
                    f"({self.pool.free_pages}/{self.pool.num_pages} pages free)")
            event = self._freed
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                pass

    def free(self, region: KVRegion) -> None:
        """Return a region's pages (idempotent) and wake allocations waiting for room."""
        if region.freed:
            return
        region.freed = True
        for a in region.allocs:
            self.pool.free(a)
        self.live -= 1
        self._freed.set()
        self._freed = asyncio.Event()
