"""The node side of the cross-process engine API: engines in other processes drive the node's
in-process ports over a Unix socket (docs/engine-api.md "Cross-process").

One :class:`EngineApiServer` per node service. Each connection attaches as one engine of the
node and then acts, through this server, exactly like an in-process engine on that engine's
:class:`~services.engine_api.prefill.PrefillPort` / :class:`~services.engine_api.decode.DecodePort`
— every rule of the in-process API (layer order, finish once, what is freed when) is enforced by
the same objects. What this module adds is the mapping between handles and wire messages:
views become :class:`~common.protocol.ArenaSlot` s of the node's ``/dev/shm`` arena (the engine
maps it once), handles are held per session, and a session that ends — engine exit, kill -9,
a replacing attach — fails every request it held as retryable (``PeerFailed``), which frees
their pages and lets the scheduler re-plan them, and ends the collectives it had begun (the
node's KV cap is released). Who is attached, and how an engine leaves (including going silent
or stuck), is :class:`~.sessions.EngineSessions`'.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog

from common.config import RpcConfig
from common.errors import (AlreadyExists, Cancelled, DualpathError, InternalError,
                           InvalidArgument, KVSpecMismatch, NotFound, OutOfService, PeerFailed,
                           Unavailable, VersionMismatch)
from common.kv import KVSpec
from common.protocol import (ENGINE_API_VERSION, AbandonRequest, ArenaSlot, Assigned, AttachEngine,
                             BlockOpened, ClaimRequest, CollectiveBegin, CollectiveEnd,
                             DecodeAssigned, EngineAttached,
                             EngineAlive, EngineOk, EnginePrompt, EngineRequest, FailRequest,
                             FinishDecode,
                             FinishPrefill, LayerReady, NewBlock, NextRequest, PrefillAssigned,
                             PutBlock, PutLayer, ReportCounters, SecondToken, TookKV,
                             WaitLayer)
from common.rpc import CallContext, RpcServer
from common.unix_socket import peer_uid

from .decode import DecodeRequest
from .prefill import PrefillRequest
from .prompt import PromptInfo
from .request_queue import release_soon
from .sessions import EngineSession, EngineSessions

log = structlog.get_logger(__name__)

MAX_WAIT_S = 60.0          # longest one NextRequest / ClaimRequest / WaitLayer blocks
MAX_ITEMS = 64             # most requests one NextRequest hands out
CLAIM_RECHECK_S = 0.25     # a waiting claim re-checks whether another engine got the id
# a claim of an id this node has no attempt of, nor a recent failure, after this long is an
# unknown id (a plan reaches the node at placement: the scheduler's binding, the PE's
# PrepareDecode): refused, so a bogus id in an engine's request costs it this, not its timeout
UNKNOWN_GRACE_S = 30.0


class EngineApiServer:
    """Serves ``ports`` (engine id → port) of node ``node_id`` on a Unix socket."""

    def __init__(self, rpc_cfg: RpcConfig, *, node_id: str, role: str, spec: KVSpec,
                 ports: dict[str, Any], arena: Any, arena_name: str | None,
                 owner_of: Callable[[str], str | None],
                 failure_of: Callable[[str], str | None] = lambda rid: None,
                 abandon: Callable[[str, str, DualpathError, int | None], bool] = (
                     lambda rid, e, err, attempt: False),
                 allowed_uids: Sequence[int] = (), silence_s: float = 0.0,
                 stuck_s: float = 0.0) -> None:
        self.node_id, self.role, self.spec = node_id, role, spec
        self.ports = ports
        self.arena = arena
        self.arena_name = arena_name
        self._arena_base = arena.ctypes.data if isinstance(arena, np.ndarray) else 0
        self.owner_of = owner_of
        self.failure_of = failure_of      # why a request with no live attempt here failed
        # (request id, engine id, error, attempt or None) -> the node failed that engine's live
        # attempt of it
        self.abandon = abandon
        self.counters: collections.Counter[str] = collections.Counter()
        # who is attached, under which attachment number; silent and stuck engines leave
        self.engines = EngineSessions(node_id, ports, self.counters, silence_s=silence_s,
                                      stuck_s=stuck_s)
        self.sessions = self.engines.sessions              # engine id → attached session
        self.attach_counts = self.engines.attach_counts    # engine id → attachments so far
        self.reported: dict[str, dict[str, float]] = {}    # engine id → its latest counters
        self.claims_waiting: collections.Counter[str] = collections.Counter()  # id → claims
        self.rpc = RpcServer(rpc_cfg, service=f"engine_api:{node_id}", node_id=node_id,
                             handlers=self.handlers(), request_type=EngineRequest,
                             on_disconnect=self.engines.on_disconnect,
                             # an engine's give-ups are notices: its own timeout (a stalled
                             # host) must not cancel them, or the attempt waits for nobody
                             # until the request's deadline (docs/engine-api.md)
                             notices=frozenset({FailRequest, AbandonRequest}))
        self.path: str | None = None
        # who may attach: uids the kernel reports for the peer (SO_PEERCRED); default: us
        self.allowed_uids = frozenset(allowed_uids or (os.getuid(),))

    def handlers(self) -> dict[type, Any]:
        return {AttachEngine: self._attach, NextRequest: self._next, ClaimRequest: self._claim,
                WaitLayer: self._wait_layer, PutLayer: self._put_layer,
                FinishPrefill: self._finish_prefill, TookKV: self._took_kv,
                SecondToken: self._second_token, NewBlock: self._new_block,
                PutBlock: self._put_block, FinishDecode: self._finish_decode,
                FailRequest: self._fail, AbandonRequest: self._abandon,
                ReportCounters: self._report_counters, EngineAlive: self._alive,
                CollectiveBegin: self._collective_begin, CollectiveEnd: self._collective_end}

    async def start(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # created 0600 and each peer's uid checked: the trust boundary is the uid, as for the
        # arena (common.shm); any process of an allowed uid may attach (docs/security.md)
        await self.rpc.start_unix(path, admit=self._admit)
        self.engines.watch.start()
        self.path = path
        log.info("engine_api_listening", node=self.node_id, path=path, engines=len(self.ports))

    async def stop(self) -> None:
        await self.engines.watch.stop()
        await self.rpc.stop(grace_s=0.5)
        for sess in list(self.sessions.values()):
            await self.engines.detach(sess, "node service stopping")

    def _admit(self, sock: Any) -> bool:
        uid = peer_uid(sock)
        if uid in self.allowed_uids:
            return True
        self.counters["peers_refused"] += 1
        log.warning("engine_peer_refused", node=self.node_id, peer_uid=uid,
                    allowed=sorted(self.allowed_uids))
        return False

    def attached(self) -> list[str]:
        return sorted(self.sessions)

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out.update({k: float(v) for k, v in self.engines.watch.counters.items()})
        out["engine_steps"] = float(sum(self.engines.steps.values()))    # as beats report
        out["engines_attached"] = float(len(self.sessions))
        out["requests_held"] = float(sum(s.held for s in self.sessions.values()))
        return out

    def engine_counters(self) -> dict[str, float]:
        """The counters the engines reported, summed over engines (kept after a detach)."""
        total: collections.Counter[str] = collections.Counter()
        for counters in self.reported.values():
            total.update(counters)
        return dict(total)

    async def _report_counters(self, msg: ReportCounters, ctx: CallContext) -> EngineOk:
        sess = self.engines.of(ctx)
        if len(msg.counters) > 256:
            raise InvalidArgument(f"{len(msg.counters)} counters reported, at most 256")
        self.reported[sess.engine_id] = {k[:64]: float(v) for k, v in msg.counters.items()}
        return EngineOk()

    async def _collective_begin(self, msg: CollectiveBegin, ctx: CallContext) -> EngineOk:
        await self._open_port(self.engines.of(ctx)).collective_begin()
        return EngineOk()

    async def _collective_end(self, msg: CollectiveEnd, ctx: CallContext) -> EngineOk:
        await self.ports[self.engines.of(ctx).engine_id].collective_end()
        return EngineOk()

    # ------------------------------------------------------------------ attach / detach
    async def _attach(self, msg: AttachEngine, ctx: CallContext) -> EngineAttached:
        try:
            self._check_attach(msg, ctx)
        except DualpathError as e:
            self.counters["attach_refused"] += 1
            log.warning("engine_attach_refused", node=self.node_id, engine=msg.engine_id,
                        code=e.code.value, error=e.message)
            raise
        old = self.sessions.get(msg.engine_id)
        if old is not None:
            await self.engines.detach(old, f"replaced by a new attach of {msg.engine_id}",
                                      alive=True)     # the old process may still run
            old.conn.sender.abort(f"engine {msg.engine_id} was attached again (replace)")
            if msg.engine_id in self.sessions or ctx.conn.closed:    # raced while detaching
                raise AlreadyExists(f"engine {msg.engine_id} was attached meanwhile")
        self.engines.add(ctx.conn, msg.engine_id, msg.role)
        self.counters["attaches"] += 1
        log.info("engine_attached", node=self.node_id, engine=msg.engine_id,
                 replaced=old is not None)
        return EngineAttached(self.node_id, msg.engine_id, self.spec, self.arena_name or "",
                              int(self.arena.nbytes), MAX_WAIT_S,
                              self.engines.heartbeat_s, self.engines.watch.silence_s)

    def _check_attach(self, msg: AttachEngine, ctx: CallContext) -> None:
        if (bound := self.engines.bound(ctx.conn_id)) is not None:
            raise InvalidArgument(f"this connection is already attached as "
                                  f"{bound.engine_id}")
        if msg.api_version != ENGINE_API_VERSION:
            raise VersionMismatch(f"engine speaks engine API v{msg.api_version}, node "
                                  f"{self.node_id} speaks v{ENGINE_API_VERSION}; deploy "
                                  f"matching dualpath versions")
        if msg.engine_id not in self.ports:
            raise NotFound(f"node {self.node_id} has no engine {msg.engine_id!r}; its engines "
                           f"are {sorted(self.ports)}")
        if msg.role != self.role:
            raise InvalidArgument(f"engine {msg.engine_id} attaches as {msg.role}, node "
                                  f"{self.node_id} serves {self.role} engines")
        if msg.kv_spec.fingerprint() != self.spec.fingerprint():
            raise KVSpecMismatch(f"KV spec mismatch: engine {msg.engine_id} has "
                                 f"{_describe(msg.kv_spec)}, node {self.node_id} has "
                                 f"{_describe(self.spec)} — check the model / [kv] config")
        if not self.arena_name:
            raise Unavailable(f"node {self.node_id}'s buffer is not in shared memory (/dev/shm "
                              f"full or a device buffer): engines cannot attach from another "
                              f"process")
        if msg.engine_id in self.sessions and not msg.replace:
            raise AlreadyExists(f"engine {msg.engine_id} is already attached on "
                                f"{self.node_id}; attach with replace=True to take it over")

    async def _alive(self, msg: EngineAlive, ctx: CallContext) -> EngineOk:
        await self.engines.beat(self.engines.of(ctx), msg.busy_s, msg.steps)
        return EngineOk()

    def _open_port(self, sess: EngineSession) -> Any:
        if sess.stuck:
            raise OutOfService(f"engine {sess.engine_id} is out of service on {self.node_id}: "
                               f"its step has not ended (engine_stuck_s)", retry_after_s=1.0)
        port = self.ports[sess.engine_id]
        if port.closed:
            raise Unavailable(f"node {self.node_id} is stopping; attach again once it is back",
                              retry_after_s=0.5)
        return port

    # ------------------------------------------------------------------ getting requests
    async def _next(self, msg: NextRequest, ctx: CallContext) -> Assigned:
        sess = self.engines.of(ctx)
        timeout = _timeout(msg.timeout_s)
        if not 1 <= msg.max_items <= MAX_ITEMS:
            raise InvalidArgument(f"max_items must be in [1, {MAX_ITEMS}], got {msg.max_items}")
        port = self._open_port(sess)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        got: list[Any] = []
        while not got and not sess.closed:
            if (item := port.try_next()) is not None:
                got.append(item)
                break
            left = end - loop.time()
            if left <= 0:
                break
            await port.wait_arrival(left)
            self._open_port(sess)
        while got and len(got) < msg.max_items and (item := port.try_next()) is not None:
            got.append(item)
        return self._assign(sess, got)

    async def _claim(self, msg: ClaimRequest, ctx: CallContext) -> Assigned:
        sess = self.engines.of(ctx)
        timeout = _timeout(msg.timeout_s)
        rid = msg.request_id
        held = sess.claimed(rid)
        if held is not None and _gone(held):
            # the node ended that attempt (a re-plan, the drop after a scheduler restart): its
            # engine request learns it on its next call; a claim of the new one goes on
            sess.forget(rid)
        elif held is not None and (msg.attempt is None or held.info.attempt == msg.attempt):
            raise InvalidArgument(f"request {rid!r} is already claimed by {sess.engine_id}")
        port = self._open_port(sess)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        unknown_at = loop.time() + UNKNOWN_GRACE_S
        self.claims_waiting[rid] += 1
        try:
            return await self._claim_loop(sess, port, rid, timeout, end, unknown_at,
                                          msg.attempt)
        finally:
            self.claims_waiting[rid] -= 1
            if not self.claims_waiting[rid]:
                del self.claims_waiting[rid]

    async def _claim_loop(self, sess: EngineSession, port: Any, rid: str, timeout: float,
                          end: float, unknown_at: float, attempt: int | None) -> Assigned:
        """Wait for ``rid`` (its attempt ``attempt``, when given) on ``sess``'s port: handed,
        refused, or not found by ``end``."""
        loop = asyncio.get_running_loop()
        while not sess.closed:
            if (item := port.take(rid, attempt)) is not None:
                return self._assign(sess, [item])
            if attempt is not None and any(a > attempt for a in port.attempts_of(rid)):
                self.counters["claims_superseded"] += 1
                raise Cancelled(f"attempt {attempt} of request {rid!r} was superseded by a "
                                f"re-plan on {self.node_id}; its own request claims the new one")
            owner = self.owner_of(rid)
            if owner is not None and owner != sess.engine_id:
                raise InvalidArgument(f"request {rid!r} is assigned to engine {owner}, not "
                                      f"{sess.engine_id}")
            if owner is None and (why := self.failure_of(rid)) is not None:
                self.counters["claims_failed"] += 1
                raise Cancelled(f"request {rid!r} failed on {self.node_id} before "
                                f"{sess.engine_id} claimed it ({why}); a re-plan brings a new "
                                "attempt, or the engine computes without dualpath")
            if owner is None and loop.time() >= unknown_at:
                self.counters["claims_unknown"] += 1
                raise InvalidArgument(f"request {rid!r} is unknown to {self.node_id}: no plan "
                                      f"for it arrived within {UNKNOWN_GRACE_S:.3g}s of the claim")
            left = end - loop.time()
            if left <= 0:
                break
            await port.wait_arrival(min(left, CLAIM_RECHECK_S))
            self._open_port(sess)
        self.counters["claims_not_found"] += 1
        raise NotFound(f"request {rid!r} was not assigned to {sess.engine_id} on "
                       f"{self.node_id} within {timeout:.3g}s")

    def _assign(self, sess: EngineSession, items: list[Any]) -> Assigned:
        """Register ``items`` with the session (before any await: a disconnect fails them).
        An earlier attempt of the same id still held (its engine request still ending) is
        superseded: failed, so its pages are freed and its engine calls are refused."""
        out = Assigned()
        for item in items:
            self.counters["requests_handed"] += 1
            old = sess.claimed(item.request_id)
            if old is not None:
                sess.forget(item.request_id)
                if not _gone(old):
                    self.counters["claims_superseding"] += 1
                    release_soon(old.fail(PeerFailed(
                        f"attempt {old.info.attempt} of {item.request_id!r} superseded by "
                        f"attempt {item.info.attempt}, claimed by {sess.engine_id}")))
            if isinstance(item, PrefillRequest):
                sess.prefill[item.request_id] = item
                out.prefill.append(PrefillAssigned(_prompt(item.info), item.hit_tokens))
            else:
                sess.decode[item.request_id] = item
                layers = [self._slot(item.layer(layer)) for layer in range(self.spec.num_layers)]
                out.decode.append(DecodeAssigned(_prompt(item.info), item.hit_tokens,
                                                 item.first_token_id, layers))
        return out

    # ------------------------------------------------------------------ prefill calls
    async def _wait_layer(self, msg: WaitLayer, ctx: CallContext) -> LayerReady:
        h = self._held_prefill(ctx, msg.request_id, msg.attempt)
        hit = await h.layer(msg.layer, _timeout(msg.timeout_s))
        return LayerReady(msg.request_id, msg.layer, self._slot(hit),
                          self._slot(h.output(msg.layer)), self._slot(h.prompt_layer(msg.layer)))

    async def _put_layer(self, msg: PutLayer, ctx: CallContext) -> EngineOk:
        h = self._held_prefill(ctx, msg.request_id, msg.attempt)
        if not 0 <= msg.layer < self.spec.num_layers:
            raise InvalidArgument(f"layer {msg.layer} out of range [0, {self.spec.num_layers})")
        await h.put_layer(msg.layer)
        return EngineOk(msg.request_id)

    async def _finish_prefill(self, msg: FinishPrefill, ctx: CallContext) -> EngineOk:
        h = self._held_prefill(ctx, msg.request_id, msg.attempt)
        self.engines.of(ctx).prefill.pop(msg.request_id, None)
        await h.finish(msg.first_token_id)
        self.counters["prefills_finished"] += 1
        return EngineOk(msg.request_id)

    def _held_prefill(self, ctx: CallContext, rid: str, attempt: int) -> PrefillRequest:
        h: PrefillRequest = self._held(ctx, rid, attempt, "prefill")
        return h

    def _held(self, ctx: CallContext, rid: str, attempt: int, role: str) -> Any:
        """The request ``rid`` (attempt ``attempt``) this connection's engine holds."""
        sess = self.engines.of(ctx)
        if sess.role != role:
            raise InvalidArgument(f"{sess.engine_id} is a {sess.role} engine: {role} calls "
                                  f"refused")
        item = (sess.prefill if role == "prefill" else sess.decode).get(rid)
        if item is None or item.info.attempt != attempt:
            raise NotFound(f"engine {sess.engine_id} holds no attempt {attempt} of {rid!r} "
                           f"(not handed to it, another engine's, already finished or failed)")
        return item

    # ------------------------------------------------------------------ decode calls
    async def _took_kv(self, msg: TookKV, ctx: CallContext) -> EngineOk:
        await self._held_decode(ctx, msg.request_id, msg.attempt).took_kv()
        return EngineOk(msg.request_id)

    async def _second_token(self, msg: SecondToken, ctx: CallContext) -> EngineOk:
        await self._held_decode(ctx, msg.request_id, msg.attempt).second_token()
        return EngineOk(msg.request_id)

    async def _new_block(self, msg: NewBlock, ctx: CallContext) -> BlockOpened:
        req = self._held_decode(ctx, msg.request_id, msg.attempt)
        blk = await req.new_block(msg.token_ids)
        self.engines.of(ctx).blocks[(msg.request_id, blk.index)] = blk
        return BlockOpened(msg.request_id, blk.index, blk.key, self._slot(blk.view))

    async def _put_block(self, msg: PutBlock, ctx: CallContext) -> EngineOk:
        req = self._held_decode(ctx, msg.request_id, msg.attempt)
        blk = self.engines.of(ctx).blocks.pop((msg.request_id, msg.index), None)
        if blk is None:
            raise NotFound(f"{msg.request_id!r} has no open generated block {msg.index} "
                           f"(never opened by NewBlock, or already put)")
        await req.put_block(blk)
        return EngineOk(msg.request_id)

    async def _finish_decode(self, msg: FinishDecode, ctx: CallContext) -> EngineOk:
        req = self._held_decode(ctx, msg.request_id, msg.attempt)
        self.engines.of(ctx).forget_decode(msg.request_id)
        await req.finish(msg.output_token_ids)
        self.counters["decodes_finished"] += 1
        return EngineOk(msg.request_id)

    def _held_decode(self, ctx: CallContext, rid: str, attempt: int) -> DecodeRequest:
        req: DecodeRequest = self._held(ctx, rid, attempt, "decode")
        return req

    # ------------------------------------------------------------------ both
    async def _fail(self, msg: FailRequest, ctx: CallContext) -> EngineOk:
        sess = self.engines.of(ctx)
        err = PeerFailed(f"engine {sess.engine_id} gave {msg.request_id!r} up: "
                         f"{msg.reason[:300] or 'no reason given'}")
        if sess.role == "prefill":
            h = self._held_prefill(ctx, msg.request_id, msg.attempt)
            sess.prefill.pop(msg.request_id, None)
            await h.fail(err)
        else:
            req = self._held_decode(ctx, msg.request_id, msg.attempt)
            sess.forget_decode(msg.request_id)
            await req.fail(err)
        self.counters["requests_failed_by_engine"] += 1
        return EngineOk(msg.request_id)

    async def _abandon(self, msg: AbandonRequest, ctx: CallContext) -> EngineOk:
        """The engine will not claim ``msg.request_id``: fail the attempt assigned to it now
        (queued in its port, still being prepared by the node, or handed to a claim whose
        answer the engine never got), so the scheduler re-plans it at once instead of at its
        deadline. A plan not here yet is waited for, rechecked like a claim, up to the
        unknown-id grace."""
        sess = self.engines.of(ctx)
        rid = msg.request_id
        err = PeerFailed(f"engine {sess.engine_id} gave {rid!r} up before claiming it: "
                         f"{msg.reason[:300] or 'no reason given'}")
        held = sess.claimed(rid)
        if held is not None and (msg.attempt is None or held.info.attempt == msg.attempt):
            # claimed, but the engine never saw the answer (its claim's deadline passed on
            # the way back): it computes alone, so nothing may wait for it
            sess.forget(rid)
            await held.fail(err)
            return self._abandoned(sess, rid, "claimed")
        port = self._open_port(sess)
        loop = asyncio.get_running_loop()
        end = loop.time() + min(_timeout(msg.timeout_s), UNKNOWN_GRACE_S)
        while not sess.closed:
            if (item := port.take(rid, msg.attempt)) is not None:
                await item.fail(err)
                return self._abandoned(sess, rid, "queued")
            if msg.attempt is not None and any(a > msg.attempt for a in port.attempts_of(rid)):
                return EngineOk(rid)       # an earlier attempt's give-up: the new one stands
            owner = self.owner_of(rid)
            if owner is not None and owner != sess.engine_id:
                raise InvalidArgument(f"request {rid!r} is assigned to engine {owner}, not "
                                      f"{sess.engine_id}")
            if owner is not None and self.abandon(rid, sess.engine_id, err, msg.attempt):
                return self._abandoned(sess, rid, "preparing")
            if owner is None and self.failure_of(rid) is not None:
                return EngineOk(rid)                    # failed already: nothing to do
            left = end - loop.time()
            if left <= 0:
                break
            await port.wait_arrival(min(left, CLAIM_RECHECK_S))
        self.counters["abandons_unknown"] += 1
        raise NotFound(f"request {rid!r} has no attempt for {sess.engine_id} on "
                       f"{self.node_id} to abandon")

    def _abandoned(self, sess: EngineSession, rid: str, where: str) -> EngineOk:
        self.counters["requests_abandoned"] += 1
        log.info("engine_abandoned_request", node=self.node_id, engine=sess.engine_id,
                 request_id=rid, where=where)
        return EngineOk(rid)

    def _slot(self, view: Any) -> ArenaSlot:
        """The arena slot of a view into the arena (a layer, a block page)."""
        if not isinstance(view, np.ndarray) or not view.flags.c_contiguous:
            raise InternalError("engine API: a view that is not a contiguous host array")
        off = view.__array_interface__["data"][0] - self._arena_base
        if not 0 <= off <= off + view.nbytes <= self.arena.nbytes:
            raise InternalError(f"engine API: view at {off} is outside the arena")
        return ArenaSlot(int(off), int(view.nbytes))


def _gone(item: PrefillRequest | DecodeRequest) -> bool:
    """The node no longer holds this attempt (it ended, or the node dropped it)."""
    if isinstance(item, PrefillRequest):
        return item.ended or item.dropped
    return item.cancelled


def _timeout(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgument(f"timeout_s must be finite and >= 0, got {value}")
    return min(value, MAX_WAIT_S)


def _describe(spec: KVSpec) -> str:
    return f"{spec.describe()}, dtype {spec.dtype} (fingerprint {spec.fingerprint()})"


def _prompt(info: PromptInfo) -> EnginePrompt:
    return EnginePrompt(info.request_id, info.attempt, info.session_id, info.prompt_tokens,
                        info.hit_tokens, info.gen_tokens, list(info.keys),
                        None if info.tail_token_ids is None else list(info.tail_token_ids),
                        info.block_tokens, info.read_side, list(info.block_keys), info.tail_key)

