"""Payload sources and read destinations as lists of contiguous byte views.

A Full Block may be read into one flat buffer, or scattered: one view per layer (or per piece
of a layer when a pool allocation is split across extents), in the order of the block's bytes.
The data-path services lay a request out as ``[L, tokens, B]`` (``common.kv.request_kv_view``);
``scatter_views`` and ``allocation_scatter_views`` give the per-block view lists for that
layout so ``os.preadv`` fills each layer of each block in place.
"""

from __future__ import annotations

import bisect
import itertools
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


def normalize_destinations(dests, n_keys: int, block_bytes: int) -> list[list[memoryview]]:
    """One writable view list per key; lengths checked before any I/O."""
    if not isinstance(dests, Sequence) or _is_single_buffer(dests) or len(dests) != n_keys:
        got = len(dests) if isinstance(dests, Sequence) and not _is_single_buffer(dests) else "not a list"
        raise InvalidArgument(f"need one destination per key: {n_keys} keys, {got} destinations")
    return [as_block_views(d, block_bytes, f"destination {i}", True) for i, d in enumerate(dests)]


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


def stream_block_pieces(slots: Sequence[tuple[int, int]], n_blocks: int, spec: KVSpec,
                        layer_major: bool) -> list[list[tuple[int, int]]]:
    """Where each block of a ``ReadBatch`` lands: per block, ``(offset, nbytes)`` runs of the
    requester's buffer in the order of the block's bytes (adjacent runs merged).

    ``slots`` map the batch's byte stream onto the buffer; the stream is block-major (block i
    = bytes ``[i*bb, (i+1)*bb)``) or layer-major (layer l of block i at ``(l*n+i)*lb``). Used
    by the shared-memory path, which writes each block in place instead of sending the stream.
    The caller checked that the slots hold exactly ``n_blocks`` Full Blocks.
    """
    starts = list(itertools.accumulate((n for _, n in slots), initial=0))
    bb, lb = spec.full_block_bytes, spec.layer_block_bytes

    def runs(pos: int, length: int, out: list[tuple[int, int]]) -> None:
        k = bisect.bisect_right(starts, pos) - 1
        while length > 0:
            off, n = slots[k]
            skip = pos - starts[k]
            take = min(length, n - skip)
            if take > 0:
                if out and out[-1][0] + out[-1][1] == off + skip:
                    out[-1] = (out[-1][0], out[-1][1] + take)
                else:
                    out.append((off + skip, take))
                pos, length = pos + take, length - take
            k += 1

    result = []
    for i in range(n_blocks):
        pieces: list[tuple[int, int]] = []
        if layer_major:
            for layer in range(spec.num_layers):
                runs((layer * n_blocks + i) * lb, lb, pieces)
        else:
            runs(i * bb, bb, pieces)
        result.append(pieces)
    return result
