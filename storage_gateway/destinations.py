"""Payload sources and read destinations as lists of contiguous byte views.

A Full Block may be read into one flat buffer, or scattered: one view per layer (or per piece
of a layer when a pool allocation is split across extents), in the order of the block's bytes.
The data-path services lay a request out as ``[L, tokens, B]`` (``common.kv.request_kv_view``);
``scatter_views`` and ``allocation_scatter_views`` give the per-block view lists for that
layout so ``os.preadv`` fills each layer of each block in place.

The gateway's own read paths (a requester's shared-memory segment, its staging) pass
``ArenaRuns`` instead: one flat arena view and the block's ``(offset, nbytes)`` runs in it,
computed for a whole batch in closed form by ``block_runs`` (a few numpy operations, not a
Python loop and a numpy view per layer per block: that cost ~0.05 s/GB on the gateway's event
loop, docs/performance.md). The I/O thread slices the arena into the iovecs of one ``preadv``
only when it reads the block (``as_views``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.errors import InvalidArgument
from common.kv import KVSpec


def _as_view(obj, what: str, writable: bool) -> memoryview:
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidArgument(f"{what}: array is not contiguous; pass contiguous views")
        if writable and not obj.flags.writeable:
            raise InvalidArgument(f"{what}: array is read-only")
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgument(f"{what}: {type(obj).__name__} is not a buffer") from None
    if not mv.c_contiguous:
        raise InvalidArgument(f"{what}: buffer is not contiguous")
    if writable and mv.readonly:
        raise InvalidArgument(f"{what}: buffer is read-only")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class ArenaRuns:
    """One block's destination: ``(offset, nbytes)`` runs of one flat writable arena, in the
    order of the block's bytes. Cheap to make (no view per run); ``views()`` slices the arena
    where the I/O happens."""

    __slots__ = ("arena", "offsets", "lengths")

    def __init__(self, arena: memoryview, offsets: list[int], lengths: list[int]) -> None:
        self.arena, self.offsets, self.lengths = arena, offsets, lengths

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)

    def views(self) -> list[memoryview]:
        a = self.arena
        return [a[o:o + n] for o, n in zip(self.offsets, self.lengths)]

    def fill_zero(self) -> None:
        """Zero every run (a block that was not found must not leave stale bytes)."""
        for v in self.views():
            v[:] = bytes(len(v))


Destination = ArenaRuns | Sequence[memoryview]
"""What a backend reads one block into: checked by ``normalize_destinations``."""


def as_views(dest: Destination) -> Sequence[memoryview]:
    """The views of a normalized destination (what ``os.preadv`` and the hash take)."""
    return dest.views() if isinstance(dest, ArenaRuns) else dest


def _check_runs(runs: ArenaRuns, block_bytes: int, what: str) -> ArenaRuns:
    if runs.arena.readonly or runs.arena.ndim != 1 or runs.arena.format != "B":
        raise InvalidArgument(f"{what}: the arena must be a flat writable byte view")
    if runs.nbytes != block_bytes:
        raise InvalidArgument(f"{what}: runs hold {runs.nbytes} B, a Full Block is {block_bytes} B")
    if runs.offsets and (min(runs.offsets) < 0 or min(runs.lengths) < 0 or max(
            o + n for o, n in zip(runs.offsets, runs.lengths)) > len(runs.arena)):
        raise InvalidArgument(f"{what}: a run lies outside the {len(runs.arena)} B arena")
    return runs


def _is_single_buffer(obj) -> bool:
    return isinstance(obj, (np.ndarray, bytes, bytearray, memoryview))


def as_block_views(obj, block_bytes: int, what: str, writable: bool) -> list[memoryview]:
    """One block's bytes as views: a buffer (at least ``block_bytes``) or a list of views
    (exactly ``block_bytes`` in total)."""
    if _is_single_buffer(obj):
        mv = _as_view(obj, what, writable)
        if len(mv) < block_bytes or (not writable and len(mv) != block_bytes):
            raise InvalidArgument(f"{what}: {len(mv)} B given, a Full Block is {block_bytes} B")
        return [mv[:block_bytes]]
    if not isinstance(obj, Sequence) or isinstance(obj, str):
        raise InvalidArgument(f"{what}: expected a buffer or a list of buffers, got {type(obj).__name__}")
    views = [_as_view(o, f"{what}[{i}]", writable) for i, o in enumerate(obj)]
    total = sum(len(v) for v in views)
    if total != block_bytes:
        raise InvalidArgument(f"{what}: views hold {total} B, a Full Block is {block_bytes} B")
    return [v for v in views if len(v)]


def normalize_destinations(dests, n_keys: int,
                           block_bytes: int) -> list[Destination]:
    """One writable view list (or checked ``ArenaRuns``) per key; lengths checked before any
    I/O."""
    if not isinstance(dests, Sequence) or _is_single_buffer(dests) or len(dests) != n_keys:
        got = len(dests) if isinstance(dests, Sequence) and not _is_single_buffer(dests) else "not a list"
        raise InvalidArgument(f"need one destination per key: {n_keys} keys, {got} destinations")
    return [_check_runs(d, block_bytes, f"destination {i}") if isinstance(d, ArenaRuns)
            else as_block_views(d, block_bytes, f"destination {i}", True)
            for i, d in enumerate(dests)]


def normalize_payload(payload, block_bytes: int) -> list[memoryview]:
    return as_block_views(payload, block_bytes, "payload", False)


def scatter_views(region: np.ndarray, spec: KVSpec, n_blocks: int,
                  first_block: int = 0) -> list[list[np.ndarray]]:
    """Per-layer destinations of blocks ``first_block..`` in an ``[L, tokens, B]`` region."""
    if region.ndim != 3 or region.shape[0] != spec.num_layers or region.shape[2] != spec.kv_bytes_per_token_per_layer:
        raise InvalidArgument(f"region shape {region.shape} is not [L, tokens, B] of {spec.describe()}")
    t = spec.block_tokens
    if (first_block + n_blocks) * t > region.shape[1]:
        raise InvalidArgument(f"region of {region.shape[1]} tokens cannot hold blocks up to {first_block + n_blocks}")
    return [[region[layer, (first_block + i) * t:(first_block + i + 1) * t]
             for layer in range(spec.num_layers)] for i in range(n_blocks)]


def allocation_scatter_views(alloc, spec: KVSpec, tokens: int, n_blocks: int,
                             first_block: int = 0) -> list[list[np.ndarray]]:
    """Like ``scatter_views`` for a ``common.buffers.Allocation`` holding ``[L, tokens, B]``,
    split across pool extents or not."""
    lb, row = spec.layer_block_bytes, tokens * spec.kv_bytes_per_token_per_layer
    out = []
    for i in range(first_block, first_block + n_blocks):
        views: list[np.ndarray] = []
        for layer in range(spec.num_layers):
            views.extend(alloc.views(layer * row + i * lb, lb))
        out.append(views)
    return out


def block_runs(arena: memoryview, slots: Sequence[tuple[int, int]], n_blocks: int, spec: KVSpec,
               layer_major: bool) -> list[ArenaRuns]:
    """Where each block of a batch lands in ``arena``, in closed form: per block its runs in
    the order of the block's bytes (adjacent runs merged).

    ``slots`` map the batch's byte stream onto the arena; the stream is block-major (block i
    = bytes ``[i*bb, (i+1)*bb)``) or layer-major (layer l of block i at ``(l*n+i)*lb``). The
    stream is cut wherever a slot or a block's (layer's) part starts; each piece's arena
    offset is its slot's offset plus its distance into the slot; a stable sort by block puts
    the pieces of each block in its byte order. The caller checked that the slots hold exactly
    ``n_blocks`` Full Blocks.
    """
    bb, lb = spec.full_block_bytes, spec.layer_block_bytes
    if len(slots) == 1 and not layer_major:     # one run per block: no arrays needed
        (base, _), = slots
        return [ArenaRuns(arena, [base + i * bb], [bb]) for i in range(n_blocks)]
    total = n_blocks * bb
    so = np.fromiter((o for o, _ in slots), np.int64, len(slots))
    sn = np.fromiter((n for _, n in slots), np.int64, len(slots))
    so, sn = so[sn > 0], sn[sn > 0]
    sstart = np.cumsum(sn) - sn
    unit = lb if layer_major else bb
    cuts = np.union1d(sstart, np.arange(0, total, unit, dtype=np.int64))
    j = np.searchsorted(sstart, cuts, "right") - 1
    off = so[j] + (cuts - sstart[j])
    length = np.diff(cuts, append=total)
    block = cuts // unit % n_blocks if layer_major else cuts // unit
    if layer_major:
        order = np.argsort(block, kind="stable")
        off, length, block = off[order], length[order], block[order]
    new = np.ones(len(off), bool)
    new[1:] = (off[1:] != off[:-1] + length[:-1]) | (block[1:] != block[:-1])
    first = np.flatnonzero(new)
    offs, lens = off[first].tolist(), np.add.reduceat(length, first).tolist()
    bounds = np.searchsorted(block[first], np.arange(n_blocks + 1)).tolist()
    return [ArenaRuns(arena, offs[bounds[i]:bounds[i + 1]], lens[bounds[i]:bounds[i + 1]])
            for i in range(n_blocks)]
