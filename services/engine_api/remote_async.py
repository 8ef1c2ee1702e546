"""The engine side of the cross-process engine API, for asyncio engines.

:class:`EngineClient` attaches to a node's engine socket and gives the handles of
:mod:`.handles` — :class:`RemotePrefillHandle` is a ``PrefillHandle``,
:class:`RemoteDecodeRequest` a ``DecodeHandle``, their ports a ``PrefillQueue`` /
``DecodeQueue`` — so ``tools/engine_sim`` runs unchanged through it, plus claim by request id.
Each request-scoped call is one engine message (``common/protocol/engine.py``) built from the
handle's ``(request_id, attempt)`` and the call's arguments (:meth:`_RemoteRequest._send`).
Views are numpy views of the node's ``/dev/shm`` arena, mapped once; no KV byte crosses the
socket.

This module is what an engine process imports: it must not import ucxx, the transport or any
node service (``tests/test_engine_ipc.py`` checks ``sys.modules`` in a subprocess).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from common.config import RpcConfig
from common.errors import (DeadlineExceeded, DualpathError, InvalidArgument, PeerFailed,
                           ProtocolError, Unavailable)
from common.kv import KVSpec
from common.protocol import (AbandonRequest, ArenaSlot, Assigned, AttachEngine, BlockOpened,
                             ClaimRequest,
                             CollectiveBegin, CollectiveEnd, DecodeAssigned, EngineAlive, EngineAttached,
                             EnginePrompt, EngineReply,
                             FailRequest, FinishDecode, FinishPrefill, LayerReady, NewBlock,
                             NextRequest, PrefillAssigned, PutBlock, PutLayer, ReportCounters,
                             SecondToken, TookKV, WaitLayer)
from common.rpc_client import RpcClient
from common.shm import ShmMappings, ShmUnavailable

from .handles import GeneratedBlock
from .liveness import StepClock
from .prompt import PromptInfo

log = structlog.get_logger(__name__)

PREFETCH = 16              # requests one NextRequest may hand out (try_next's local queue)
CALL_MARGIN_S = 5.0        # RPC deadline beyond a call's own wait
ATTACH_RETRY_MAX_S = 0.5   # longest wait between connects to a node's socket that is not there


class EngineClient:
    """One engine's attachment to its node (``await EngineClient.connect(...)``)."""

    def __init__(self, rpc: RpcClient, attached: EngineAttached, role: str,
                 arena: np.ndarray, steps: StepClock | None = None) -> None:
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
        # the node detaches an engine it has not heard from for attached.silence_s: speak
        # every heartbeat_s from this loop, whatever the engine's own thread is doing, and
        # say how long the engine's current step has run (the engine marks them on steps)
        self.steps = steps or StepClock()
        self._heartbeat: asyncio.Task[None] | None = None
        if attached.heartbeat_s > 0:
            self._heartbeat = asyncio.get_running_loop().create_task(
                self._beat(attached.heartbeat_s), name=f"engine-heartbeat-{self.engine_id}")

    @classmethod
    async def connect(cls, socket_path: str, *, engine_id: str, role: str, kv_spec: KVSpec,
                      timeout_s: float = 10.0, replace: bool = False,
                      rpc: RpcConfig | None = None,
                      steps: StepClock | None = None) -> EngineClient:
        """Connect, attach as ``engine_id`` and map the node's arena.

        Typed errors: Unavailable (no node there), KVSpecMismatch (naming both specs),
        NotFound (no such engine), AlreadyExists (attached elsewhere; ``replace=True`` takes
        it over), VersionMismatch.
        """
        # retried up to timeout_s, at most ATTACH_RETRY_MAX_S apart: the node is local, a
        # refused connect costs nothing, and every second detached is a second not placed on
        cfg = rpc or RpcConfig(reconnect_attempts=0, reconnect_max_s=ATTACH_RETRY_MAX_S)
        client = RpcClient(cfg, "", 0, role=f"engine:{role}", node_id=engine_id,
                           reply_type=EngineReply, unix_path=socket_path)
        try:
            await client.wait_connected(timeout_s)
            attached = await client.call(AttachEngine(engine_id, role, kv_spec,  # type: ignore[arg-type]
                                                      replace=replace), timeout=timeout_s)
            try:
                arena = ShmMappings(1).get(attached.arena_name, attached.arena_bytes)
            except ShmUnavailable as e:       # another host / container / uid: nothing to map
                raise Unavailable(f"engine {engine_id} cannot map node "
                                  f"{attached.node_id}'s arena: {e}") from None
        except BaseException:
            await client.close()
            raise
        log.info("engine_attached_to_node", engine=engine_id, node=attached.node_id,
                 arena_bytes=attached.arena_bytes)
        return cls(client, attached, role, arena, steps)

    @property
    def connected(self) -> bool:
        """The connection to the node is open (False once the node closed it: it died,
        restarted, or another attach replaced this one; attaching again is up to the caller)."""
        return self._rpc.connected

    async def close(self) -> None:
        """Detach: the node fails whatever this engine still holds (retryable)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        await self._rpc.close()

    async def _beat(self, every_s: float) -> None:
        """``EngineAlive`` every ``every_s`` until the connection is gone (the node detached
        this engine, or it closed); a missed beat is retried at the next one."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.call(EngineAlive(self.steps.busy_s(), self.steps.count), wait_s=0.0)
            except PeerFailed:
                return                          # detached: a new attach brings a new client
            except DualpathError as e:
                log.warning("engine_heartbeat_failed", engine=self.engine_id,
                            node=self.node_id, code=e.code.value, error=e.message)

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

    async def collective_begin(self) -> None:
        """This engine enters a collective: the node caps KV egress until
        :meth:`collective_end` (or its ``arbiter.collective_max_s``; a detach ends it too).
        Here for blocking engines (the bridge wraps the client); the port sends it."""
        await self.port.collective_begin()

    async def collective_end(self) -> None:
        """This engine left the collective it began."""
        await self.port.collective_end()

    # ------------------------------------------------------------------ getting requests
    async def next_prefill(self, timeout_s: float) -> RemotePrefillHandle | None:
        """The next prefill request assigned to this engine, or None after ``timeout_s``."""
        self._check_role("prefill")
        got = await self._next(timeout_s, 1)
        return got[0] if got else None

    async def next_decode(self, timeout_s: float) -> RemoteDecodeRequest | None:
        """The next decode request whose prompt KV is assembled, or None after ``timeout_s``."""
        self._check_role("decode")
        got = await self._next(timeout_s, 1)
        return got[0] if got else None

    async def claim_prefill(self, request_id: str, timeout_s: float,
                            attempt: int | None = None) -> RemotePrefillHandle:
        """The prefill request ``request_id`` (its attempt ``attempt``, when given) once
        assigned here (NotFound after ``timeout_s``; InvalidArgument at once if another engine
        has it; Cancelled at once if that attempt was superseded)."""
        self._check_role("prefill")
        return (await self._claim(request_id, timeout_s, attempt))[0]

    async def claim_decode(self, request_id: str, timeout_s: float,
                           attempt: int | None = None) -> RemoteDecodeRequest:
        """The decode request ``request_id`` once its full prompt KV is in the DE buffer."""
        self._check_role("decode")
        return (await self._claim(request_id, timeout_s, attempt))[0]

    async def abandon(self, request_id: str, reason: str, timeout_s: float = 30.0,
                      attempt: int | None = None) -> None:
        """This engine will not claim ``request_id`` (it could not open it and computes it
        alone): the node fails the attempt assigned here now (only ``attempt``, when given),
        instead of at its deadline. Waits up to ``timeout_s`` for a plan not yet at the node
        (NotFound after that)."""
        await self.call(AbandonRequest(request_id, reason[:300], timeout_s, attempt), timeout_s)

    def _check_role(self, role: str) -> None:
        if role != self.role:
            raise InvalidArgument(f"engine {self.engine_id} attached as a {self.role} engine: "
                                  f"no {role} requests")

    async def _next(self, timeout_s: float, max_items: int) -> list[Any]:
        wait = min(timeout_s, self.max_wait_s)
        reply: Assigned = await self.call(NextRequest(wait, max_items), wait)
        return self._wrap(reply)

    async def _claim(self, request_id: str, timeout_s: float,
                     attempt: int | None = None) -> list[Any]:
        wait = min(timeout_s, self.max_wait_s)
        reply: Assigned = await self.call(ClaimRequest(request_id, wait, attempt), wait)
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


