"""The engine side of the cross-process engine API, for asyncio engines.

:class:`EngineClient` attaches to a node's engine socket and gives the same interface as the
in-process API — :class:`RemotePrefillPort` / :class:`RemotePrefillHandle` like
``PrefillPort`` / ``PrefillHandle``, :class:`RemoteDecodePort` / :class:`RemoteDecodeRequest`
like ``DecodePort`` / ``DecodeRequest`` — so ``tools/engine_sim`` runs unchanged through it,
plus claim by request id. Views are numpy views of the node's ``/dev/shm`` arena, mapped once;
no KV byte crosses the socket.

This module is what an engine process imports: it must not import ucxx, the transport or any
node service (``tests/test_engine_ipc.py`` checks ``sys.modules`` in a subprocess).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import numpy as np
import structlog

from common.config import RpcConfig
from common.errors import DeadlineExceeded, DualpathError, PeerFailed, ProtocolError
from common.kv import KVSpec
from common.protocol import (ArenaSlot, Assigned, AttachEngine, BlockOpened, ClaimRequest,
                             DecodeAssigned, EngineAttached, EnginePrompt, EngineReply,
                             FailRequest, FinishDecode, FinishPrefill, LayerReady, NewBlock,
                             NextRequest, PrefillAssigned, PutBlock, PutLayer, ReportCounters,
                             SecondToken, TookKV, WaitLayer)
from common.rpc_client import RpcClient
from common.shm import ShmMappings

from .decode import GeneratedBlock
from .prompt import PromptInfo

log = structlog.get_logger(__name__)

PREFETCH = 16              # requests one NextRequest may hand out (try_next's local queue)
CALL_MARGIN_S = 5.0        # RPC deadline beyond a call's own wait


class EngineClient:
    """One engine's attachment to its node (``await EngineClient.connect(...)``)."""

    def __init__(self, rpc: RpcClient, attached: EngineAttached, role: str,
                 arena: np.ndarray) -> None:
        self._rpc = rpc
        self._peer = rpc.peer
        self.attached = attached
        self.role = role
        self.arena = arena
        self.kv_spec: KVSpec = attached.kv_spec
        self.engine_id = attached.engine_id
        self.node_id = attached.node_id
        self.max_wait_s = attached.max_wait_s
        self._b = attached.kv_spec.kv_bytes_per_token_per_layer
        self.port: RemotePrefillPort | RemoteDecodePort = (
            RemotePrefillPort(self) if role == "prefill" else RemoteDecodePort(self))

    @classmethod
    async def connect(cls, socket_path: str, *, engine_id: str, role: str, kv_spec: KVSpec,
                      timeout_s: float = 10.0, replace: bool = False,
                      rpc: RpcConfig | None = None) -> EngineClient:
        """Connect, attach as ``engine_id`` and map the node's arena.

        Typed errors: Unavailable (no node there), KVSpecMismatch (naming both specs),
        NotFound (no such engine), AlreadyExists (attached elsewhere; ``replace=True`` takes
        it over), VersionMismatch.
        """
        cfg = rpc or RpcConfig(reconnect_attempts=0)     # retried up to timeout_s
        client = RpcClient(cfg, "", 0, role=f"engine:{role}", node_id=engine_id,
                           reply_type=EngineReply, unix_path=socket_path)
        try:
            await client.wait_connected(timeout_s)
            attached = await client.call(AttachEngine(engine_id, role, kv_spec,  # type: ignore[arg-type]
                                                      replace=replace), timeout=timeout_s)
            arena = ShmMappings(1).get(attached.arena_name, attached.arena_bytes)
        except BaseException:
            await client.close()
            raise
        log.info("engine_attached_to_node", engine=engine_id, node=attached.node_id,
                 arena_bytes=attached.arena_bytes)
        return cls(client, attached, role, arena)

    async def close(self) -> None:
        """Detach: the node fails whatever this engine still holds (retryable)."""
        await self._rpc.close()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, msg: Any, wait_s: float = 0.0) -> Any:
        """One call; a dropped connection is PeerFailed (the attachment is gone with it)."""
        if self._rpc.connected and self._rpc.peer is not self._peer:
            raise PeerFailed(f"engine {self.engine_id}: the connection to {self.node_id} was "
                             f"replaced; connect and attach again")
        if not self._rpc.connected and self._peer is not None:
            self._peer = None              # never reattach silently: the node detached us
        if self._peer is None:
            raise PeerFailed(f"engine {self.engine_id}: connection to {self.node_id} lost; "
                             f"connect and attach again")
        return await self._rpc.call(msg, timeout=wait_s + CALL_MARGIN_S)

    async def report_counters(self, counters: dict[str, float]) -> None:
        """The engine's cumulative counters; the node shows them in its stats (``engine_*``)."""
        await self.call(ReportCounters({str(k): float(v) for k, v in counters.items()}))

    # ------------------------------------------------------------------ getting requests
    async def next_prefill(self, timeout_s: float) -> RemotePrefillHandle | None:
        """The next prefill request assigned to this engine, or None after ``timeout_s``."""
        got = await self._next(timeout_s, 1)
        return got[0] if got else None

    async def next_decode(self, timeout_s: float) -> RemoteDecodeRequest | None:
        """The next decode request whose prompt KV is assembled, or None after ``timeout_s``."""
        got = await self._next(timeout_s, 1)
        return got[0] if got else None

    async def claim_prefill(self, request_id: str, timeout_s: float) -> RemotePrefillHandle:
        """The prefill request ``request_id`` once assigned here (NotFound after
        ``timeout_s``; InvalidArgument at once if another engine has it)."""
        return (await self._claim(request_id, timeout_s))[0]

    async def claim_decode(self, request_id: str, timeout_s: float) -> RemoteDecodeRequest:
        """The decode request ``request_id`` once its full prompt KV is in the DE buffer."""
        return (await self._claim(request_id, timeout_s))[0]

    async def _next(self, timeout_s: float, max_items: int) -> list[Any]:
        wait = min(timeout_s, self.max_wait_s)
        reply: Assigned = await self.call(NextRequest(wait, max_items), wait)
        return self._wrap(reply)

    async def _claim(self, request_id: str, timeout_s: float) -> list[Any]:
        wait = min(timeout_s, self.max_wait_s)
        reply: Assigned = await self.call(ClaimRequest(request_id, wait), wait)
        got = self._wrap(reply)
        if len(got) != 1:
            raise ProtocolError(f"claim of {request_id!r} answered with {len(got)} requests")
        return got

    def _wrap(self, reply: Assigned) -> list[Any]:
        return ([RemotePrefillHandle(self, p) for p in reply.prefill]
                + [RemoteDecodeRequest(self, d) for d in reply.decode])

    # ------------------------------------------------------------------ arena
    def view(self, slot: ArenaSlot) -> np.ndarray:
        """``[tokens, B]`` view of one slot of the arena (checked against its size)."""
        if not 0 <= slot.offset <= slot.offset + slot.nbytes <= self.arena.nbytes \
                or slot.nbytes % self._b:
            raise ProtocolError(f"node sent slot {slot} outside the {self.arena.nbytes}-byte "
                                f"arena or not whole tokens")
        return self.arena[slot.offset:slot.offset + slot.nbytes].reshape(-1, self._b)


