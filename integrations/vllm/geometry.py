"""vLLM's paged KV cache (CPU backend) <-> dualpath's per-layer contiguous ``[tokens, B]`` bytes.

**vLLM side** (vLLM 0.32, ``vllm/v1/attention/backends/cpu_attn.py``): one tensor per
attention layer, shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; the CPU
attention splits each (block, head) region in halves, K then V. *Inside* the halves the C++
kernel (``cpu_attn_reshape_and_cache``, ISA ``vec``) keeps **K transposed, ``[head_size,
block_size]``**, and V row-major, ``[block_size, head_size]`` — measured: the stored bytes
against transformers' K/V of the same prefix, cosine 1.0000 for that layout and < 0.2 for
row-major K or any ``[head/x, block, x]`` tiling (docs/vllm.md). ISA ``amx`` (bf16 on CPUs with
AMX tiles) packs both halves in tiles, measured by writing known K/V through the same kernel:
**K ``[block/16, head/2, 16 tokens, 2 dims]``** and **V ``[head/16, block/2, 16 dims, 2
tokens]``** (``CacheGeometry.amx_views``; the geometry check compares both ways against the
kernel on such a CPU). Other ISAs (``neon``, ``vec16`` …) may pack differently and are refused
by the connector until measured.

**dualpath side** (the byte layout of B for vLLM models, docs/vllm.md): token-major, and per
token ``[2 (K then V), num_kv_heads, head_size]`` elements of the model's dtype, little-endian —
so ``B = 2 · kv_heads · head_size · itemsize`` (768 B for SmolLM2-135M in bf16). A token's KV is
contiguous, so any token range (a 64-token Full Block's layer, a hit prefix) is one slice.

Both directions are two advanced-indexing ops per layer (K, V) over (block id, offset) index
tensors built once per request — no per-token Python loop. Token ``t`` of a request lives at offset
``t % block_size`` of vLLM block ``block_ids[t // block_size]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


# the CPU attention ISAs whose in-block layout was measured (see the module docstring)
VERIFIED_ISAS = ("vec", "amx")


@dataclass(frozen=True)
class CacheGeometry:
    """The per-layer paged layout of one vLLM instance (CPU backend)."""

    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    isa: str = "vec"                 # vLLM's CPU attention ISA: which in-block layout

    @property
    def token_bytes(self) -> int:
        """B: bytes of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @classmethod
    def of_cache(cls, cache: torch.Tensor) -> CacheGeometry:
        """Read the geometry off a registered layer tensor ``[blocks, heads, bs, 2 * head]``."""
        if cache.dim() != 4 or cache.shape[3] % 2:
            raise ValueError(f"unexpected vLLM CPU KV cache shape {tuple(cache.shape)}: expected "
                             "[num_blocks, num_kv_heads, block_size, 2 * head_size]")
        if not cache.is_contiguous():
            raise ValueError(f"vLLM KV cache layer is not contiguous (strides {cache.stride()})")
        _, heads, block_size, two_head = cache.shape
        return cls(int(heads), int(two_head) // 2, int(block_size), cache.dtype)

    def for_isa(self, isa: str) -> CacheGeometry:
        """This geometry under ``isa``'s in-block layout; ValueError where it is not known."""
        if isa == "amx" and (self.dtype.itemsize != 2 or self.block_size % 16
                             or self.head_size % 16):
            raise ValueError(f"ISA 'amx' with {self.dtype}, block {self.block_size}, head "
                             f"{self.head_size}: layout not measured")
        if isa not in VERIFIED_ISAS:
            raise ValueError(f"ISA {isa!r}: layout not measured")
        return self if isa == self.isa else replace(self, isa=isa)

    def amx_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ISA ``amx``: the K half as ``[blocks, heads, bs/16, head/2, 16, 2]`` (token
        ``16·i + r``, dims ``2·j``, ``2·j + 1``) and the V half as ``[blocks, heads, head/16,
        bs/2, 16, 2]`` (dims ``16·i + r``, tokens ``2·j``, ``2·j + 1``): views."""
        n, h, bs, d = cache.shape[0], self.num_kv_heads, self.block_size, self.head_size
        halves = cache.view(n, h, 2, bs * d)
        return (halves[:, :, 0].view(n, h, bs // 16, d // 2, 16, 2),
                halves[:, :, 1].view(n, h, d // 16, bs // 2, 16, 2))

    def k_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, heads, head_size, block_size]``: the K half, transposed (a view)."""
        halves = cache.view(cache.shape[0], self.num_kv_heads, 2, self.block_size * self.head_size)
        return halves[:, :, 0].view(cache.shape[0], self.num_kv_heads, self.head_size,
                                    self.block_size)

    def v_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, heads, block_size, head_size]``: the V half, row-major (a view)."""
        halves = cache.view(cache.shape[0], self.num_kv_heads, 2, self.block_size * self.head_size)
        return halves[:, :, 1].view(cache.shape[0], self.num_kv_heads, self.block_size,
                                    self.head_size)


@dataclass(frozen=True)
class TokenSlots:
    """Where tokens ``start .. start+n-1`` of a request live in the paged cache."""

    block_index: torch.Tensor   # int64 [n]: vLLM block id of each token
    offset: torch.Tensor        # int64 [n]: row inside that block

    @property
    def tokens(self) -> int:
        return int(self.block_index.numel())


def token_slots(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> TokenSlots:
    """Slots of request tokens ``[start, stop)`` given the request's vLLM block ids."""
    if not 0 <= start <= stop:
        raise ValueError(f"bad token range [{start}, {stop})")
    if stop > len(block_ids) * block_size:
        raise ValueError(f"tokens up to {stop} need {-(-stop // block_size)} blocks of "
                         f"{block_size}, the request has {len(block_ids)}")
    positions = torch.arange(start, stop, dtype=torch.int64)
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return TokenSlots(ids[positions // block_size], positions % block_size)


def gather_layer(geom: CacheGeometry, cache: torch.Tensor, slots: TokenSlots) -> torch.Tensor:
    """One layer's KV of ``slots`` as ``uint8 [tokens, B]`` in dualpath's layout (a new tensor)."""
    out = torch.empty((slots.tokens, geom.token_bytes), dtype=torch.uint8)
    gather_layer_into(geom, cache, slots, out)
    return out


def gather_layer_into(geom: CacheGeometry, cache: torch.Tensor, slots: TokenSlots,
                      dst: torch.Tensor) -> None:
    """Copy one layer's KV of ``slots`` into ``dst`` (``uint8 [tokens, B]``, e.g. an arena view)."""
    _check_bytes(geom, slots, dst)
    kv = _typed(geom, slots, dst)                                         # [n, 2, heads, head]
    (k, k_at, _), (v, v_at, _) = _places(geom, cache, slots)
    kv[:, 0] = k[k_at].reshape(kv[:, 0].shape)
    kv[:, 1] = v[v_at].reshape(kv[:, 1].shape)


def scatter_layer(geom: CacheGeometry, cache: torch.Tensor, slots: TokenSlots,
                  src: torch.Tensor) -> None:
    """Write ``src`` (``uint8 [tokens, B]``, dualpath layout) into the cache at ``slots``."""
    _check_bytes(geom, slots, src)
    kv = _typed(geom, slots, src.contiguous())
    (k, k_at, k_shape), (v, v_at, v_shape) = _places(geom, cache, slots)
    k[k_at] = kv[:, 0].reshape(k_shape)
    v[v_at] = kv[:, 1].reshape(v_shape)


def scatter_range(geom: CacheGeometry, cache: torch.Tensor, block_ids: Sequence[int],
                  start: int, stop: int, src: torch.Tensor) -> None:
    """Write request tokens ``[start, stop)`` (``src``: ``uint8 [stop - start, B]``, dualpath
    layout) into the cache — the load of a hit. The vLLM blocks the range covers whole are
    written a block at a time (index by block id; the K transpose is one strided copy per
    block), only the partial blocks at either end token by token (``scatter_layer``): the
    same bytes at the same places (the geometry check compares both ways), ~1.6× faster
    measured for a 4k-token hit, since per-token indexing dominates the K half's scatter."""
    bs = geom.block_size
    if src.dtype != torch.uint8 or tuple(src.shape) != (stop - start, geom.token_bytes):
        raise ValueError(f"KV bytes must be uint8 [{stop - start}, {geom.token_bytes}], got "
                         f"{src.dtype} {tuple(src.shape)}")
    first, last = -(-start // bs), stop // bs          # blocks [first, last) covered whole
    if last <= first or geom.isa != "vec":             # (amx: token by token)
        scatter_layer(geom, cache, token_slots(block_ids, bs, start, stop), src)
        return
    if last > len(block_ids):                          # before any write
        raise ValueError(f"tokens up to {stop} need {last} blocks of {bs}, the request has "
                         f"{len(block_ids)}")
    head, tail = first * bs, last * bs
    if head > start:
        scatter_layer(geom, cache, token_slots(block_ids, bs, start, head), src[:head - start])
    ids = torch.as_tensor(list(block_ids[first:last]), dtype=torch.int64)
    mid = src[head - start:tail - start].contiguous().view(geom.dtype)
    kv = mid.view(last - first, bs, 2, geom.num_kv_heads, geom.head_size)
    geom.k_view(cache)[ids] = kv[:, :, 0].permute(0, 2, 3, 1)      # [n, heads, head, bs]
    geom.v_view(cache)[ids] = kv[:, :, 1].permute(0, 2, 1, 3)      # [n, heads, bs, head]
    if stop > tail:
        scatter_layer(geom, cache, token_slots(block_ids, bs, tail, stop), src[tail - start:])


Place = tuple[torch.Tensor, tuple, tuple[int, ...]]


def _places(geom: CacheGeometry, cache: torch.Tensor, slots: TokenSlots) -> tuple[Place, Place]:
    """Where the K and the V of ``slots`` live under ``geom.isa``'s layout: per half a view of
    the cache, the index that picks the tokens' elements from it, and the shape they come in
    (each reshapes to and from ``[n, heads, head]``)."""
    b, o = slots.block_index, slots.offset
    n, h, d = slots.tokens, geom.num_kv_heads, geom.head_size
    if geom.isa == "amx":
        k, v = geom.amx_views(cache)
        return ((k, (b, slice(None), o // 16, slice(None), o % 16), (n, h, d // 2, 2)),
                (v, (b, slice(None), slice(None), o // 2, slice(None), o % 2),
                 (n, h, d // 16, 16)))
    return ((geom.k_view(cache), (b, slice(None), slice(None), o), (n, h, d)),
            (geom.v_view(cache), (b, slice(None), o), (n, h, d)))


def _check_bytes(geom: CacheGeometry, slots: TokenSlots, buf: torch.Tensor) -> None:
    if buf.dtype != torch.uint8 or tuple(buf.shape) != (slots.tokens, geom.token_bytes):
        raise ValueError(f"KV bytes must be uint8 [{slots.tokens}, {geom.token_bytes}], got "
                         f"{buf.dtype} {tuple(buf.shape)}")


def _typed(geom: CacheGeometry, slots: TokenSlots, buf: torch.Tensor) -> torch.Tensor:
    """``uint8 [n, B]`` reinterpreted as ``[n, 2, heads, head]`` of the cache dtype (a view)."""
    return buf.view(geom.dtype).view(slots.tokens, 2, geom.num_kv_heads, geom.head_size)