def _quiet(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _reason(error: BaseException | str | None) -> str:
    if error is None or isinstance(error, str):
        return error or ""
    return repr(error)[:300]


# --------------------------------------------------------------------------- handles

class _RemoteRequest:
    """What both remote handles share: the request's identity and one message per call."""

    _deadline_loses = False      # a DeadlineExceeded also means the attempt is gone

    def __init__(self, client: EngineClient, prompt: EnginePrompt, hit_tokens: int) -> None:
        self._c = client
        self.info = prompt_info(prompt)
        self.engine_id = client.engine_id
        self.hit_tokens = hit_tokens
        self.ended = False
        self._lost = False            # a call failed: the node dropped the attempt

    @property
    def request_id(self) -> str:
        return self.info.request_id

    async def _send(self, message: type, *fields: Any, wait_s: float = 0.0) -> Any:
        """``message(request_id, attempt, *fields)`` to the node; a failure means the node
        no longer holds the attempt (a prefill's deadline only means: ask again)."""
        try:
            return await self._c.call(message(self.request_id, self.info.attempt, *fields),
                                      wait_s)
        except DualpathError as e:
            if self._deadline_loses or not isinstance(e, DeadlineExceeded):
                self._lost = True
            raise

    async def fail(self, error: BaseException | str | None = None) -> None:
        """Give the request up (no-op once ended); errors of a gone node are swallowed."""
        if self.ended:
            return
        self.ended = True
        try:
            await self._c.call(FailRequest(self.request_id, self.info.attempt, _reason(error)))
        except DualpathError as e:
            log.debug("engine_fail_unacknowledged", request_id=self.request_id, error=repr(e))


class RemotePrefillHandle(_RemoteRequest):
    """A :class:`~.handles.PrefillHandle` across processes.

    ``put_layer(l, wait=False)`` returns at once (a forward pass need not wait a round trip
    per layer): the put goes out in order behind earlier ones, and its failure is raised by
    the next call on this handle — by ``finish()`` at the latest.

    ``layer(l)`` asks for layer ``l + 1`` as it returns (read-ahead), so while the engine
    computes layer ``l`` the next one's answer is on its way, and a forward pass waits a
    round trip per layer only where the KV itself is late. The node sees the engine one
    layer further on than it is (its look-ahead window moves one layer early).
    """

    def __init__(self, client: EngineClient, msg: PrefillAssigned) -> None:
        super().__init__(client, msg.prompt, msg.hit_tokens)
        self._ready: dict[int, LayerReady] = {}
        self._puts: list[asyncio.Task] = []          # put_layer(wait=False) calls
        self._ahead: dict[int, asyncio.Task[LayerReady]] = {}   # layer -> its read-ahead

    @property
    def dropped(self) -> bool:
        return self._lost

    @property
    def new_tokens(self) -> int:
        return self.info.prompt_tokens - self.hit_tokens

    async def layer(self, layer: int, timeout_s: float | None = None) -> np.ndarray:
        self._raise_failed_put()
        ahead = self._ahead.pop(layer, None)
        if ahead is None:
            ready = await self._wait_layer(layer, timeout_s)
        else:
            try:
                ready = await asyncio.wait_for(asyncio.shield(ahead), timeout_s)
            except TimeoutError:
                self._ahead[layer] = ahead      # still asking: the next layer(l) waits on
                raise DeadlineExceeded(f"layer {layer} of {self.request_id!r} not loaded "
                                       f"within {timeout_s:.3g}s (ask again)") from None
        self._ready[layer] = ready
        nxt = layer + 1
        if nxt < self._c.kv_spec.num_layers and nxt not in self._ready \
                and nxt not in self._ahead:
            ahead = asyncio.get_running_loop().create_task(
                self._wait_layer(nxt, None), name=f"read-ahead-{self.request_id}-{nxt}")
            # its error reaches whoever asks for that layer; a handle dropped without
            # asking (its client closed) must not log "exception was never retrieved"
            ahead.add_done_callback(_quiet)
            self._ahead[nxt] = ahead
        return self._c.view(ready.hit)

    async def _wait_layer(self, layer: int, timeout_s: float | None) -> LayerReady:
        """WaitLayer until the layer is loaded (each call bounded by the node's
        ``max_wait_s``), or DeadlineExceeded after ``timeout_s`` (None: the attempt's own
        deadline on the node ends it)."""
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        while True:
            left = self._c.max_wait_s if end is None else max(0.0, end - loop.time())
            wait = min(left, self._c.max_wait_s)
            try:
                return await self._send(WaitLayer, layer, wait, wait_s=wait)
            except DeadlineExceeded:
                if end is not None and loop.time() >= end:
                    raise

    def _drop_ahead(self) -> None:
        """The handle ends: read-aheads nobody will ask for are cancelled (their errors,
        retrieved by ``_quiet``, are this ending's, not news)."""
        ahead, self._ahead = self._ahead, {}
        for t in ahead.values():
            t.cancel()

    def _slots(self, layer: int) -> LayerReady:
        ready = self._ready.get(layer)
        if ready is None:
            raise InvalidArgument(f"output({layer}) before its hit KV was loaded: await "
                                  f"layer({layer}) first")
        return ready

    def output(self, layer: int) -> np.ndarray:
        return self._c.view(self._slots(layer).output)

    def prompt_layer(self, layer: int) -> np.ndarray:
        return self._c.view(self._slots(layer).prompt)

    async def put_layer(self, layer: int, wait: bool = True) -> None:
        self._raise_failed_put()
        if wait:
            await self._put(layer)
        else:
            self._puts.append(asyncio.get_running_loop().create_task(self._put(layer)))

    async def _put(self, layer: int) -> None:
        await self._send(PutLayer, layer, wait_s=self._c.max_wait_s)
        self._ready.pop(layer, None)

    def _raise_failed_put(self) -> None:
        done = [t for t in self._puts if t.done()]
        self._puts = [t for t in self._puts if not t.done()]
        for t in done:
            t.result()                    # raises the put's typed error

    async def finish(self, first_token_id: int | None = None) -> None:
        self._drop_ahead()
        puts, self._puts = self._puts, []
        for t in puts:                    # puts still on their way, in order
            await t
        self.ended = True
        await self._send(FinishPrefill, first_token_id, wait_s=self._c.max_wait_s)

    async def fail(self, error: BaseException | str | None = None) -> None:
        self._drop_ahead()
        puts, self._puts = self._puts, []
        for t in puts:
            if t.done() and not t.cancelled():
                t.exception()             # the failure is this fail's reason, not news
            t.cancel()
        await super().fail(error)


class RemoteDecodeRequest(_RemoteRequest):
    """A :class:`~.handles.DecodeHandle` across processes; views valid until ``took_kv``."""

    _deadline_loses = True

    def __init__(self, client: EngineClient, msg: DecodeAssigned) -> None:
        super().__init__(client, msg.prompt, msg.hit_tokens)
        self.first_token_id = msg.first_token_id
        self.slots = msg.layers

    @property
    def cancelled(self) -> bool:
        return self._lost

    def layer(self, layer: int) -> np.ndarray:
        if not 0 <= layer < len(self.slots):
            raise InvalidArgument(f"layer {layer} out of range [0, {len(self.slots)})")
        return self._c.view(self.slots[layer])

    @property
    def kv(self) -> np.ndarray | None:
        first, size = self.slots[0].offset, self.slots[0].nbytes
        if any(s.offset != first + i * size for i, s in enumerate(self.slots)):
            return None
        whole = self._c.view(ArenaSlot(first, size * len(self.slots)))
        return whole.reshape(len(self.slots), -1, whole.shape[1])

    async def took_kv(self) -> None:
        # The answer confirms the node held the pages while the engine copied them: a load
        # waits for it, and a missing one turns the load into a recompute. A node that is
        # only slow (its host starved: a CI run saw a 5-s pause) must not count as one that
        # dropped the attempt, so this waits as long as the node says any call may; a node
        # that is gone fails the call at once (PeerFailed on the dropped connection).
        await self._send(TookKV, wait_s=self._c.max_wait_s)

    async def second_token(self) -> None:
        # posted off the step (a notice); a deadline here would mark the attempt lost
        await self._send(SecondToken, wait_s=self._c.max_wait_s)

    async def new_block(self, token_ids: Sequence[int]) -> GeneratedBlock:
        ids = [int(t) for t in token_ids]
        opened: BlockOpened = await self._send(NewBlock, ids, wait_s=self._c.max_wait_s)
        spec = self._c.kv_spec
        view = self._c.view(opened.slot).reshape(spec.num_layers, spec.block_tokens, -1)
        return GeneratedBlock(opened.index, opened.key, tuple(ids), view)

    async def put_block(self, blk: GeneratedBlock) -> None:
        await self._send(PutBlock, blk.index)

    async def finish(self, output_token_ids: Sequence[int]) -> None:
        self.ended = True
        await self._send(FinishDecode, [int(t) for t in output_token_ids],
                         wait_s=self._c.max_wait_s)


# --------------------------------------------------------------------------- ports

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

    async def collective_begin(self) -> None:
        await self.client.call(CollectiveBegin())

    async def collective_end(self) -> None:
        await self.client.call(CollectiveEnd())

    def close(self) -> None:
        self.closed = True
        if self._poll is not None:
            self._poll.cancel()


class RemotePrefillPort(_RemotePort):
    """A :class:`~.handles.PrefillQueue` across processes."""

    async def next_request(self) -> RemotePrefillHandle:
        return await self._next()


class RemoteDecodePort(_RemotePort):
    """A :class:`~.handles.DecodeQueue` across processes."""

    async def next_ready(self) -> RemoteDecodeRequest:
        return await self._next()
