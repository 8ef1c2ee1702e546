"""Prefill side of the engine API: what a prefill engine embeds to get and give KV by layer.

The node's PE receiver owns the buffers and the transfers; an engine sees a
:class:`PrefillPort` (one per engine) and, per request, a :class:`PrefillHandle`::

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
from collections import deque
from typing import Protocol

import numpy as np

from common.errors import Cancelled

from .claims import ClaimableQueue
from .prompt import PromptInfo


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


class PrefillHandle:
    """One request on one prefill engine (see the module docstring for the call sequence)."""

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
        """Tokens whose KV is loaded (a block found missing at read time shortens it)."""
        return self._b.hit_tokens

    @property
    def new_tokens(self) -> int:
        """Tokens the engine computes: ``prompt_tokens - hit_tokens``."""
        return self._b.info.prompt_tokens - self._b.hit_tokens

    @property
    def dropped(self) -> bool:
        """True once the attempt was revoked or failed: stop and call ``fail()``."""
        return self._b.dropped()

    async def layer(self, layer: int) -> np.ndarray:
        """``[hit_tokens, B]`` view of layer ``layer``'s hit KV, once it is loaded."""
        return await self._b.wait_layer(layer)

    def prompt_layer(self, layer: int) -> np.ndarray:
        """``[prompt_tokens, B]`` view of the whole layer (hit part, then the new part)."""
        return self._b.region_layer(layer)

    def output(self, layer: int) -> np.ndarray:
        """``[new_tokens, B]`` view where the engine writes layer ``layer``'s new KV (only
        after ``await layer(layer)``: until then its load may still land there)."""
        return self._b.output_view(layer)

    async def put_layer(self, layer: int) -> None:
        """Layer ``layer``'s new KV is written: forward it (returns when queued for sending)."""
        await self._b.put_layer(layer)

    async def finish(self, first_token_id: int | None = None) -> None:
        """Every layer was put; returns once the decode side holds the full prompt KV."""
        self.ended = True
        await self._b.finish(first_token_id)

    async def fail(self, error: BaseException | None = None) -> None:
        """Give the request up (or acknowledge that it was dropped); frees its pages."""
        if self.ended:
            return
        self.ended = True
        await self._b.fail(error)


class PrefillPort(ClaimableQueue):
    """One prefill engine's queue of requests, filled by the PE receiver."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._queue: deque[PrefillHandle] = deque()
        self._ready = asyncio.Event()
        self.closed = False
        super().__init__()

    def __len__(self) -> int:
        return len(self._queue)

    def _live(self, h) -> bool:
        return not h.dropped

    def put(self, handle: PrefillHandle) -> None:
        """Receiver side: a request whose hit length is known is ready for this engine."""
        self._queue.append(handle)
        self._ready.set()
        self._note_arrival()

    def try_next(self) -> PrefillHandle | None:
        """The next live request without waiting (dropped ones are released on the way)."""
        while self._queue:
            h = self._queue.popleft()
            if not h.dropped:
                return h
            h.ended = True
            _release_soon(h)
        self._ready.clear()
        return None

    async def next_request(self) -> PrefillHandle:
        """Wait for the next request (Cancelled once the port is closed)."""
        while True:
            if self.closed:
                raise Cancelled(f"prefill port of {self.engine_id} is closed")
            h = self.try_next()
            if h is not None:
                return h
            await self._ready.wait()

    def discard(self, handle: PrefillHandle) -> bool:
        """Take a request back before the engine got it (True: the engine never saw it)."""
        try:
            self._queue.remove(handle)
        except ValueError:
            return False
        handle.ended = True
        return True

    def close(self) -> None:
        self.closed = True
        while self._queue:
            h = self._queue.popleft()
            h.ended = True
            _release_soon(h)
        self._ready.set()
        self._note_arrival()


def _release_soon(h: PrefillHandle) -> None:
    """A dropped request the engine never started: release it for the engine."""
    asyncio.get_running_loop().create_task(h._b.fail(None)).add_done_callback(_quiet)


def _quiet(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()      # the attempt logs its own failures
