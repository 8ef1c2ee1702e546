"""Decode side of the engine API: what a decode engine embeds to take prompt KV and persist
generated KV.

The node's DE loader owns the DE buffer, assembles each request's full prompt KV there and
writes complete blocks back to storage; an engine sees a :class:`DecodePort`::

    while True:
        req = await port.next_ready()              # full prompt KV is in the DE buffer
        hbm = copy_to_device(req.layer(l) for l in range(L))   # H2D (cupy / CNIC RDMA)
        await port.took_kv(req)                    # the loader frees the host pages now
        ... decode ...; await port.second_token(req)   # first decoded token (TTST)
        # each time a 64-token block of prompt tail + generated tokens has KV:
        blk = await port.new_block(req, block_token_ids)   # a host page [L, 64, B]
        blk.view[:] = kv_of_that_block             # D2H into it
        await port.put_block(req, blk)             # the loader writes it back (async)
        await port.finish(req, output_token_ids)   # reported once write-backs are durable

A request must end with ``finish`` or ``fail``; ``took_kv`` must come before the engine
drops its views of the prompt KV. After a revocation every call raises ``Cancelled``: the
engine calls ``fail(req)`` (a no-op then) and forgets the request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from common.errors import Cancelled

from .claims import ClaimableQueue
from .prompt import PromptInfo


@dataclass(eq=False)
class GeneratedBlock:
    """A host page for one generated Full Block: ``view`` is ``[L, block_tokens, B]``."""

    index: int                # block index in the sequence (prompt blocks come first)
    key: str                  # its chained key (what storage will hold it under)
    token_ids: tuple[int, ...]
    view: np.ndarray
    region: Any = None        # loader's allocation


class DecodeRequest:
    """One request handed to a decode engine; KV views stay valid until ``took_kv``."""

    def __init__(self, info: PromptInfo, engine_id: str, hit_tokens: int,
                 first_token_id: int | None, region: Any, backend: Any) -> None:
        self.info = info
        self.engine_id = engine_id
        self.hit_tokens = hit_tokens
        self.first_token_id = first_token_id
        self._region = region
        self._b = backend

    @property
    def request_id(self) -> str:
        return self.info.request_id

    @property
    def cancelled(self) -> bool:
        return self._b.dropped()

    def layer(self, layer: int) -> np.ndarray:
        """``[prompt_tokens, B]`` view of layer ``layer`` of the full prompt KV."""
        return self._region.layer(layer)

    @property
    def kv(self) -> np.ndarray | None:
        """``[L, prompt_tokens, B]`` view when the region is one extent (else use ``layer``)."""
        return self._region.whole()


class DecodeBackend(Protocol):
    """What the DE loader implements behind a request (one attempt)."""

    def dropped(self) -> bool: ...
    async def took_kv(self, req: DecodeRequest) -> None: ...
    async def second_token(self, req: DecodeRequest) -> None: ...
    async def new_block(self, req: DecodeRequest, token_ids: Any) -> GeneratedBlock: ...
    async def put_block(self, req: DecodeRequest, blk: GeneratedBlock) -> None: ...
    async def finish(self, req: DecodeRequest, output_token_ids: list[int]) -> None: ...
    async def fail(self, req: DecodeRequest, error: BaseException | None) -> None: ...


class DecodePort(ClaimableQueue):
    """One decode engine's queue of requests whose prompt KV is assembled."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._queue: deque[DecodeRequest] = deque()
        self._ready = asyncio.Event()
        self.closed = False
        super().__init__()

    def __len__(self) -> int:
        return len(self._queue)

    def _live(self, req) -> bool:
        return not req.cancelled

    def put(self, req: DecodeRequest) -> None:
        self._queue.append(req)
        self._ready.set()
        self._note_arrival()

    def discard(self, req: DecodeRequest) -> bool:
        """Take a request back before the engine got it (True: the engine never saw it)."""
        try:
            self._queue.remove(req)
        except ValueError:
            return False
        return True

    def try_next(self) -> DecodeRequest | None:
        while self._queue:
            req = self._queue.popleft()
            if not req.cancelled:
                return req
            asyncio.get_running_loop().create_task(req._b.fail(req, None))
        self._ready.clear()
        return None

    async def next_ready(self) -> DecodeRequest:
        while True:
            if self.closed:
                raise Cancelled(f"decode port of {self.engine_id} is closed")
            req = self.try_next()
            if req is not None:
                return req
            await self._ready.wait()

    def close(self) -> None:
        self.closed = True
        self._ready.set()
        self._note_arrival()

    async def took_kv(self, req: DecodeRequest) -> None:
        """The engine copied the prompt KV (H2D): the host pages may be freed."""
        await req._b.took_kv(req)

    async def second_token(self, req: DecodeRequest) -> None:
        """The first decoded token exists (reported for TTST)."""
        await req._b.second_token(req)

    async def new_block(self, req: DecodeRequest, token_ids) -> GeneratedBlock:
        """A host page for the Full Block of ``token_ids`` (block_tokens ids: the rest of the
        prompt's tail, then generated ones); ``blk.key`` is its storage key."""
        return await req._b.new_block(req, token_ids)

    async def put_block(self, req: DecodeRequest, blk: GeneratedBlock) -> None:
        """The engine wrote ``blk.view``: the loader persists it and frees the page."""
        await req._b.put_block(req, blk)

    async def finish(self, req: DecodeRequest, output_token_ids: list[int]) -> None:
        """Decoding ended with ``output_token_ids`` (the prefill's first token included)."""
        await req._b.finish(req, list(output_token_ids))

    async def fail(self, req: DecodeRequest, error: BaseException | None = None) -> None:
        """Give the request up (or acknowledge a Cancelled): the loader frees what it holds."""
        await req._b.fail(req, error)
