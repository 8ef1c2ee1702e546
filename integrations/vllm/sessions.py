"""Where the connector's per-request handles come from: a ``KVSource`` per process.

A prefill request is a ``services.engine_api`` ``PrefillHandle`` seen blocking
(``SyncPrefillHandle``: vLLM's connector methods are synchronous); the connector uses it
directly. Two sources exist: the node's engine socket (the real data path, PE receiver / DE
loader: ``engine_source.EngineSource``) and ``local_store.LocalKVStore`` (dualpath Full Blocks
in a directory, for one engine without a cluster and for the geometry tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from common.kv import KVSpec
from services.engine_api.blocking import SyncPrefillHandle


class ClaimStopped(Exception):
    """vLLM gave the request up while its claim waited: the claim stopped asking."""


class KVSource(Protocol):
    """One per process. vLLM's scheduler (engine-core process) asks ``planned_hit``; its worker
    (another process on the CPU backend: vLLM forces the multiprocessing executor there) opens
    the request's handle, so nothing but plain data crosses between the two."""

    @property
    def spec(self) -> KVSpec: ...

    def planned_hit(self, params: dict[str, Any], token_ids: Sequence[int]) -> int:
        """Tokens of this prompt dualpath will load (whole blocks, below the prompt length)."""
        ...

    def open_prefill(self, request_id: str, token_ids: Sequence[int], planned_hit: int,
                     timeout_s: float, stop: Callable[[], bool] = ...,
                     attempt: int | None = None) -> SyncPrefillHandle:
        """Claim the request (off vLLM's step: it may wait for the plan); ``stop()`` turns
        true when vLLM gave the request up meanwhile; ``attempt`` (the plan's, when the
        frontend sent it): only that attempt — a re-plan sends the request to vLLM again, and
        the earlier attempt's vLLM request must not take the new plan."""
        ...

    def abandon(self, request_id: str, reason: str, attempt: int | None = None) -> None:
        """This engine will not claim ``request_id`` (``attempt``, when given): whoever waits
        for the claim stops."""
        ...

    def close(self) -> None: ...
