"""A synchronous engine client: the cross-process engine API for engines that are not asyncio.

vLLM's KV-connector methods are synchronous and run in its engine loop; they call
:class:`SyncEngineClient`, which runs one :class:`~.remote_async.EngineClient` on an event loop
in a daemon thread and waits for each call (every wait bounded: a timeout given, or the
attempt's own deadline on the node). Views are the same numpy views of the mapped arena::

    c = SyncEngineClient.connect(path, engine_id="p0.e0", role="prefill", kv_spec=spec)
    h = c.claim_prefill(request_id, timeout_s=5.0)
    for l in range(c.kv_spec.num_layers):
        hit = h.layer(l)                  # [hit_tokens, B]
        h.output(l)[:] = new_kv(l)        # [new_tokens, B]
        h.put_layer(l)
    h.finish(first_token_id)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

import numpy as np

from common.errors import DeadlineExceeded
from common.kv import KVSpec

from .decode import GeneratedBlock
from .prompt import PromptInfo
from .remote_async import (CALL_MARGIN_S, EngineClient, RemoteDecodePort, RemoteDecodeRequest,
                           RemotePrefillHandle)


class _LoopThread:
    """An event loop in a daemon thread; ``run`` waits for one coroutine on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(None if timeout_s is None else timeout_s + CALL_MARGIN_S)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise DeadlineExceeded(f"engine API call got no answer within {timeout_s}s") from None

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)
        if not self.thread.is_alive():
            self.loop.close()


class SyncEngineClient:
    """Blocking engine client (see the module docstring)."""

    def __init__(self, runner: _LoopThread, client: EngineClient) -> None:
        self._r = runner
        self._c = client

    @classmethod
    def connect(cls, socket_path: str, *, engine_id: str, role: str, kv_spec: KVSpec,
                timeout_s: float = 10.0, replace: bool = False) -> SyncEngineClient:
        """Attach as ``engine_id``; the typed errors of :meth:`EngineClient.connect`."""
        runner = _LoopThread(f"dualpath-engine-{engine_id}")
        try:
            client = runner.run(EngineClient.connect(
                socket_path, engine_id=engine_id, role=role, kv_spec=kv_spec,
                timeout_s=timeout_s, replace=replace), timeout_s)
        except BaseException:
            runner.stop()
            raise
        return cls(runner, client)

    @property
    def kv_spec(self) -> KVSpec:
        """The node's KV spec (equal in layout to the engine's, checked at attach)."""
        return self._c.kv_spec

    @property
    def engine_id(self) -> str:
        return self._c.engine_id

    @property
    def arena(self) -> np.ndarray:
        """The node's mapped arena (e.g. to pin it once: ``cudaHostRegister``)."""
        return self._c.arena

    @property
    def node_id(self) -> str:
        return self._c.node_id

    def close(self) -> None:
        """Detach (the node fails what this engine still holds) and stop the thread."""
        try:
            self._r.run(self._c.close(), 5.0)
        finally:
            self._r.stop()

    def __enter__(self) -> SyncEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        return self._r.run(coro, self._c.max_wait_s if timeout_s is None else timeout_s)

    # ------------------------------------------------------------------ requests
    def claim_prefill(self, request_id: str, timeout_s: float) -> SyncPrefillHandle:
        return SyncPrefillHandle(self, self._wait(self._c.claim_prefill(request_id, timeout_s),
                                                  timeout_s))

    def next_prefill(self, timeout_s: float) -> SyncPrefillHandle | None:
        h = self._wait(self._c.next_prefill(timeout_s), timeout_s)
        return None if h is None else SyncPrefillHandle(self, h)

    def claim_decode(self, request_id: str, timeout_s: float) -> SyncDecodeRequest:
        return SyncDecodeRequest(self, self._wait(self._c.claim_decode(request_id, timeout_s),
                                                  timeout_s))

    def next_decode(self, timeout_s: float) -> SyncDecodeRequest | None:
        d = self._wait(self._c.next_decode(timeout_s), timeout_s)
        return None if d is None else SyncDecodeRequest(self, d)


class SyncPrefillHandle:
    """One prefill request (blocking ``PrefillHandle``)."""

    def __init__(self, client: SyncEngineClient, h: RemotePrefillHandle) -> None:
        self._s, self._h = client, h

    @property
    def request_id(self) -> str:
        return self._h.request_id

    @property
    def info(self) -> PromptInfo:
        return self._h.info

    @property
    def hit_tokens(self) -> int:
        return self._h.hit_tokens

    @property
    def new_tokens(self) -> int:
        return self._h.new_tokens

    def layer(self, layer: int, timeout_s: float | None = None) -> np.ndarray:
        """``[hit_tokens, B]`` view once loaded (None: as long as the attempt lives)."""
        if timeout_s is None:
            return self._s._r.run(self._h.layer(layer), None)
        return self._s._wait(self._h.layer(layer, timeout_s), timeout_s)

    def output(self, layer: int) -> np.ndarray:
        return self._h.output(layer)

    def prompt_layer(self, layer: int) -> np.ndarray:
        return self._h.prompt_layer(layer)

    def put_layer(self, layer: int) -> None:
        self._s._wait(self._h.put_layer(layer))

    def finish(self, first_token_id: int | None = None) -> None:
        self._s._wait(self._h.finish(first_token_id))

    def fail(self, reason: BaseException | str | None = None) -> None:
        self._s._wait(self._h.fail(reason))


class SyncDecodeRequest:
    """One decode request (blocking ``DecodeRequest`` + ``DecodePort`` calls)."""

    def __init__(self, client: SyncEngineClient, req: RemoteDecodeRequest) -> None:
        self._s, self._req = client, req
        port = client._c.port
        assert isinstance(port, RemoteDecodePort)
        self._port = port

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def info(self) -> PromptInfo:
        return self._req.info

    @property
    def hit_tokens(self) -> int:
        return self._req.hit_tokens

    @property
    def first_token_id(self) -> int | None:
        return self._req.first_token_id

    def layer(self, layer: int) -> np.ndarray:
        """``[prompt_tokens, B]`` view of layer ``layer`` (valid until took_kv)."""
        return self._req.layer(layer)

    @property
    def kv(self) -> np.ndarray | None:
        return self._req.kv

    def took_kv(self) -> None:
        self._s._wait(self._port.took_kv(self._req))

    def second_token(self) -> None:
        self._s._wait(self._port.second_token(self._req))

    def new_block(self, token_ids: Any) -> GeneratedBlock:
        """A page ``blk.view`` ``[L, block_tokens, B]`` for this Full Block; ``blk.key``."""
        return self._s._wait(self._port.new_block(self._req, token_ids))

    def put_block(self, blk: GeneratedBlock) -> None:
        self._s._wait(self._port.put_block(self._req, blk))

    def finish(self, output_token_ids: list[int]) -> None:
        self._s._wait(self._port.finish(self._req, output_token_ids))

    def fail(self, reason: BaseException | str | None = None) -> None:
        self._s._wait(self._port.fail(self._req, reason))
