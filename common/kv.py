"""The KV data model: model specs, Full/Layer Block views, chained prefix block keys.

Paper §2.3 (Appendix A.5): storage moves *Full Blocks* ``[L, T, B]`` (all layers of T tokens),
per-layer transfers move *Layer Blocks* ``[1, T, B]``. The Full Block is laid out layer-major,
so layer ``l`` of a Full Block *is* a Layer Block: a numpy view, never a copy.

Block keys are a chained prefix hash: ``key_i = H(key_{i-1}, tokens of block i)``; equal keys
mean equal prefixes, so "longest stored prefix" is a walk along the key list. Keys are fixed
width lowercase hex (``KEY_HEX_LEN`` characters) and validated wherever they enter a process,
because the storage gateway derives file names from them.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from common.errors import InvalidArgument, KVSpecMismatch

KEY_BYTES = 16
KEY_HEX_LEN = 2 * KEY_BYTES
_KEY_RE = re.compile(rf"[0-9a-f]{{{KEY_HEX_LEN}}}")
ROOT_KEY = "0" * KEY_HEX_LEN
MOONCAKE_BLOCK_TOKENS = 512


class KVSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model's KV shape. ``kv_bytes_per_token_per_layer`` is B in ``[L, T, B]``."""

    name: str
    num_layers: int
    kv_bytes_per_token_per_layer: int
    block_tokens: int = 64
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        for field in ("num_layers", "kv_bytes_per_token_per_layer", "block_tokens"):
            if getattr(self, field) <= 0:
                raise InvalidArgument(f"KVSpec.{field} must be positive, got {getattr(self, field)}")

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer

    @property
    def layer_block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token_per_layer

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    def fingerprint(self) -> str:
        """Short id of the layout (not the name): peers with different layouts must not talk."""
        canon = f"{self.num_layers}:{self.kv_bytes_per_token_per_layer}:{self.block_tokens}:{self.dtype}"
        return hashlib.blake2b(canon.encode(), digest_size=8).hexdigest()

    def check_compatible(self, other_fingerprint: str, peer: str = "peer") -> None:
        if other_fingerprint and other_fingerprint != self.fingerprint():
            raise KVSpecMismatch(
                f"KV spec mismatch: {peer} has fingerprint {other_fingerprint}, this service "
                f"{self.fingerprint()} ({self.describe()}) — check the [kv] section of both configs")

    def describe(self) -> str:
        return (f"{self.name}: {self.num_layers} layers x {self.kv_bytes_per_token_per_layer} B/token, "
                f"{self.block_tokens}-token blocks")

    def blocks_for_tokens(self, tokens: int) -> int:
        """Full blocks in a prompt of ``tokens`` tokens (the partial tail is not stored)."""
        return tokens // self.block_tokens


PRESETS: dict[str, KVSpec] = {
    # Qwen2.5-32B, FP16 GQA: 8 KV heads x 128 dims x (K, V) x 2 B = 4 KiB per layer per token.
    "qwen2.5-32b": KVSpec("qwen2.5-32b", 64, 4096),
    # DeepSeek-V3.2, FlashMLA FP8 latent: 512 FP8 + 4 fp32 scales + 64 bf16 RoPE = 656 B.
    "deepseek-v3.2": KVSpec("deepseek-v3.2", 61, 656),
    # The paper's DS 27B (30 layers); 656 B MLA + ~68 B indexer key is an estimate (the paper
    # gives none).
    "ds-27b": KVSpec("ds-27b", 30, 724),
    # SmolLM2-135M under vLLM (docs/vllm.md): 3 KV heads x 64 dims x (K, V) x 2 B (bf16) = 768 B;
    # B is laid out [K|V][kv_head][head_dim] little-endian bf16 (integrations/vllm/geometry.py).
    "smollm2-135m": KVSpec("smollm2-135m", 30, 768, dtype="bfloat16"),
    # The same model served in float32 (vLLM --dtype float32): 1536 B. The real-engine tests use
    # it: bf16 logits tie exactly in greedy decoding, so token-for-token equality is decided by
    # the last bit of any reordered computation (docs/vllm.md "Why the equality tests run fp32").
    "smollm2-135m-f32": KVSpec("smollm2-135m-f32", 30, 1536, dtype="float32"),
    # Tiny model for tests: 4 layers x 256 B -> 16 KiB Layer Blocks, 64 KiB Full Blocks.
    "test-small": KVSpec("test-small", 4, 256),
}


def spec_from_config(cfg) -> KVSpec:
    """Build the spec a ``common.config.KVConfig`` asks for (preset, fields overridden)."""
    try:
        base = PRESETS[cfg.preset]
    except KeyError:
        raise InvalidArgument(f"unknown KV preset {cfg.preset!r}; known: {sorted(PRESETS)}") from None
    overrides = {f: getattr(cfg, f) for f in ("num_layers", "kv_bytes_per_token_per_layer",
                                              "block_tokens", "dtype") if getattr(cfg, f) is not None}
    return msgspec.structs.replace(base, **overrides) if overrides else base


# --------------------------------------------------------------------------- keys