def prompt_info(p: EnginePrompt) -> PromptInfo:
    return PromptInfo(p.request_id, p.attempt, p.session_id, p.prompt_tokens, p.hit_tokens,
                      p.gen_tokens, tuple(p.keys),
                      None if p.tail_token_ids is None else tuple(p.tail_token_ids),
                      p.block_tokens, p.read_side, tuple(p.block_keys), p.tail_key)


def _reason(error: BaseException | str | None) -> str:
    if error is None or isinstance(error, str):
        return error or ""
    return repr(error)[:300]


# --------------------------------------------------------------------------- prefill

class RemotePrefillHandle:
    """``PrefillHandle`` across processes: one request on this engine."""

    def __init__(self, client: EngineClient, msg: PrefillAssigned) -> None:
        self._c = client
        self.info = prompt_info(msg.prompt)
        self.hit_tokens = msg.hit_tokens
        self.ended = False
        self.dropped = False
        self._ready: dict[int, LayerReady] = {}

    @property
    def request_id(self) -> str:
        return self.info.request_id

    @property
    def new_tokens(self) -> int:
        return self.info.prompt_tokens - self.hit_tokens

    async def _call(self, msg: Any, wait_s: float = 0.0) -> Any:
        try:
            return await self._c.call(msg, wait_s)
        except DualpathError as e:
            if not isinstance(e, DeadlineExceeded):
                self.dropped = True
            raise

    async def layer(self, layer: int, timeout_s: float | None = None) -> np.ndarray:
        """``[hit_tokens, B]`` view of layer ``layer``'s hit KV once loaded (None: wait as
        long as the attempt lives; else DeadlineExceeded after ``timeout_s``)."""
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        while True:
            left = self._c.max_wait_s if end is None else max(0.0, end - loop.time())
            wait = min(left, self._c.max_wait_s)
            try:
                ready = await self._call(WaitLayer(self.request_id, self.info.attempt, layer,
                                                   wait), wait)
                break
            except DeadlineExceeded:
                if end is not None and loop.time() >= end:
                    raise
        self._ready[layer] = ready
        return self._c.view(ready.hit)

    def _slots(self, layer: int) -> LayerReady:
        ready = self._ready.get(layer)
        if ready is None:
            from common.errors import InvalidArgument
            raise InvalidArgument(f"output({layer}) before its hit KV was loaded: await "
                                  f"layer({layer}) first")
        return ready

    def output(self, layer: int) -> np.ndarray:
        """``[new_tokens, B]`` view to write layer ``layer``'s new KV into (after layer())."""
        return self._c.view(self._slots(layer).output)

    def prompt_layer(self, layer: int) -> np.ndarray:
        """``[prompt_tokens, B]`` view of the whole layer (after layer())."""
        return self._c.view(self._slots(layer).prompt)

    async def put_layer(self, layer: int) -> None:
        await self._call(PutLayer(self.request_id, self.info.attempt, layer),
                         self._c.max_wait_s)
        self._ready.pop(layer, None)

    async def finish(self, first_token_id: int | None = None) -> None:
        """Returns once the decode side holds the full prompt KV."""
        self.ended = True
        await self._call(FinishPrefill(self.request_id, self.info.attempt, first_token_id),
                         self._c.max_wait_s)

    async def fail(self, error: BaseException | str | None = None) -> None:
        """Give the request up (no-op once ended); errors of a gone node are swallowed."""
        if self.ended:
            return
        self.ended = True
        try:
            await self._c.call(FailRequest(self.request_id, self.info.attempt, _reason(error)))
        except DualpathError as e:
            log.debug("engine_fail_unacknowledged", request_id=self.request_id, error=repr(e))


