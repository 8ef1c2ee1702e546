"""dualpath Full Blocks in a local directory: a ``KVSource`` for one engine without a cluster.

The same keys (``common.kv.block_keys_from_tokens``: chained hashes over the real token ids)
and the same Full Block layout ``[L, 64, B]`` as the storage gateway, so what it holds is what
a cluster would store; it is how the geometry tests move KV from one vLLM instance to a fresh
one. Reads happen when the first layer is asked for; writes when the prompt finishes, one file
per new full block, written to a temp name and renamed (a reader never sees half a block).
A request is a ``PrefillHandle`` like the engine socket's, made blocking the same way
(``services.engine_api.blocking``), so the connector sees one shape whatever the source.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from common.errors import InvalidArgument
from common.kv import KVSpec, block_keys_from_tokens
from common.portal import Portal
from services.engine_api.blocking import Blocking, SyncPrefillHandle
from services.engine_api.prompt import PromptInfo

from integrations.vllm.kv_spec import check_same_layout


class LocalKVStore:
    """A directory of Full Block files named by block key, plus the spec that wrote them."""

    def __init__(self, root: str | os.PathLike[str], spec: KVSpec) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._spec = spec
        spec_file = self.root / "kv_spec.json"
        if spec_file.exists():
            check_same_layout(spec, msgspec.json.decode(spec_file.read_bytes(), type=KVSpec),
                              f"the KV store at {self.root}")
        else:
            spec_file.write_bytes(msgspec.json.encode(spec))
        self.bytes_read = 0
        self.bytes_written = 0
        self._portal: Portal | None = None       # started by the first request
        self._lock = threading.Lock()             # requests open from several threads

    @property
    def spec(self) -> KVSpec:
        return self._spec

    def path(self, key: str) -> Path:
        return self.root / f"{key}.kv"

    def planned_hit(self, params: dict[str, Any], token_ids: Sequence[int]) -> int:
        keys = block_keys_from_tokens(token_ids, self._spec.block_tokens)
        return self._stored_prefix(keys, len(token_ids)) * self._spec.block_tokens

    def _stored_prefix(self, keys: Sequence[str], prompt_tokens: int) -> int:
        """Leading stored blocks, leaving at least one token to compute (vLLM needs the last
        token's logits)."""
        limit = min(len(keys), (prompt_tokens - 1) // self._spec.block_tokens)
        blocks = 0
        while blocks < limit and self.path(keys[blocks]).exists():
            blocks += 1
        return blocks

    def open_prefill(self, request_id: str, token_ids: Sequence[int], planned_hit: int,
                     timeout_s: float, stop: Callable[[], bool] = lambda: False,
                     attempt: int | None = None) -> SyncPrefillHandle:
        keys = block_keys_from_tokens(token_ids, self._spec.block_tokens)
        hit_blocks = min(self._stored_prefix(keys, len(token_ids)),
                         planned_hit // self._spec.block_tokens)
        with self._lock:
            if self._portal is None:
                self._portal = Portal("dualpath-local-kv")
            portal = self._portal
        return Blocking(LocalPrefillSession(self, request_id, keys, hit_blocks, len(token_ids)),
                        portal)

    def abandon(self, request_id: str, reason: str, attempt: int | None = None) -> None:
        """Nothing waits for a claim here: no node to tell."""

    def read_blocks(self, keys: Sequence[str], out: np.ndarray) -> None:
        """Fill ``out`` (``[L, len(keys)·T, B]``) from the blocks' files."""
        t = self._spec.block_tokens
        for i, key in enumerate(keys):
            block = np.fromfile(self.path(key), dtype=np.uint8)
            if block.nbytes != self._spec.full_block_bytes:
                raise InvalidArgument(f"block {key}: {block.nbytes} B on disk, a Full Block "
                                      f"is {self._spec.full_block_bytes} B")
            out[:, i * t:(i + 1) * t] = block.reshape(self._spec.num_layers, t, -1)
            self.bytes_read += block.nbytes

    def write_block(self, key: str, full_block: np.ndarray) -> None:
        final = self.path(key)
        if final.exists():
            return
        tmp = final.with_suffix(f".tmp-{os.getpid()}")
        np.ascontiguousarray(full_block).tofile(tmp)
        tmp.rename(final)
        self.bytes_written += full_block.nbytes

    def close(self) -> None:
        portal, self._portal = self._portal, None
        if portal is not None:
            portal.stop()


class LocalPrefillSession:
    """One prompt against a ``LocalKVStore`` as a ``PrefillHandle``: the hit is read whole, the
    new blocks written at ``finish``; ``layer``/``output`` are views into one
    ``[L, prompt, B]`` array. The calls do their file I/O directly (no awaits): they run on
    the store's portal thread, off vLLM's forward thread."""

    def __init__(self, store: LocalKVStore, request_id: str, keys: list[str], hit_blocks: int,
                 prompt_tokens: int) -> None:
        spec = store.spec
        self._store, self._keys = store, keys
        self._hit = hit_blocks * spec.block_tokens
        self.info = PromptInfo(request_id, 0, "", prompt_tokens, self._hit, 1,
                               tuple(keys), None, spec.block_tokens,
                               "pe" if self._hit else "none", tuple(keys), None)
        self._kv = np.empty((spec.num_layers, prompt_tokens, spec.kv_bytes_per_token_per_layer),
                            dtype=np.uint8)
        self._loaded = False
        self._put: set[int] = set()
        self.dropped = False

    @property
    def request_id(self) -> str:
        return self.info.request_id

    @property
    def hit_tokens(self) -> int:
        return self._hit

    @property
    def new_tokens(self) -> int:
        return self.info.prompt_tokens - self._hit

    async def layer(self, layer: int, timeout_s: float | None = None) -> np.ndarray:
        if not self._loaded:
            hit_blocks = self._hit // self._store.spec.block_tokens
            self._store.read_blocks(self._keys[:hit_blocks], self._kv[:, :self._hit])
            self._loaded = True
        return self._kv[layer, :self._hit]

    def output(self, layer: int) -> np.ndarray:
        return self._kv[layer, self._hit:]

    def prompt_layer(self, layer: int) -> np.ndarray:
        return self._kv[layer]

    async def put_layer(self, layer: int, wait: bool = True) -> None:
        self._put.add(layer)            # in-process: nothing to pipeline (``wait`` is moot)

    async def finish(self, first_token_id: int | None = None) -> None:
        spec = self._store.spec
        if len(self._put) != spec.num_layers:
            raise InvalidArgument(f"request {self.request_id}: finish with layers "
                                  f"{sorted(set(range(spec.num_layers)) - self._put)} not put")
        t = spec.block_tokens
        for i in range(self._hit // t, len(self._keys)):
            self._store.write_block(self._keys[i], self._kv[:, i * t:(i + 1) * t])

    async def fail(self, error: BaseException | str | None = None) -> None:
        self._put.clear()
