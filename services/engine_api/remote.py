"""The cross-process engine API, engine side: what an engine in its own process imports.

``EngineClient`` (asyncio; its ``port`` is a ``PrefillQueue`` / ``DecodeQueue`` of
:mod:`.handles`) and ``SyncEngineClient`` (blocking: the same calls through a portal thread,
vLLM's connector). No ucxx, no transport, no node service is imported
(tests/test_engine_ipc.py checks it). See docs/engine-api.md "Cross-process".
"""

from .blocking import Blocking, SyncDecodeRequest, SyncEngineClient, SyncPrefillHandle
from .remote_async import (EngineClient, RemoteDecodePort, RemoteDecodeRequest,
                           RemotePrefillHandle, RemotePrefillPort)

__all__ = ["Blocking", "EngineClient", "RemoteDecodePort", "RemoteDecodeRequest",
           "RemotePrefillHandle", "RemotePrefillPort", "SyncDecodeRequest", "SyncEngineClient",
           "SyncPrefillHandle"]
