"""Prefill side of the engine API, in-process: the node's PE receiver behind a
:class:`~.handles.PrefillHandle`.

The node's PE receiver owns the buffers and the transfers; an engine sees a
:class:`PrefillPort` (one per engine) and, per request, a handle::

    while True:
        h = await port.next_request()            # hit length known, layer 0 on its way
        try:
            for l in range(L):
                hit_kv = await h.layer(l)          # [hit_tokens, B] view of the PE buffer
                ...compute layer l over hit + new tokens...
                h.output(l)[:] = new_kv            # [new_tokens, B] view: write the new KV
                await h.put_layer(l)               # forwarded to the decode side now
            await h.finish(first_token_id)
        except DualpathError as e:                 # revoked, peer failed, deadline
            await h.fail(e)                        # always end a handle: finish() or fail()

Views are never copies: ``layer(l)`` and ``output(l)`` point into the PE buffer (host
memory, or device memory when the buffer is a cupy arena). A handle must end with exactly
one of ``finish`` / ``fail``: the receiver frees the request's pages only then (or after its
``engine_release_timeout_s`` guard), so an engine never writes into pages given to another
request.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np

from common.errors import DeadlineExceeded, PeerFailed

from .prompt import PromptInfo
from .request_queue import RequestQueue, release_soon


class PrefillBackend(Protocol):
    """What the PE receiver implements behind a handle (one request attempt)."""

    info: PromptInfo
    engine_id: str
    hit_tokens: int

    async def wait_layer(self, layer: int) -> np.ndarray: ...
    def output_view(self, layer: int) -> np.ndarray: ...
    def region_layer(self, layer: int) -> np.ndarray: ...
    async def put_layer(self, layer: int) -> None: ...
    async def finish(self, first_token_id: int | None) -> None: ...
    async def fail(self, error: BaseException | None) -> None: ...
    def dropped(self) -> bool: ...


class PrefillRequest:
    """The in-process :class:`~.handles.PrefillHandle`: one request attempt of the PE
    receiver, with the handle's one rule of its own (it ends once)."""

    def __init__(self, backend: PrefillBackend) -> None:
        self._b = backend
        self.ended = False

    @property
    def info(self) -> PromptInfo:
        return self._b.info

    @property
    def request_id(self) -> str:
        return self._b.info.request_id

    @property
    def hit_tokens(self) -> int:
        return self._b.hit_tokens

    @property
    def new_tokens(self) -> int:
        return self._b.info.prompt_tokens - self._b.hit_tokens

    @property
    def dropped(self) -> bool:
        return self._b.dropped()

    async def layer(self, layer: int, timeout_s: float | None = None) -> np.ndarray:
        if timeout_s is None:
            return await self._b.wait_layer(layer)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._b.wait_layer(layer)
        except TimeoutError:
            raise DeadlineExceeded(f"layer {layer} of {self.request_id!r} not loaded within "
                                   f"{timeout_s:.3g}s (ask again)") from None

    def prompt_layer(self, layer: int) -> np.ndarray:
        return self._b.region_layer(layer)

    def output(self, layer: int) -> np.ndarray:
        return self._b.output_view(layer)

    async def put_layer(self, layer: int, wait: bool = True) -> None:
        """Returns when the layer is queued for sending: in-process that costs no round
        trip, so ``wait=False`` (the protocol's pipelined put) is the same call."""
        await self._b.put_layer(layer)

    async def finish(self, first_token_id: int | None = None) -> None:
        self.ended = True
        await self._b.finish(first_token_id)

    async def fail(self, error: BaseException | str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if isinstance(error, str):
            error = PeerFailed(f"engine {self._b.engine_id} gave {self.request_id!r} up: "
                               f"{error[:300] or 'no reason given'}")
        await self._b.fail(error)


class PrefillPort(RequestQueue[PrefillRequest]):
    """One prefill engine's queue of requests, filled by the PE receiver."""

    _role = "prefill"

    def _live(self, item: PrefillRequest) -> bool:
        return not item.dropped

    def _release(self, item: PrefillRequest) -> None:
        item.ended = True
        release_soon(item._b.fail(None))

    def _taken_back(self, item: PrefillRequest) -> None:
        item.ended = True

    async def next_request(self) -> PrefillRequest:
        """Wait for the next request (Cancelled once the port is closed)."""
        return await self._next()

    def close(self) -> None:
        """Closed: every queued request is released (the engine never saw them)."""
        self.closed = True
        while self._queue:
            self._release(self._queue.popleft())
        super().close()
