"""The cross-process engine API, engine side: what an engine in its own process imports.

``EngineClient`` (asyncio; its ``port`` is a drop-in for the in-process ``PrefillPort`` /
``DecodePort``) and ``SyncEngineClient`` (blocking, a loop in a thread: vLLM's connector).
No ucxx, no transport, no node service is imported (tests/test_engine_ipc.py checks it).
See docs/engine-api.md "Cross-process".
"""

from .remote_async import (EngineClient, RemoteDecodePort, RemoteDecodeRequest,
                           RemotePrefillHandle, RemotePrefillPort)
from .remote_sync import SyncDecodeRequest, SyncEngineClient, SyncPrefillHandle

__all__ = ["EngineClient", "RemoteDecodePort", "RemoteDecodeRequest", "RemotePrefillHandle",
           "RemotePrefillPort", "SyncDecodeRequest", "SyncEngineClient", "SyncPrefillHandle"]
