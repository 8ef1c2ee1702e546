"""What both sides of the data path (and the engines) know about one request attempt.

``PromptInfo`` is built from a scheduler ``RequestPlan`` on the PE side and from the PE's
``PrepareDecode`` on the DE side, with the same checks, so both agree on the token layout:
full blocks ``0 .. n_full-1`` (keys), then the partial tail (``prompt_tokens % block_tokens``
tokens, never stored), hit = the leading ``hit_tokens`` (whole blocks, covered by real keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import get_args

from common.errors import InvalidArgument
from common.kv import (
    ROOT_KEY,
    KVSpec,
    chain_key,
    synthetic_key,
    tail_key,
    validate_keys,
)
from common.protocol import ReadSide

# the wire decoder refuses other sides; a plan built in process is checked here too
READ_SIDES: tuple[ReadSide, ...] = get_args(ReadSide)


@dataclass(frozen=True)
class PromptInfo:
    """One attempt's prompt: sizes, real keys, tail token ids (checked by :func:`make_prompt`)."""

    request_id: str
    attempt: int
    session_id: str
    prompt_tokens: int
    hit_tokens: int                  # planned, usable: whole blocks within the real keys
    gen_tokens: int
    keys: tuple[str, ...]            # real keys of the prompt's leading full blocks
    tail_token_ids: tuple[int, ...] | None
    block_tokens: int
    read_side: ReadSide = "none"
    block_keys: tuple[str, ...] = field(default=(), compare=False)   # every full block
    tail_key: str | None = field(default=None, compare=False)
    # read side "split": the hit's leading tokens the DE reads and streams (the PE reads the
    # rest); 0 on every other side. Node-side only: engines never see it.
    split_tokens: int = field(default=0, compare=False)

    @property
    def n_full(self) -> int:
        return self.prompt_tokens // self.block_tokens

    @property
    def tail_tokens(self) -> int:
        return self.prompt_tokens % self.block_tokens

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    @property
    def hit_blocks(self) -> int:
        return self.hit_tokens // self.block_tokens

    @property
    def split_blocks(self) -> int:
        """A split read's first block read by the PE (0 on every other side)."""
        return self.split_tokens // self.block_tokens

    @property
    def de_read_tokens(self) -> int:
        """The hit's leading tokens the DE reads from storage: all of it on the DE path, the
        split on a split read, none otherwise."""
        side = self.read_side
        return self.hit_tokens if side == "de" else self.split_tokens if side == "split" else 0

    @property
    def fully_keyed(self) -> bool:
        """Every full block has a real key: generated blocks can be keyed and persisted."""
        return len(self.keys) == self.n_full

    def last_key(self) -> str:
        """Key the next full block chains on (the last full prompt block's, or the root)."""
        return self.keys[-1] if self.keys else ROOT_KEY

    def bytes(self, spec: KVSpec) -> int:
        return spec.bytes_per_token * self.prompt_tokens


def make_prompt(spec: KVSpec, *, request_id: str, attempt: int, session_id: str,
                prompt_tokens: int, hit_tokens: int, gen_tokens: int, hit_keys: Sequence[str],
                new_keys: Sequence[str], tail_token_ids: Sequence[int] | None,
                read_side: ReadSide, max_prompt_tokens: int,
                split_tokens: int = 0) -> PromptInfo:
    """Validate plan fields into a PromptInfo; InvalidArgument names the first problem.

    A hit without keys (``hit_tokens`` given by a frontend that sent no keys) is shortened to
    the keys there are: that part is recomputed, never read. A split read needs
    ``0 < split_tokens < hit_tokens`` in whole blocks; one whose hit was shortened to
    ``split_tokens`` or less is read on the DE side alone.
    """
    bt, rid = spec.block_tokens, request_id
    if not request_id or attempt < 0:
        raise InvalidArgument(f"request {rid!r}: bad request id or attempt {attempt}")
    if read_side not in READ_SIDES:
        raise InvalidArgument(f"request {rid!r}: read_side {read_side!r} not in {READ_SIDES}")
    if not 1 <= prompt_tokens <= max_prompt_tokens:
        raise InvalidArgument(f"request {rid!r}: prompt_tokens={prompt_tokens} outside "
                              f"[1, {max_prompt_tokens}]")
    if gen_tokens < 1:
        raise InvalidArgument(f"request {rid!r}: gen_tokens={gen_tokens} must be >= 1")
    if not 0 <= hit_tokens < prompt_tokens or hit_tokens % bt:
        raise InvalidArgument(f"request {rid!r}: hit_tokens={hit_tokens} must be a multiple of "
                              f"{bt} below prompt_tokens={prompt_tokens}")
    hit_keys, new_keys = validate_keys(hit_keys), validate_keys(new_keys)
    n_full = prompt_tokens // bt
    if new_keys and len(hit_keys) != hit_tokens // bt:
        raise InvalidArgument(f"request {rid!r}: {len(hit_keys)} hit keys for a hit of "
                              f"{hit_tokens // bt} blocks, but new keys follow them")
    keys = tuple(hit_keys) + tuple(new_keys)
    if len(keys) > n_full:
        raise InvalidArgument(f"request {rid!r}: {len(keys)} keys for {n_full} full blocks")
    tail = prompt_tokens - n_full * bt
    if tail_token_ids is not None:
        if len(tail_token_ids) != tail:
            raise InvalidArgument(f"request {rid!r}: {len(tail_token_ids)} tail token ids, the "
                                  f"prompt's last block has {tail} tokens")
        if any(not 0 <= t < 2**32 for t in tail_token_ids):
            raise InvalidArgument(f"request {rid!r}: tail token ids must be in [0, 2**32)")
        tail_token_ids = tuple(int(t) for t in tail_token_ids)
    if (read_side == "split") != (split_tokens != 0):
        raise InvalidArgument(f"request {rid!r}: split_tokens={split_tokens} with read side "
                              f"{read_side!r} (only a split read has, and needs, them)")
    if read_side == "split" and not (0 < split_tokens < hit_tokens and split_tokens % bt == 0):
        raise InvalidArgument(f"request {rid!r}: split_tokens={split_tokens} must be a multiple "
                              f"of {bt} inside the hit (0, {hit_tokens})")
    hit_tokens = min(hit_tokens, len(hit_keys) * bt)
    if read_side == "split" and split_tokens >= hit_tokens:
        read_side, split_tokens = "de", 0
    if hit_tokens == 0:
        read_side, split_tokens = "none", 0
    block_keys = list(keys)
    while len(block_keys) < n_full:
        block_keys.append(synthetic_key(session_id, len(block_keys)))
    parent = block_keys[-1] if block_keys else ROOT_KEY
    tkey = tail_key(parent, tail_token_ids, tail) if tail else None
    return PromptInfo(request_id, attempt, session_id, prompt_tokens, hit_tokens, gen_tokens,
                      keys, tail_token_ids, bt, read_side, tuple(block_keys), tkey, split_tokens)


def next_block_key(parent: str, token_ids: Sequence[int], block_tokens: int) -> str:
    """Key of the full block of ``token_ids`` following ``parent`` (common.kv's chain rule)."""
    import numpy as np

    if len(token_ids) != block_tokens:
        raise InvalidArgument(f"a block has {block_tokens} tokens, got {len(token_ids)}")
    toks = np.asarray(token_ids, dtype=np.int64)
    if toks.size and (toks.min() < 0 or toks.max() >= 2**32):
        raise InvalidArgument("token ids must be in [0, 2**32)")
    return chain_key(parent, toks.astype("<u4").tobytes())
