"""The one async interface every block backend implements, and helpers they share.

A backend moves Full Block bytes between the media and caller buffers and checks them; it knows
nothing of the index, eviction, the read queue or link shaping (``storage_gateway.store`` does).
Every blocking call runs in the store's bounded thread pool through :func:`run_io`.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from common.kv import KVSpec
from storage_gateway.destinations import Destination

T = TypeVar("T")


class ReadStatus(enum.Enum):
    OK = "ok"                # destination holds the verified block
    MISSING = "missing"      # not on the media (evicted elsewhere, never written)
    CORRUPT = "corrupt"      # failed verification; quarantined; destination bytes are garbage
    FOREIGN = "foreign"      # a block of another KV layout under this key; not served
    ERROR = "error"          # the media failed (EIO...); logged; not served


@dataclass
class ScanResult:
    """What a backend found at open: blocks ``(mtime_ns, key)`` and what it cleaned up."""

    blocks: list[tuple[int, str]] = field(default_factory=list)
    temp_cleaned: int = 0
    quarantined: int = 0
    foreign: int = 0

    def merge(self, other: ScanResult) -> None:
        self.blocks.extend(other.blocks)
        self.temp_cleaned += other.temp_cleaned
        self.quarantined += other.quarantined
        self.foreign += other.foreign


class BlockBackend(Protocol):
    """Durable (or in-memory) Full Block storage. Keys arrive validated; views are sized."""

    name: str
    block_bytes: int         # payload bytes of one Full Block
    stored_bytes: int        # bytes one block occupies on the media (capacity accounting)

    async def open(self) -> ScanResult:
        """Prepare the media and list the blocks already stored (cleaning up leftovers)."""

    async def write(self, key: str, payload: Sequence[memoryview]) -> None:
        """Store one block durably; returns only once it is complete and durable."""

    async def read(self, keys: Sequence[str],
                   dests: Sequence[Destination]) -> list[ReadStatus]:
        """Read and verify blocks into their destinations (one status per key)."""

    async def delete(self, keys: Sequence[str]) -> int:
        """Delete blocks; returns how many existed."""

    async def probe(self, keys: Sequence[str]) -> list[bool]:
        """Which keys are stored on the media with a valid header (shared file systems)."""

    async def close(self) -> None: ...

    def counters(self) -> dict[str, int]: ...


async def finish_uncancelled(aw: Awaitable[T]) -> T:
    """Await ``aw``; if the caller is cancelled, still wait for it to finish, then re-raise.

    I/O threads keep writing into caller buffers and files after an asyncio cancellation; the
    caller must not get control back (and free its pages) before they stop.
    """
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                continue
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller sees
        raise


async def run_io(executor: Executor, fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking call in the I/O pool, cancellation-safe (see ``finish_uncancelled``)."""
    return await finish_uncancelled(asyncio.get_running_loop().run_in_executor(executor, fn, *args))


def make_backend(cfg, spec: KVSpec, executor: Executor) -> BlockBackend:
    """The backend ``cfg.backend`` names (a ``GatewayConfig``)."""
    if cfg.backend == "memory":
        from storage_gateway.backend_memory import MemoryBackend

        return MemoryBackend(spec, executor)
    from storage_gateway.backend_fs import FsBackend

    return FsBackend(cfg.root, spec, executor, o_direct=cfg.o_direct,
                     verify_headers_on_scan=cfg.verify_headers_on_scan,
                     temp_max_age_s=cfg.temp_max_age_s, native_reads=cfg.native_reads)
