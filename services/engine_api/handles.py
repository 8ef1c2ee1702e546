"""The engine handles: what an engine holds for one request, per role, declared once.

An engine sees one request through a :class:`PrefillHandle` (prefill role) or a
:class:`DecodeHandle` (decode role), and pulls them from a :class:`PrefillQueue` /
:class:`DecodeQueue` (one per engine). Three implementations stand behind these shapes, and
every engine-side user is typed against them, never against one implementation:

* in-process — ``prefill.PrefillRequest`` / ``decode.DecodeRequest``, thin adapters over the
  node's attempt (the engine runs in the node service's loop);
* cross-process — ``remote_async.RemotePrefillHandle`` / ``RemoteDecodeRequest``, one engine
  message (``common/protocol/engine.py``) per call;
* blocking — ``blocking.Blocking`` over either of those, for engines that are not asyncio
  (vLLM's connector): the same calls, each waited for on a private event loop.

Both queues also carry the engine's collective begin/end (:class:`CollectiveSignals`).
The call sequences and their rules are in docs/engine-api.md. The protocols are
``runtime_checkable`` so the blocking bridge can tell a handle (made blocking in turn) from a
plain value in what a call returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .prompt import PromptInfo


@dataclass(eq=False)
class GeneratedBlock:
    """A host page for one generated Full Block: ``view`` is ``[L, block_tokens, B]``."""

    index: int                # block index in the sequence (prompt blocks come first)
    key: str                  # its chained key (what storage will hold it under)
    token_ids: tuple[int, ...]
    view: np.ndarray
    region: Any = None        # loader's allocation (in-process only)


@runtime_checkable
class PrefillHandle(Protocol):
    """One request on one prefill engine: read the hit layer by layer, write the new KV.

    Views are never copies: ``layer(l)`` and ``output(l)`` point into the PE buffer. A handle
    ends with exactly one of ``finish`` / ``fail``; the pages are freed only then.
    """

    @property
    def info(self) -> PromptInfo: ...

    @property
    def request_id(self) -> str: ...

    @property
    def hit_tokens(self) -> int:
        """Tokens whose KV is loaded (a block found missing at read time shortens it)."""
        ...

    @property
    def new_tokens(self) -> int:
        """Tokens the engine computes: ``prompt_tokens - hit_tokens``."""
        ...

    @property
    def dropped(self) -> bool:
        """True once the attempt was revoked or failed: stop and call ``fail()``."""
        ...

    async def layer(self, layer: int, timeout_s: float | None = None) -> np.ndarray:
        """``[hit_tokens, B]`` view of layer ``layer``'s hit KV once it is loaded (None: as
        long as the attempt lives; else DeadlineExceeded after ``timeout_s``)."""
        ...

    def output(self, layer: int) -> np.ndarray:
        """``[new_tokens, B]`` view where the engine writes layer ``layer``'s new KV (only
        after ``await layer(layer)``: until then its load may still land there)."""
        ...

    def prompt_layer(self, layer: int) -> np.ndarray:
        """``[prompt_tokens, B]`` view of the whole layer (hit part, then the new part)."""
        ...

    async def put_layer(self, layer: int, wait: bool = True) -> None:
        """Layer ``layer``'s new KV is written (layers in order): forward it. ``wait=False``
        may return before the put is through (a forward pass need not wait a round trip per
        layer); its failure is then raised by the next call on this handle, by ``finish()``
        at the latest. Either way the engine must not write that layer's output again."""
        ...

    async def finish(self, first_token_id: int | None = None) -> None:
        """Every layer was put; returns once the decode side holds the full prompt KV."""
        ...

    async def fail(self, error: BaseException | str | None = None) -> None:
        """Give the request up (or acknowledge that it was dropped); no-op once ended."""
        ...


@runtime_checkable
class DecodeHandle(Protocol):
    """One request on one decode engine whose full prompt KV is assembled in the DE buffer.

    Views stay valid until ``took_kv``; after a revocation every call raises ``Cancelled``
    and the engine calls ``fail()`` and forgets the request.
    """

    @property
    def info(self) -> PromptInfo: ...

    @property
    def request_id(self) -> str: ...

    @property
    def hit_tokens(self) -> int: ...

    @property
    def first_token_id(self) -> int | None:
        """The prefill engine's first token (None: the decode engine picks its own)."""
        ...

    @property
    def cancelled(self) -> bool: ...

    def layer(self, layer: int) -> np.ndarray:
        """``[prompt_tokens, B]`` view of layer ``layer`` of the full prompt KV."""
        ...

    @property
    def kv(self) -> np.ndarray | None:
        """``[L, prompt_tokens, B]`` view when the layers are one extent (else use ``layer``)."""
        ...

    async def took_kv(self) -> None:
        """The engine copied the prompt KV (H2D): the host pages may be freed."""
        ...

    async def second_token(self) -> None:
        """The first decoded token exists (reported for TTST)."""
        ...

    async def new_block(self, token_ids: Sequence[int]) -> GeneratedBlock:
        """A host page for the Full Block of ``token_ids`` (block_tokens ids: the rest of the
        prompt's tail, then generated ones); ``blk.key`` is its storage key."""
        ...

    async def put_block(self, blk: GeneratedBlock) -> None:
        """The engine wrote ``blk.view``: the loader persists it and frees the page."""
        ...

    async def finish(self, output_token_ids: Sequence[int]) -> None:
        """Decoding ended with ``output_token_ids`` (the prefill's first token included)."""
        ...

    async def fail(self, error: BaseException | str | None = None) -> None:
        """Give the request up (or acknowledge a Cancelled): the loader frees what it holds."""
        ...


class CollectiveSignals(Protocol):
    """What an engine tells its node about its own collectives (TP/EP communication): the
    node caps KV egress between begin and end (docs/qos.md, "Collectives tell the arbiter")."""

    async def collective_begin(self) -> None:
        """The engine enters a collective (nested begins need as many ends)."""
        ...

    async def collective_end(self) -> None:
        """The engine left the collective it began."""
        ...


class PrefillQueue(CollectiveSignals, Protocol):
    """One prefill engine's requests, FIFO (the in-process port or its remote stand-in)."""

    engine_id: str

    async def next_request(self) -> PrefillHandle:
        """Wait for the next request (Cancelled once the queue is closed)."""
        ...

    def try_next(self) -> PrefillHandle | None:
        """The next request already here, without waiting."""
        ...

    def close(self) -> None: ...


class DecodeQueue(CollectiveSignals, Protocol):
    """One decode engine's requests whose prompt KV is assembled, FIFO."""

    engine_id: str

    async def next_ready(self) -> DecodeHandle:
        """Wait for the next request (Cancelled once the queue is closed)."""
        ...

    def try_next(self) -> DecodeHandle | None:
        """The next request already here, without waiting."""
        ...

    def close(self) -> None: ...
