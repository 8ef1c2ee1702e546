"""What the connector needs from dualpath for one request: the engine-API handle shapes.

``PrefillSession`` is the prefill handle of ``services.engine_api`` seen from a synchronous
engine (the cross-process ``SyncEngineClient``'s handle has exactly these calls); ``KVSource``
opens one per request. Two sources exist: the node's engine socket (the real data path, PE
receiver / DE loader) and ``local_store.LocalKVStore`` (dualpath Full Blocks in a directory,
for one engine without a cluster and for the geometry tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from common.kv import KVSpec


class PrefillSession(Protocol):
    """One prefill attempt: read the hit layer by layer, write the new KV layer by layer."""

    @property
    def hit_tokens(self) -> int: ...

    @property
    def prompt_tokens(self) -> int: ...

    def layer(self, layer: int, timeout_s: float) -> np.ndarray:
        """``uint8 [hit_tokens, B]``: layer ``layer`` of the hit, blocking until it is loaded."""
        ...

    def output(self, layer: int) -> np.ndarray:
        """``uint8 [prompt_tokens - hit_tokens, B]``: where layer ``layer``'s new KV goes."""
        ...

    def put_layer(self, layer: int) -> None: ...

    def finish(self, first_token_id: int) -> None: ...

    def fail(self, reason: str) -> None: ...


class KVSource(Protocol):
    """One per process. vLLM's scheduler (engine-core process) asks ``planned_hit``; its worker
    (another process on the CPU backend: vLLM forces the multiprocessing executor there) opens
    the session, so nothing but plain data crosses between the two."""

    @property
    def spec(self) -> KVSpec: ...

    def planned_hit(self, params: dict[str, Any], token_ids: Sequence[int]) -> int:
        """Tokens of this prompt dualpath will load (whole blocks, below the prompt length)."""
        ...

    def open_prefill(self, request_id: str, token_ids: Sequence[int], planned_hit: int,
                     timeout_s: float) -> PrefillSession: ...

    def close(self) -> None: ...
