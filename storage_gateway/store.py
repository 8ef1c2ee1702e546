"""The gateway's storage core: backend + index + eviction + read queue + link shaping + metrics.

``GatewayStore`` is what the network service drives (one per node): every call is a coroutine
that never blocks the event loop (file I/O runs in a bounded thread pool), every input is
validated before anything touches the media, and every call is cancellation-safe — a cancelled
read returns only after the I/O threads stopped writing into the caller's buffers, and releases
its pins and read-queue slot in ``finally``.

Reads (paper §5.1): a request is admitted to the node's FIFO read queue (``read_q`` counts its
tokens from admission to completion), its stored blocks are pinned against eviction, charged to
the link bucket and read in batches on up to ``io_threads`` threads, each block verified before
it is reported read. Writes: a duplicate is a no-op; otherwise room is made (LRU eviction of
unpinned blocks), the link is charged, and the backend returns only once the block is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from common.errors import (ConfigError, DeadlineExceeded, InvalidArgument, ResourceExhausted,
                           Unavailable)
from common.kv import KVSpec, validate_key, validate_keys
from storage_gateway.backends import BlockBackend, ReadStatus, finish_uncancelled, make_backend
from storage_gateway.block_index import BlockIndex
from storage_gateway.config import GatewayConfig
from storage_gateway.destinations import Destination, normalize_destinations, normalize_payload
from storage_gateway.link_shaper import LinkShaper
from storage_gateway.priority_gate import PriorityGate
from storage_gateway.read_queue import ReadQueue

log = structlog.get_logger(__name__)

_PROBE_BATCH = 16
_GONE = (ReadStatus.MISSING, ReadStatus.CORRUPT, ReadStatus.FOREIGN)


@dataclass
class ReadResult:
    """Outcome of one ReadBlocks: ``found[i]`` tells whether destination ``i`` holds block ``i``.

    Destinations of keys not found hold undefined bytes; ``corrupt`` lists the keys among them
    that failed verification (quarantined). The caller recomputes every missing block.
    """

    request_id: str
    keys: list[str]
    found: list[bool]
    corrupt: list[str]
    nbytes: int
    queued_s: float
    read_s: float

    @property
    def read_keys(self) -> list[str]:
        return [k for k, f in zip(self.keys, self.found) if f]

    @property
    def missing_keys(self) -> list[str]:
        return [k for k, f in zip(self.keys, self.found) if not f]

    @property
    def prefix_read(self) -> int:
        """Leading blocks read: the reusable prefix of the request."""
        for i, f in enumerate(self.found):
            if not f:
                return i
        return len(self.found)


class GatewayStore:
    """One node's block store. Use ``async with GatewayStore(cfg, spec) as store:``."""

    def __init__(self, cfg: GatewayConfig, spec: KVSpec):
        self.cfg = cfg
        self.spec = spec
        self.block_bytes = spec.full_block_bytes
        self._executor = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="gateway-io")
        self.backend: BlockBackend = make_backend(cfg, spec, self._executor)
        try:
            self.index = BlockIndex(self.backend.stored_bytes, cfg.capacity_bytes,
                                    cfg.overloaded_retry_after_s)
        except InvalidArgument as e:
            self._executor.shutdown(wait=False)
            raise ConfigError(f"gateway.capacity_bytes: {e.message}") from e
        self.read_queue = ReadQueue(
            block_tokens=spec.block_tokens, block_bytes=self.block_bytes,
            max_concurrent=cfg.max_concurrent_reads, max_queued=cfg.max_queued_requests,
            max_keys=cfg.max_keys_per_request, max_bytes=cfg.max_bytes_per_request,
            retry_after_s=cfg.overloaded_retry_after_s)
        # the emulated link: reads cross ``shaper`` (storage -> node); writes cross it too on a
        # half-duplex link, their own direction's bucket on a full-duplex one
        self.shaper = LinkShaper(cfg.link_rate_bytes_per_s, cfg.link_burst_bytes, cfg.link_chunk_bytes)
        self.write_shaper = self.shaper if cfg.link_duplex == "half" else LinkShaper(
            cfg.link_rate_bytes_per_s, cfg.link_burst_bytes, cfg.link_chunk_bytes)
        # read jobs in flight over all requests: enough to keep every I/O thread busy with one
        # queued behind it; handed out by order key, like the link (docs/storage.md, "Read order")
        self._io_jobs = PriorityGate(2 * cfg.io_threads)
        self._arrivals = itertools.count(1)
        self._state = "init"
        self._start_lock = asyncio.Lock()
        self._write_sem = asyncio.Semaphore(cfg.max_concurrent_writes)
        self._waiters: dict[int, asyncio.Future] = {}
        self._writing: dict[str, asyncio.Event] = {}
        self._deleting: dict[str, asyncio.Event] = {}
        self._ops = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._req_ids = itertools.count(1)
        self._stats = dict.fromkeys(
            ("bytes_read", "bytes_written", "blocks_read", "blocks_written", "hits", "misses",
             "duplicate_writes", "read_requests", "write_requests", "prefix_lookups",
             "read_deadlines_exceeded", "blocks_discovered", "blocks_deleted"), 0)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Open the backend and rebuild the index from what it stores; idempotent."""
        async with self._start_lock:
            if self._state != "init":
                return
            t0 = time.monotonic()
            try:
                scan = await self.backend.open()
            except BaseException:
                self._state = "closed"
                self._executor.shutdown(wait=False)
                raise
            scan.blocks.sort()  # oldest mtime first = LRU order across a restart
            self.index.load(key for _, key in scan.blocks)
            self._state = "running"
            victims = self.index.evict_to_capacity()
            if victims:
                await self._delete_files(victims)
            log.info("gateway_store_started", backend=self.backend.name, root=self.cfg.root,
                     blocks=len(self.index), temp_files_cleaned=scan.temp_cleaned,
                     quarantined=scan.quarantined, foreign_blocks=scan.foreign,
                     evicted=len(victims), seconds=round(time.monotonic() - t0, 3))

    async def close(self) -> None:
        """Refuse new calls, wait for the running ones, release the backend and I/O threads."""
        async with self._start_lock:
            if self._state in ("closing", "closed"):
                return
            self._state = "closing"
            await self._idle.wait()
            await self.backend.close()
            self._executor.shutdown(wait=False)
            self._state = "closed"

    async def __aenter__(self) -> GatewayStore:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @contextlib.contextmanager
    def _op(self):
        if self._state != "running":
            raise Unavailable(f"gateway store is {self._state}, not running")
        self._ops += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._ops -= 1
            if not self._ops:
                self._idle.set()

    # ------------------------------------------------------------------ lookups
    @property
    def read_q(self) -> int:
        """Tokens queued + being read on this node (paper §5.1)."""
        return self.read_queue.read_q

    def next_order(self) -> int:
        """An order key for a request arriving now: with ``read_order = "arrival"`` its reads
        are served before those of every request that arrives later."""
        return next(self._arrivals)

    def _order_key(self, order: int | None) -> int:
        if self.cfg.read_order == "shared":
            return 0
        return self.next_order() if order is None else order

    def contains(self, key: str) -> bool:
        return validate_key(key) in self.index

    async def lookup_prefix(self, keys: Sequence[str]) -> int:
        """LookupPrefix: how many leading ``keys`` are stored."""
        keys = validate_keys(keys, self.cfg.max_keys_per_request)
        with self._op():
            self._stats["prefix_lookups"] += 1
            n = self.index.lookup_prefix(keys)
            if self.cfg.probe_on_miss and n < len(keys):
                n = await self._probe_prefix(keys, n)
            return n

    async def _probe_prefix(self, keys: list[str], n: int) -> int:
        """Extend the prefix with blocks other nodes wrote to a shared file system."""
        while n < len(keys):
            if keys[n] in self.index:
                n += 1
                continue
            batch = list(itertools.takewhile(lambda k: k not in self.index, keys[n:n + _PROBE_BATCH]))
            for key, ok in zip(batch, await self.backend.probe(batch)):
                if not ok:
                    return n
                self._discovered(key)
                n += 1
        return n

    async def forget_vanished(self, keys: Sequence[str]) -> int:
        """Shared root: drop indexed ``keys`` whose file another gateway removed (quarantined
        as corrupt, evicted), so a rewrite of the recomputed block is not skipped as a
        duplicate. Only with ``probe_on_miss``; blocks being read, written or deleted stay."""
        if not self.cfg.probe_on_miss:
            return 0
        cand = [k for k in dict.fromkeys(keys) if k in self.index and not self.index.pin_count(k)
                and k not in self._writing and k not in self._deleting]
        if not cand:
            return 0
        with self._op():
            ok = await self.backend.probe(cand)
        gone = [k for k, present in zip(cand, ok) if not present and not self.index.pin_count(k)
                and k not in self._writing and k not in self._deleting]
        for k in gone:
            self.index.remove(k)
        self._stats["blocks_vanished"] = self._stats.get("blocks_vanished", 0) + len(gone)
        return len(gone)

    def _discovered(self, key: str) -> None:
        if self.index.add(key):
            self._stats["blocks_discovered"] += 1

    # ------------------------------------------------------------------ reads
    async def read_blocks(self, keys: Sequence[str], destinations: Sequence, *,
                          request_id: str | None = None, timeout_s: float | None = None,
                          spread: bool = False, order: int | None = None) -> ReadResult:
        """ReadBlocks: read stored blocks of ``keys`` into ``destinations`` (one per key).

        A destination is a buffer of at least one Full Block, or a list of contiguous views
        holding exactly one Full Block in order (e.g. one per layer: ``scatter_views``).
        Raises InvalidArgument (bad keys, limits, destination sizes — nothing read),
        Overloaded (queue full, retryable), DeadlineExceeded (``timeout_s`` passed).
        ``spread``: cut the request into about one job per I/O thread (at least
        ``read_batch_bytes`` each) instead of ``read_batch_bytes`` jobs — fewer thread
        hand-offs for a large request nothing downstream waits on piecewise (shm reads).
        ``order``: the request's ``next_order()`` when it is read in several calls (batches),
        so all of them keep its place; None = it arrives now.
        """
        keys = validate_keys(keys)
        self.read_queue.check_limits(len(keys))
        dests = normalize_destinations(destinations, len(keys), self.block_bytes)
        rid = request_id or f"read-{next(self._req_ids)}"
        order = self._order_key(order)
        with self._op():
            self._stats["read_requests"] += 1
            if timeout_s is None:
                return await self._read(rid, keys, dests, spread, order)
            try:
                async with asyncio.timeout(timeout_s):
                    return await self._read(rid, keys, dests, spread, order)
            except TimeoutError:
                self._stats["read_deadlines_exceeded"] += 1
                raise DeadlineExceeded(f"read {rid}: {len(keys)} blocks not read within {timeout_s:.3g} s "
                                       f"(node read_q {self.read_q} tokens)") from None

    async def _read(self, rid: str, keys: list[str], dests: list[Destination],
                    spread: bool, order: int) -> ReadResult:
        t0 = time.monotonic()
        ticket = await self._admit(len(keys))
        t1 = time.monotonic()
        ok = False
        try:
            if self.cfg.probe_on_miss:
                await self._probe_missing(keys)
            statuses = await self._read_pinned(keys, dests, spread, order)
            ok = True
        finally:
            done = self.read_queue.finish if ok else self.read_queue.cancel
            self._start_tickets(done(ticket))
        return self._account_read(rid, keys, statuses, t1 - t0, time.monotonic() - t1)

    async def _admit(self, n_blocks: int) -> int:
        ticket, started = self.read_queue.submit(n_blocks)
        if started:
            return ticket
        fut = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = fut
        try:
            await fut
        except BaseException:
            self._waiters.pop(ticket, None)
            self._start_tickets(self.read_queue.cancel(ticket))
            raise
        return ticket

    def _start_tickets(self, tickets: list[int]) -> None:
        for ticket in tickets:
            fut = self._waiters.pop(ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def _probe_missing(self, keys: list[str]) -> None:
        absent = [k for k in dict.fromkeys(keys) if k not in self.index and k not in self._writing]
        if absent:
            for key, ok in zip(absent, await self.backend.probe(absent)):
                if ok:
                    self._discovered(key)

    async def _read_pinned(self, keys: list[str], dests, spread: bool,
                           order: int) -> dict[int, ReadStatus]:
        present = self.index.pin_present(keys)
        try:
            return await self._read_present(keys, dests, present, spread, order)
        finally:
            self.index.unpin_many(keys[i] for i in present)

    async def _read_present(self, keys, dests, present: list[int], spread: bool,
                            order: int) -> dict[int, ReadStatus]:
        per = max(1, self.cfg.read_batch_bytes // self.block_bytes)
        if spread:
            per = max(per, -(-len(present) // self.cfg.io_threads))
        batches = iter([present[j:j + per] for j in range(0, len(present), per)])
        statuses: dict[int, ReadStatus] = {}

        async def worker() -> None:
            async with self._io_jobs.slot(order) as turn:
                for batch in batches:
                    await self.shaper.acquire(len(batch) * self.block_bytes, order)
                    got = await self.backend.read([keys[i] for i in batch], [dests[i] for i in batch])
                    statuses.update(zip(batch, got))
                    await turn.yield_to_earlier()

        n_workers = min(2 * self.cfg.io_threads, -(-len(present) // per))
        if n_workers <= 1:
            await worker()
            return statuses
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(n_workers):
                    tg.create_task(worker())
        except ExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return statuses

    def _account_read(self, rid: str, keys: list[str], statuses: dict[int, ReadStatus],
                      queued_s: float, read_s: float) -> ReadResult:
        found = [False] * len(keys)
        corrupt = []
        for i, status in statuses.items():
            if status is ReadStatus.OK:
                found[i] = True
            elif status in _GONE:
                self.index.remove(keys[i])
                if status is ReadStatus.CORRUPT:
                    corrupt.append(keys[i])
        n_read = sum(found)
        nbytes = n_read * self.block_bytes
        s = self._stats
        s["hits"] += n_read
        s["misses"] += len(keys) - n_read
        s["blocks_read"] += n_read
        s["bytes_read"] += nbytes
        log.info("blocks_read", request_id=rid, blocks=len(keys), read=n_read,
                 missing=len(keys) - n_read, corrupt=len(corrupt), bytes=nbytes,
                 queued_ms=round(queued_s * 1e3, 3), read_ms=round(read_s * 1e3, 3), read_q=self.read_q)
        return ReadResult(rid, keys, found, corrupt, nbytes, queued_s, read_s)

    # ------------------------------------------------------------------ writes
    async def write_block(self, key: str, payload) -> bool:
        """Store one Full Block durably; False if it was already stored (a cheap no-op).

        ``payload``: a buffer of exactly one Full Block, or a list of views totalling one.
        Raises InvalidArgument, StorageError (media failed: nothing stored), ResourceExhausted
        (capacity taken by blocks being read; retryable).
        """
        key = validate_key(key)
        views = normalize_payload(payload, self.block_bytes)
        with self._op():
            self._stats["write_requests"] += 1
            return await self._write_one(key, views, self._order_key(None))

    async def write_blocks(self, keys: Sequence[str], payloads: Sequence, *,
                           request_id: str | None = None) -> list[bool]:
        """WriteBlocks: all writes run to completion, then the first error (if any) is raised."""
        keys = validate_keys(keys)
        self.read_queue.check_limits(len(keys))
        if len(payloads) != len(keys):
            raise InvalidArgument(f"need one payload per key: {len(keys)} keys, {len(payloads)} payloads")
        views = [normalize_payload(p, self.block_bytes) for p in payloads]
        rid = request_id or f"write-{next(self._req_ids)}"
        order = self._order_key(None)
        with self._op():
            self._stats["write_requests"] += 1
            t0 = time.monotonic()
            results = await asyncio.gather(*(self._write_one(k, v, order) for k, v in zip(keys, views)),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            log.info("blocks_written", request_id=rid, blocks=len(keys),
                     written=sum(r is True for r in results), duplicates=sum(r is False for r in results),
                     failed=len(errors), write_ms=round((time.monotonic() - t0) * 1e3, 3))
            if errors:
                raise errors[0]
            return [r for r in results if not isinstance(r, BaseException)]   # all of them

    async def _write_one(self, key: str, views: list[memoryview], order: int) -> bool:
        while True:
            if self.index.touch(key):
                self._stats["duplicate_writes"] += 1
                return False
            busy = self._writing.get(key) or self._deleting.get(key)
            if busy is None:
                break
            await busy.wait()
        done = self._writing[key] = asyncio.Event()
        try:
            await finish_uncancelled(self._write_new(key, views, order))
        finally:
            del self._writing[key]
            done.set()
        return True

    async def _write_new(self, key: str, views: list[memoryview], order: int) -> None:
        async with self._write_sem:
            victims = self.index.reserve()
            try:
                if victims:
                    await self._delete_files(victims)
                await self.write_shaper.acquire(self.block_bytes, order)
                await self.backend.write(key, views)
            except BaseException:
                self.index.unreserve()
                raise
            self.index.add(key, reserved=True)
        self._stats["blocks_written"] += 1
        self._stats["bytes_written"] += self.block_bytes

    # ------------------------------------------------------------------ deletes
    async def delete(self, key: str) -> bool:
        """Remove a block; raises ResourceExhausted (retryable) while it is being read."""
        key = validate_key(key)
        with self._op():
            while key in self._writing or key in self._deleting:
                await (self._writing.get(key) or self._deleting[key]).wait()
            if self.index.pin_count(key):
                raise ResourceExhausted(f"block {key} is being read; delete it later",
                                        retry_after_s=self.cfg.overloaded_retry_after_s)
            existed = self.index.remove(key)
            existed = await self._delete_files([key]) > 0 or existed
            self._stats["blocks_deleted"] += existed
            return existed

    async def _delete_files(self, keys: list[str]) -> int:
        """Delete files of keys already removed from the index; writes of them wait meanwhile."""
        for key in keys:
            self._deleting[key] = asyncio.Event()
        try:
            return await self.backend.delete(keys)
        finally:
            for key in keys:
                self._deleting.pop(key).set()

    # ------------------------------------------------------------------ metrics
    def _link_counters(self) -> dict[str, float]:
        """The link's counters over both directions; a full-duplex link also states its write
        direction's waits apart (``link_write_*``)."""
        out = self.shaper.counters()
        if self.write_shaper is not self.shaper:
            writes = self.write_shaper.counters()
            for key in ("link_bytes_charged", "link_waits", "link_wait_s"):
                out[key] += writes[key]
                out[key.replace("link_", "link_write_")] = writes[key]
        return out

    def stats(self) -> dict[str, float]:
        """Every counter and gauge of the store (the gateway's Stats reply and telemetry)."""
        return {**self._stats, **self.backend.counters(), **self.read_queue.counters(),
                **self._link_counters(), "evictions": self.index.evictions,
                "blocks_stored": len(self.index), "bytes_stored": self.index.used_bytes,
                "capacity_bytes": self.cfg.capacity_bytes, "pinned_blocks": self.index.pinned_blocks}
