"""The engine handles for engines that are not asyncio: a generic bridge, not a mirror.

vLLM's KV-connector methods are synchronous and run in its engine loop. :class:`Blocking`
wraps any object of the async engine API (the client, a handle): a coroutine method becomes
a call that runs on a private event loop thread (:class:`Portal`) and waits for its
result; a handle it returns comes back blocking too; everything else (views, ids,
``output(l)``) is the object's own. So the blocking API is the async one, call for call, and
nothing is declared twice. Every call is bounded where it runs: each round trip by its RPC
deadline, ``layer(l)`` without a timeout by the attempt's own deadline on the node::

    c = SyncEngineClient.connect(path, engine_id="p0.e0", role="prefill", kv_spec=spec)
    h = c.claim_prefill(request_id, timeout_s=5.0)
    for l in range(c.kv_spec.num_layers):
        hit = h.layer(l)                  # [hit_tokens, B]
        h.output(l)[:] = new_kv(l)        # [new_tokens, B]
        h.put_layer(l)
    h.finish(first_token_id)
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

from common.kv import KVSpec
from common.portal import Portal, PortalStopped

from .handles import DecodeHandle, PrefillHandle
from .liveness import StepClock
from .remote_async import CALL_MARGIN_S, EngineClient

T = TypeVar("T")

# a handle's ``fail`` once its client closed has nothing left to do (like a gone node's
# errors, which it swallows): closing detached the engine, and the node failed every attempt
# the engine held — a worker failing a session in an error path must not raise from there
_DONE_WHEN_CLOSED = frozenset({"fail"})


class Blocking(Generic[T]):
    """``target``'s coroutine methods as blocking calls on ``portal`` (module docstring)."""

    def __init__(self, target: T, portal: Portal) -> None:
        self._target = target
        self._portal = portal

    def __getattr__(self, name: str) -> Any:
        if name in ("_target", "_portal"):        # not set yet: no recursion through here
            raise AttributeError(name)
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        if name in _DONE_WHEN_CLOSED:
            return lambda *args, **kwargs: self._unless_closed(attr(*args, **kwargs))
        return lambda *args, **kwargs: self._blocking(self._portal.call(attr(*args, **kwargs)))

    def _unless_closed(self, coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            return self._portal.call(coro)
        except PortalStopped:
            return None

    def _blocking(self, value: Any) -> Any:
        return Blocking(value, self._portal) if _is_handle(value) else value


_HANDLE_TYPES: dict[type, bool] = {}


def _is_handle(value: Any) -> bool:
    """``value`` is a handle (decided once per type: a protocol check costs ~50 µs)."""
    kind = type(value)
    known = _HANDLE_TYPES.get(kind)
    if known is None:
        known = _HANDLE_TYPES[kind] = isinstance(value, (PrefillHandle, DecodeHandle))
    return known


SyncPrefillHandle = Blocking[PrefillHandle]
SyncDecodeRequest = Blocking[DecodeHandle]


class SyncEngineClient(Blocking[EngineClient]):
    """A blocking :class:`~.remote_async.EngineClient` that owns its portal's thread."""

    @classmethod
    def connect(cls, socket_path: str, *, engine_id: str, role: str, kv_spec: KVSpec,
                timeout_s: float = 10.0, replace: bool = False,
                steps: StepClock | None = None) -> SyncEngineClient:
        """Attach as ``engine_id``; the typed errors of :meth:`EngineClient.connect`.
        ``steps``: where the engine marks its steps (its heartbeat reports the current one)."""
        portal = Portal(f"dualpath-engine-{engine_id}")
        try:
            client = portal.call(EngineClient.connect(
                socket_path, engine_id=engine_id, role=role, kv_spec=kv_spec,
                timeout_s=timeout_s, replace=replace, steps=steps), timeout_s + CALL_MARGIN_S)
        except BaseException:
            portal.stop()
            raise
        return cls(client, portal)

    def close(self) -> None:
        """Detach (the node fails what this engine still holds) and stop the thread."""
        try:
            self._portal.call(self._target.close(), 5.0 + CALL_MARGIN_S)
        finally:
            self._portal.stop()

    def __enter__(self) -> SyncEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