class _RemotePort:
    """FIFO of requests handed to this engine, with a small local prefetch for try_next()."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.engine_id = client.engine_id
        self._local: deque[Any] = deque()
        self._poll: asyncio.Task | None = None
        self.closed = False

    def __len__(self) -> int:
        return len(self._local)

    async def _next(self) -> Any:
        while True:
            if self._local:
                return self._local.popleft()
            if self._poll is not None:
                await asyncio.wait({self._poll})
                continue
            self._local.extend(await self.client._next(self.client.max_wait_s, PREFETCH))

    def try_next(self) -> Any:
        """A request already here, else None (and ask the node for more in the background)."""
        if self._local:
            return self._local.popleft()
        if self._poll is None or self._poll.done():
            self._poll = asyncio.get_running_loop().create_task(self._fetch())
        return None

    async def _fetch(self) -> None:
        try:
            self._local.extend(await self.client._next(0.0, PREFETCH))
        except DualpathError as e:
            log.debug("engine_prefetch_failed", engine=self.engine_id, error=repr(e))
        finally:
            self._poll = None

    def close(self) -> None:
        self.closed = True
        if self._poll is not None:
            self._poll.cancel()


class RemotePrefillPort(_RemotePort):
    """``PrefillPort`` across processes."""

    async def next_request(self) -> RemotePrefillHandle:
        return await self._next()


# --------------------------------------------------------------------------- decode

class RemoteDecodeRequest:
    """``DecodeRequest`` across processes; views valid until ``took_kv``."""

    def __init__(self, client: EngineClient, msg: DecodeAssigned) -> None:
        self._c = client
        self.info = prompt_info(msg.prompt)
        self.engine_id = client.engine_id
        self.hit_tokens = msg.hit_tokens
        self.first_token_id = msg.first_token_id
        self.slots = msg.layers
        self.cancelled = False
        self.ended = False

    @property
    def request_id(self) -> str:
        return self.info.request_id

    def layer(self, layer: int) -> np.ndarray:
        """``[prompt_tokens, B]`` view of layer ``layer`` of the full prompt KV."""
        if not 0 <= layer < len(self.slots):
            from common.errors import InvalidArgument
            raise InvalidArgument(f"layer {layer} out of range [0, {len(self.slots)})")
        return self._c.view(self.slots[layer])

    @property
    def kv(self) -> np.ndarray | None:
        """``[L, prompt_tokens, B]`` view when the layers are one extent (else use layer())."""
        first, size = self.slots[0].offset, self.slots[0].nbytes
        if any(s.offset != first + i * size for i, s in enumerate(self.slots)):
            return None
        whole = self._c.view(ArenaSlot(first, size * len(self.slots)))
        return whole.reshape(len(self.slots), -1, whole.shape[1])

    async def call(self, msg: Any, wait_s: float = 0.0) -> Any:
        try:
            return await self._c.call(msg, wait_s)
        except DualpathError:
            self.cancelled = True
            raise


class RemoteDecodePort(_RemotePort):
    """``DecodePort`` across processes."""

    async def next_ready(self) -> RemoteDecodeRequest:
        return await self._next()

    async def took_kv(self, req: RemoteDecodeRequest) -> None:
        await req.call(TookKV(req.request_id, req.info.attempt))

    async def second_token(self, req: RemoteDecodeRequest) -> None:
        await req.call(SecondToken(req.request_id, req.info.attempt))

    async def new_block(self, req: RemoteDecodeRequest, token_ids: Any) -> GeneratedBlock:
        """A page ``[L, block_tokens, B]`` for the Full Block of ``token_ids``."""
        ids = [int(t) for t in token_ids]
        opened: BlockOpened = await req.call(NewBlock(req.request_id, req.info.attempt, ids),
                                             self.client.max_wait_s)
        spec = self.client.kv_spec
        view = self.client.view(opened.slot).reshape(spec.num_layers, spec.block_tokens, -1)
        return GeneratedBlock(opened.index, opened.key, tuple(ids), view)

    async def put_block(self, req: RemoteDecodeRequest, blk: GeneratedBlock) -> None:
        await req.call(PutBlock(req.request_id, req.info.attempt, blk.index))

    async def finish(self, req: RemoteDecodeRequest, output_token_ids: list[int]) -> None:
        req.ended = True
        await req.call(FinishDecode(req.request_id, req.info.attempt,
                                    [int(t) for t in output_token_ids]), self.client.max_wait_s)

    async def fail(self, req: RemoteDecodeRequest,
                   error: BaseException | str | None = None) -> None:
        if req.ended:
            return
        req.ended = True
        try:
            await self.client.call(FailRequest(req.request_id, req.info.attempt,
                                               _reason(error)))
        except DualpathError as e:
            log.debug("engine_fail_unacknowledged", request_id=req.request_id, error=repr(e))
