"""Preallocated page pools: the PE buffer, the DE buffer, staging areas.

One arena is allocated (and so registered with UCX's registration cache) once at start; each
request then takes pages from it and gives them back when it is done — never a registration or a
large allocation per request (docs/architecture.md, 'KV layout'). The pool prefers one contiguous
extent per request, so that a request's ``[L, tokens, B]`` KV region keeps each layer contiguous
and a layer moves as one UCX message; when the arena is fragmented it falls back to several extents
and the ``slots``/``views`` of a logical byte range tell the transport where the bytes are.

``shm=True`` (host memory only) puts the arena in a named ``/dev/shm`` segment
(``common.shm``) so the node's storage gateway can ``preadv`` Full Blocks straight into it —
one copy instead of two (docs/storage.md "Same-host shared memory"). If /dev/shm cannot hold
it the pool logs ``shm_arena_unavailable`` and uses private memory (reads then go over UCX).
``close()`` unlinks the segment; call it after the transport that registered the arena stopped.

Accounting is exact and checked: every page is either free or owned by exactly one live
allocation; double frees raise; ``counters()`` exposes the numbers for metrics and tests.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from common.errors import DeadlineExceeded, InternalError, InvalidArgument, ResourceExhausted

log = structlog.get_logger(__name__)


def _make_arena(nbytes: int, device: str, shm: bool = False, name: str = "pool"):
    """(arena, shm segment or None)."""
    if device == "host":
        if shm:
            from common.shm import ShmSegment
            try:
                seg = ShmSegment.create(nbytes)
                return seg.array, seg          # fallocated + MAP_POPULATE: already touched
            except OSError as e:
                log.warning("shm_arena_unavailable", pool=name, bytes=nbytes, error=str(e))
        arena = np.empty(nbytes, dtype=np.uint8)
        arena[::4096] = 0  # touch every page now so the first transfer does not page-fault
        return arena, None
    if device == "cuda":
        import cupy  # lazy: GPU-only dependency (extra "gpu")

        if not cupy.cuda.is_available():
            raise InvalidArgument("buffers.device = 'cuda' but no CUDA device is available")
        return cupy.empty(nbytes, dtype=cupy.uint8), None
    raise InvalidArgument(f"unknown buffer device {device!r}; use 'host' or 'cuda'")


def host_copies(views: Sequence[Any]) -> list[np.ndarray]:
    """``views`` with every device (cupy) view copied into host memory, host views as they
    are: what code that takes host arrays only (a write-back to the storage gateway) is handed
    from a pool on the GPU. The copies of one call share one page-locked buffer (a fast D2H,
    and the transport then sends host memory), pageable if pinning fails. Blocking: call it
    off the event loop (``asyncio.to_thread``). ``InternalError`` if a copy fails."""
    device = [i for i, v in enumerate(views) if is_device_array(v)]
    out = list(views)
    if not device:
        return out
    import cupy  # lazy: only a pool on the GPU gets here

    total = sum(int(views[i].nbytes) for i in device)
    try:
        import cupyx
        buf = cupyx.empty_pinned(max(total, 1), dtype=np.uint8)
    except Exception as e:   # no pinned memory to be had: pageable, slower and still correct
        log.warning("host_copies_not_pinned", bytes=total, error=repr(e))
        buf = np.empty(max(total, 1), np.uint8)
    pos = 0
    try:
        for i in device:
            v = views[i]
            n = int(v.nbytes)
            dst = buf[pos:pos + n]
            with v.device:
                flat = cupy.ascontiguousarray(v).reshape(-1).view(cupy.uint8)
                cupy.asnumpy(flat, out=dst)     # synchronous D2H into dst
            out[i] = dst
            pos += n
    except Exception as e:
        raise InternalError(f"copying {total} B of device KV to host failed: "
                            f"{type(e).__name__}: {e}") from e
    return out


def is_device_array(v: Any) -> bool:
    """Whether ``v`` is device memory (a cupy array or view; anything with the CUDA array
    interface)."""
    return hasattr(v, "__cuda_array_interface__") and not isinstance(v, np.ndarray)


@dataclass(eq=False)
class Allocation:
    """Pages owned by one request: a list of (first_page, n_pages) extents in logical order."""

    pool: PagePool
    owner: str
    extents: list[tuple[int, int]]
    nbytes: int
    alloc_id: int
    freed: bool = field(default=False)

    @property
    def n_pages(self) -> int:
        return sum(n for _, n in self.extents)

    @property
    def contiguous(self) -> bool:
        return len(self.extents) == 1

    def slots(self, start: int = 0, nbytes: int | None = None) -> list[tuple[int, int]]:
        """Arena ``(offset, nbytes)`` runs holding logical bytes ``[start, start+nbytes)``."""
        self._check_live()
        nbytes = self.nbytes - start if nbytes is None else nbytes
        if start < 0 or nbytes < 0 or start + nbytes > self.nbytes:
            raise InvalidArgument(f"range [{start}, {start + nbytes}) outside allocation of {self.nbytes} B")
        out: list[tuple[int, int]] = []
        page = self.pool.page_bytes
        pos = 0
        for first, n in self.extents:
            ext_len = n * page
            lo, hi = max(start, pos), min(start + nbytes, pos + ext_len)
            if lo < hi:
                out.append((first * page + lo - pos, hi - lo))
            pos += ext_len
            if pos >= start + nbytes:
                break
        return out

    def views(self, start: int = 0, nbytes: int | None = None) -> list[np.ndarray]:
        """Arena views (no copy) of logical bytes ``[start, start+nbytes)``."""
        arena = self.pool.arena
        return [arena[off:off + n] for off, n in self.slots(start, nbytes)]

    def view(self) -> np.ndarray:
        """The whole allocation as one flat view; only for contiguous allocations."""
        if not self.contiguous:
            raise InvalidArgument("allocation is not contiguous; use views()/slots()")
        (off, n), = self.slots()
        return self.pool.arena[off:off + n]

    def free(self) -> None:
        self.pool.free(self)

    def _check_live(self) -> None:
        if self.freed:
            raise InvalidArgument(f"allocation {self.alloc_id} of {self.owner!r} was already freed")


class PagePool:
    """A fixed arena of ``num_pages`` pages of ``page_bytes``; first-fit extents, merged on free."""

    def __init__(self, page_bytes: int, num_pages: int, device: str = "host", name: str = "pool",
                 shm: bool = False):
        if page_bytes <= 0 or num_pages <= 0:
            raise InvalidArgument("page_bytes and num_pages must be positive")
        self.name = name
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.arena, self.shm = _make_arena(page_bytes * num_pages, device, shm, name)
        self._free: list[tuple[int, int]] = [(0, num_pages)]  # sorted by first page, merged
        self._live: dict[int, Allocation] = {}
        self._next_id = 1
        self._free_pages = num_pages
        self._stats = {"allocations": 0, "frees": 0, "alloc_failures": 0, "split_allocations": 0}

    @classmethod
    def from_config(cls, cfg, name: str = "pool") -> PagePool:
        return cls(cfg.page_bytes, cfg.num_pages, cfg.device, name)

    def close(self) -> None:
        """Unlink the arena's shared-memory segment, if any (idempotent; memory stays valid
        for views still held)."""
        if self.shm is not None:
            self.shm.close()

    # ------------------------------------------------------------------ allocation
    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes))

    def alloc(self, nbytes: int, owner: str, allow_split: bool = True) -> Allocation:
        """Take pages for ``nbytes``; raises ResourceExhausted (retryable) when there is no room."""
        if nbytes <= 0:
            raise InvalidArgument(f"allocation size must be positive, got {nbytes}")
        need = self.pages_for(nbytes)
        if need > self.num_pages:
            raise InvalidArgument(f"{nbytes} B needs {need} pages; pool {self.name!r} has only {self.num_pages}")
        extents = self._take_contiguous(need)
        if extents is None and allow_split and need <= self._free_pages:
            extents = self._take_split(need)
            self._stats["split_allocations"] += 1
        if extents is None:
            self._stats["alloc_failures"] += 1
            raise ResourceExhausted(
                f"pool {self.name!r}: {need} pages wanted, {self._free_pages} free"
                f"{'' if allow_split else ' (contiguous required)'}")
        a = Allocation(self, owner, extents, nbytes, self._next_id)
        self._next_id += 1
        self._live[a.alloc_id] = a
        self._free_pages -= need
        self._stats["allocations"] += 1
        return a

    def _take_contiguous(self, need: int) -> list[tuple[int, int]] | None:
        for i, (first, n) in enumerate(self._free):
            if n >= need:
                if n == need:
                    del self._free[i]
                else:
                    self._free[i] = (first + need, n - need)
                return [(first, need)]
        return None

    def _take_split(self, need: int) -> list[tuple[int, int]]:
        # Largest extents first: fewest pieces, so fewest UCX messages for the request.
        order = sorted(range(len(self._free)), key=lambda i: (-self._free[i][1], self._free[i][0]))
        taken, left = [], need
        for i in order:
            first, n = self._free[i]
            k = min(n, left)
            taken.append((i, first, k))
            left -= k
            if left == 0:
                break
        extents = []
        for _i, first, k in sorted(taken, key=lambda t: t[1]):
            extents.append((first, k))
        for i, first, k in sorted(taken, key=lambda t: -t[0]):
            n = self._free[i][1]
            if k == n:
                del self._free[i]
            else:
                self._free[i] = (first + k, n - k)
        return extents

    def free(self, a: Allocation) -> None:
        """Return an allocation's pages; a second free of the same allocation raises."""
        if a.pool is not self:
            raise InvalidArgument("allocation belongs to another pool")
        if a.freed or self._live.pop(a.alloc_id, None) is None:
            raise InvalidArgument(f"double free of allocation {a.alloc_id} (owner {a.owner!r})")
        a.freed = True
        for first, n in a.extents:
            self._insert_free(first, n)
            self._free_pages += n
        self._stats["frees"] += 1

    def free_owner(self, owner: str) -> int:
        """Free every live allocation of ``owner`` (failure cleanup); returns pages freed."""
        mine = [a for a in self._live.values() if a.owner == owner]
        for a in mine:
            self.free(a)
        return sum(a.n_pages for a in mine)

    def _insert_free(self, first: int, n: int) -> None:
        i = bisect.bisect_left(self._free, (first, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > first:
            raise InternalError(f"page accounting broken: pages {first}.. freed while free")
        if i < len(self._free) and first + n > self._free[i][0]:
            raise InternalError(f"page accounting broken: pages {first}.. overlap a free extent")
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first:
            i -= 1
            first, n = self._free[i][0], self._free[i][1] + n
            del self._free[i]
        if i < len(self._free) and first + n == self._free[i][0]:
            n += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (first, n))

    # ------------------------------------------------------------------ inspection
    @property
    def free_pages(self) -> int:
        return self._free_pages

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._free_pages

    def live_allocations(self) -> Iterator[Allocation]:
        return iter(list(self._live.values()))

    def free_extents(self) -> list[tuple[int, int]]:
        return list(self._free)

    def largest_free_extent(self) -> int:
        return max((n for _, n in self._free), default=0)

    def counters(self) -> dict[str, float]:
        return {
            f"{self.name}_pages_total": self.num_pages,
            f"{self.name}_pages_free": self._free_pages,
            f"{self.name}_pages_used": self.used_pages,
            f"{self.name}_allocations_live": len(self._live),
            **{f"{self.name}_{k}": v for k, v in self._stats.items()},
        }

    def check_invariants(self) -> None:
        """Raise InternalError if free + owned pages do not tile the arena exactly."""
        marks = np.zeros(self.num_pages, dtype=np.int32)
        for first, n in self._free:
            marks[first:first + n] += 1
        for a in self._live.values():
            for first, n in a.extents:
                marks[first:first + n] += 1
        if not (marks == 1).all():
            bad = int(np.flatnonzero(marks != 1)[0])
            raise InternalError(f"pool {self.name!r}: page {bad} counted {marks[bad]} times")
        if sum(n for _, n in self._free) != self._free_pages:
            raise InternalError(f"pool {self.name!r}: free page counter out of sync")


class AsyncPagePool:
    """Awaitable allocation on top of a PagePool: wait (up to a deadline) for pages to free up."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._changed = asyncio.Condition()

    async def alloc(self, nbytes: int, owner: str, timeout_s: float,
                    allow_split: bool = True) -> Allocation:
        try:
            async with asyncio.timeout(timeout_s):
                async with self._changed:
                    while True:
                        try:
                            return self.pool.alloc(nbytes, owner, allow_split)
                        except ResourceExhausted:
                            await self._changed.wait()
        except TimeoutError:
            raise DeadlineExceeded(
                f"pool {self.pool.name!r}: no room for {nbytes} B within {timeout_s:.3g} s") from None

    async def free(self, a: Allocation) -> None:
        self.pool.free(a)
        async with self._changed:
            self._changed.notify_all()

    async def free_owner(self, owner: str) -> int:
        n = self.pool.free_owner(owner)
        async with self._changed:
            self._changed.notify_all()
        return n
