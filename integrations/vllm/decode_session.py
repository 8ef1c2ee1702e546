"""A decode instance's request: the prompt KV the DE loader assembled goes into vLLM's paged
cache before decoding; full blocks of generated tokens go back through the DE loader.

vLLM loads all prompt tokens but the last and recomputes that one (it needs its logits to
sample; vLLM's own P/D connectors do the same), so the decode instance's first token is the
greedy continuation of exactly the KV dualpath delivered. Only blocks whose KV exists are
written back — after ``n`` generated tokens that is prompt tail + ``output[:-1]`` — the rule
the scheduler and the DE loader assume (docs/engine-api.md).

The prompt KV is loaded off vLLM's step (an asynchronous load, docs/vllm.md): ``loaded`` hands
the node's pages back as soon as it is in the paged cache; the request's first forward then
produces the first token, its second forward the second (``second_token``, TTST).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from services.engine_api.blocking import SyncDecodeRequest

# fill(start_token, page [L, block_tokens, B]) copies those tokens' KV out of the paged cache
FillBlock = Callable[[int, np.ndarray], None]


class DecodeSession:
    """One claimed ``SyncDecodeRequest`` seen through the connector's session calls."""

    def __init__(self, req: SyncDecodeRequest, token_ids: list[int]) -> None:
        self._req, self._ids = req, token_ids
        self._took = self._second = False
        self._forwards = 0

    @property
    def info(self) -> Any:
        """The request's ``PromptInfo`` (its read side is what the hit counters label)."""
        return self._req.info

    @property
    def hit_tokens(self) -> int:
        return len(self._ids) - 1

    @property
    def prompt_tokens(self) -> int:
        return len(self._ids)

    def layer(self, layer: int, timeout_s: float) -> Any:
        return self._req.layer(layer)

    def loaded(self) -> None:
        """The prompt KV is in vLLM's paged cache: the node may take its pages back."""
        if not self._took:
            self._req.took_kv()
            self._took = True

    def after_step(self) -> None:
        """End of a forward of this request: the second one produced the second token."""
        self._forwards += 1
        if self._forwards == 2 and not self._second:
            self._req.second_token()
            self._second = True

    def finish(self, output_ids: list[int], fill: FillBlock) -> None:
        """Write back every full block whose KV exists, then finish with the output ids."""
        if not self._took:
            self._req.took_kv()
            self._took = True
        seq = self._ids + output_ids
        bt = self._req.info.block_tokens
        for index in range(len(self._ids) // bt, (len(seq) - 1) // bt):
            blk = self._req.new_block(seq[index * bt:(index + 1) * bt])
            fill(index * bt, blk.view)
            self._req.put_block(blk)
        self._req.finish(output_ids)

    def fail(self, reason: str) -> None:
        self._req.fail(reason)