def validate_key(key: object) -> str:
    """Return ``key`` if it is a well-formed block key, else raise InvalidArgument.

    Only fixed-width lowercase hex passes, so a key can never contain '/', '..' or NUL.
    """
    if not isinstance(key, str) or len(key) != KEY_HEX_LEN or not _KEY_RE.fullmatch(key):
        shown = repr(key)[:80]
        raise InvalidArgument(f"malformed block key {shown}: expected {KEY_HEX_LEN} lowercase hex chars")
    return key


def validate_keys(keys: Iterable[object], max_keys: int | None = None) -> list[str]:
    out = [validate_key(k) for k in keys]
    if max_keys is not None and len(out) > max_keys:
        raise InvalidArgument(f"too many block keys: {len(out)} > limit {max_keys}")
    return out


def chain_key(parent: str, payload: bytes) -> str:
    return hashlib.blake2b(bytes.fromhex(parent) + payload, digest_size=KEY_BYTES).hexdigest()


def tail_key(parent: str, tail_token_ids: Sequence[int] | None, tail_tokens: int) -> str:
    """Key of a prompt's partial last block (its token ids when known, else its length).

    Never stored; it names the tail's KV so the prefill and the decode side agree on it.
    """
    if tail_token_ids is not None:
        payload = np.asarray(tail_token_ids, dtype="<u4").tobytes()
    else:
        payload = b"tail-len:%d" % tail_tokens
    return chain_key(parent, b"tail:" + payload)


def synthetic_key(session_id: str, index: int) -> str:
    """Stand-in key of block ``index`` of a request that came without keys (never stored)."""
    return chain_key(ROOT_KEY, b"synthetic:%s:%d" % (session_id.encode(), index))


def block_keys_from_tokens(token_ids: Sequence[int] | np.ndarray, block_tokens: int = 64,
                           parent: str = ROOT_KEY) -> list[str]:
    """Chained keys of every *full* block of ``token_ids`` (the partial tail gets none)."""
    toks = np.asarray(token_ids)
    if toks.ndim != 1:
        raise InvalidArgument("token ids must be a flat sequence")
    if toks.size and (toks.min() < 0 or toks.max() >= 2**32):
        raise InvalidArgument("token ids must be in [0, 2**32)")
    toks = toks.astype("<u4", copy=False)
    keys, key = [], validate_key(parent)
    for i in range(toks.size // block_tokens):
        key = chain_key(key, toks[i * block_tokens:(i + 1) * block_tokens].tobytes())
        keys.append(key)
    return keys


def block_keys_from_mooncake(hash_ids: Sequence[int], input_length: int, block_tokens: int = 64,
                             namespace: bytes = b"") -> list[str]:
    """Map a Mooncake trace request (512-token prefix ``hash_ids``) onto our block keys.

    Each 512-token trace block expands to ``512 // block_tokens`` sub-blocks; keys chain over
    ``(hash_id, sub-index)``, so two requests sharing a trace prefix share our keys exactly.
    Only full ``block_tokens`` blocks inside ``input_length`` get keys.
    """
    if MOONCAKE_BLOCK_TOKENS % block_tokens:
        raise InvalidArgument(f"block_tokens {block_tokens} must divide {MOONCAKE_BLOCK_TOKENS}")
    per = MOONCAKE_BLOCK_TOKENS // block_tokens
    n_blocks = input_length // block_tokens
    if len(hash_ids) * per < n_blocks:
        raise InvalidArgument(f"{len(hash_ids)} hash_ids cannot cover {input_length} tokens")
    keys, key = [], ROOT_KEY
    for i in range(n_blocks):
        hid = hash_ids[i // per]
        if not isinstance(hid, int) or hid < 0:
            raise InvalidArgument(f"hash_ids must be non-negative ints, got {hid!r}")
        key = chain_key(key, namespace + struct.pack("<QI", hid, i % per))
        keys.append(key)
    return keys


# --------------------------------------------------------------------------- views

def full_block_view(buf: np.ndarray, spec: KVSpec) -> np.ndarray:
    """View a flat byte buffer of one Full Block as ``[L, T, B]`` (no copy)."""
    flat = _flat_bytes(buf, spec.full_block_bytes)
    return flat.reshape(spec.num_layers, spec.block_tokens, spec.kv_bytes_per_token_per_layer)


def layer_block(full_block: np.ndarray, layer: int) -> np.ndarray:
    """Layer Block ``[1, T, B]`` of a Full Block: a view of one contiguous layer slice."""
    if not 0 <= layer < full_block.shape[0]:
        raise InvalidArgument(f"layer {layer} out of range [0, {full_block.shape[0]})")
    return full_block[layer:layer + 1]


def request_kv_view(buf: np.ndarray, spec: KVSpec, tokens: int) -> np.ndarray:
    """View a request's region as ``[L, tokens, B]``: one layer of the request is contiguous.

    This is the layout the PE/DE buffers use so that a layer moves as one message and a storage
    read scatters each Full Block's layers into it (``os.preadv``).
    """
    flat = _flat_bytes(buf, spec.bytes_per_token * tokens)
    return flat.reshape(spec.num_layers, tokens, spec.kv_bytes_per_token_per_layer)


def _flat_bytes(buf: np.ndarray, nbytes: int) -> np.ndarray:
    flat = buf.reshape(-1).view(np.uint8)
    if flat.nbytes < nbytes:
        raise InvalidArgument(f"buffer of {flat.nbytes} B cannot hold {nbytes} B")
    return flat[:nbytes]
