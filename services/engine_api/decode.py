"""Decode side of the engine API, in-process: the node's DE loader behind a
:class:`~.handles.DecodeHandle`.

The node's DE loader owns the DE buffer, assembles each request's full prompt KV there and
writes complete blocks back to storage; an engine sees a :class:`DecodePort`::

    while True:
        req = await port.next_ready()              # full prompt KV is in the DE buffer
        hbm = copy_to_device(req.layer(l) for l in range(L))   # H2D (cupy / CNIC RDMA)
        await req.took_kv()                        # the loader frees the host pages now
        ... decode ...; await req.second_token()   # first decoded token (TTST)
        # each time a 64-token block of prompt tail + generated tokens has KV:
        blk = await req.new_block(block_token_ids) # a host page [L, 64, B]
        blk.view[:] = kv_of_that_block             # D2H into it
        await req.put_block(blk)                   # the loader writes it back (async)
        await req.finish(output_token_ids)         # reported once write-backs are durable

A request must end with ``finish`` or ``fail``; ``took_kv`` must come before the engine
drops its views of the prompt KV. After a revocation every call raises ``Cancelled``: the
engine calls ``fail()`` (a no-op then) and forgets the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from common.errors import PeerFailed

from .handles import GeneratedBlock
from .prompt import PromptInfo
from .request_queue import RequestQueue, release_soon


class DecodeBackend(Protocol):
    """What the DE loader implements behind a request (one attempt)."""

    def dropped(self) -> bool: ...
    async def took_kv(self, req: DecodeRequest) -> None: ...
    async def second_token(self, req: DecodeRequest) -> None: ...
    async def new_block(self, req: DecodeRequest, token_ids: Any) -> GeneratedBlock: ...
    async def put_block(self, req: DecodeRequest, blk: GeneratedBlock) -> None: ...
    async def finish(self, req: DecodeRequest, output_token_ids: list[int]) -> None: ...
    async def fail(self, req: DecodeRequest, error: BaseException | None) -> None: ...


class DecodeRequest:
    """The in-process :class:`~.handles.DecodeHandle`: one DE loader attempt's request; KV
    views stay valid until ``took_kv``."""

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
        return self._region.layer(layer)

    @property
    def kv(self) -> np.ndarray | None:
        return self._region.whole()

    async def took_kv(self) -> None:
        await self._b.took_kv(self)

    async def second_token(self) -> None:
        await self._b.second_token(self)

    async def new_block(self, token_ids: Sequence[int]) -> GeneratedBlock:
        return await self._b.new_block(self, token_ids)

    async def put_block(self, blk: GeneratedBlock) -> None:
        await self._b.put_block(self, blk)

    async def finish(self, output_token_ids: Sequence[int]) -> None:
        await self._b.finish(self, list(output_token_ids))

    async def fail(self, error: BaseException | str | None = None) -> None:
        if isinstance(error, str):
            error = PeerFailed(f"engine {self.engine_id} gave {self.request_id!r} up: "
                               f"{error[:300] or 'no reason given'}")
        await self._b.fail(self, error)


class DecodePort(RequestQueue[DecodeRequest]):
    """One decode engine's queue of requests whose prompt KV is assembled."""

    _role = "decode"

    def _live(self, item: DecodeRequest) -> bool:
        return not item.cancelled

    def _release(self, item: DecodeRequest) -> None:
        release_soon(item._b.fail(item, None))

    async def next_ready(self) -> DecodeRequest:
        """Wait for the next request (Cancelled once the port is closed)."""
        return await self._next()
