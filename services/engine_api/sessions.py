"""The engines attached to one node process (the node side of docs/engine-api.md
"Cross-process"): which connection speaks for which engine, under which attachment number,
and how an engine leaves — its connection ended, another attach replaced it, it went silent
(its process stopped: :class:`~.liveness.SilenceWatch`) or stuck (a step that never ends,
from its beats) — failing every request it held as retryable so the scheduler re-plans them.

The attachment number is what the scheduler tells an attachment's end from older telemetry
by (protocol v6): every attach, and every return from being stuck, is a new one.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

import structlog

from common.errors import EngineDetached, InvalidArgument
from common.rpc import CallContext, ServerConnection

from .decode import DecodeRequest
from .handles import GeneratedBlock
from .liveness import SilenceWatch, heartbeat_interval
from .prefill import PrefillRequest

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class EngineSession:
    """One attached engine: the requests and generated-block pages it holds."""

    conn: ServerConnection
    engine_id: str
    role: str
    attach_no: int                  # the engine's how-manieth attach to this node process
    prefill: dict[str, PrefillRequest] = field(default_factory=dict)
    decode: dict[str, DecodeRequest] = field(default_factory=dict)
    blocks: dict[tuple[str, int], GeneratedBlock] = field(default_factory=dict)
    closed: bool = False
    stuck: bool = False             # out of service: its step ran past engine_stuck_s

    @property
    def held(self) -> int:
        return len(self.prefill) + len(self.decode)

    def claimed(self, rid: str) -> PrefillRequest | DecodeRequest | None:
        return self.prefill.get(rid) or self.decode.get(rid)

    def forget(self, rid: str) -> None:
        """``rid`` is no longer this engine's (either role), nor its generated-block pages."""
        self.prefill.pop(rid, None)
        self.forget_decode(rid)

    def forget_decode(self, rid: str) -> None:
        self.decode.pop(rid, None)
        for key in [k for k in self.blocks if k[0] == rid]:
            del self.blocks[key]


class EngineSessions:
    """The attached engines of node ``node_id`` (module docstring). ``ports``: engine id →
    its port (whose collectives a leaving engine ends); ``counters``: the server's."""

    def __init__(self, node_id: str, ports: dict[str, Any],
                 counters: collections.Counter[str], *, silence_s: float = 0.0,
                 stuck_s: float = 0.0) -> None:
        self.node_id = node_id
        self.ports = ports
        self.counters = counters
        self.sessions: dict[str, EngineSession] = {}        # engine id → attached session
        # engine id → how many times it attached to this node process (the scheduler tells a
        # report of an attachment's end from telemetry older than it by this number)
        self.attach_counts: collections.Counter[str] = collections.Counter()
        self._by_conn: dict[int, EngineSession] = {}
        # engines not heard from for silence_s are detached (docs/engine-api.md, "A silent
        # engine"); 0: never
        self.watch: SilenceWatch[EngineSession] = SilenceWatch(silence_s, self._silent,
                                                               name=node_id)
        self.stuck_s = stuck_s            # an engine step running longer is stuck; 0: never
        self.steps: dict[str, int] = {}   # engine id → steps its latest beat counted

    @property
    def heartbeat_s(self) -> float:
        """How often engines must beat: for the silence watch, else for the stuck check
        (0: neither is on)."""
        return self.watch.heartbeat_s or heartbeat_interval(self.stuck_s)

    def bound(self, conn_id: int) -> EngineSession | None:
        """The session this connection attached as, if any (stuck ones included)."""
        return self._by_conn.get(conn_id)

    def add(self, conn: ServerConnection, engine_id: str, role: str) -> EngineSession:
        """``conn`` attaches as ``engine_id`` (checked by the server, the old one gone)."""
        sess = EngineSession(conn, engine_id, role, 0)
        self._number(sess)
        self._by_conn[conn.conn_id] = sess
        self.watch.heard(sess)
        return sess

    def _number(self, sess: EngineSession) -> None:
        """A new attachment of ``sess``'s engine: numbered, and attached."""
        self.attach_counts[sess.engine_id] += 1
        sess.attach_no = self.attach_counts[sess.engine_id]
        self.sessions[sess.engine_id] = sess

    async def on_disconnect(self, conn: ServerConnection) -> None:
        sess = self._by_conn.get(conn.conn_id)
        if sess is not None:
            await self.detach(sess, "engine disconnected")

    @staticmethod
    def _detached(sess: EngineSession, message: str, alive: bool) -> EngineDetached:
        """What each request ``sess`` held fails with: a PEER_FAILED that names the ended
        attachment, so the node's report takes the engine out of placement first."""
        return EngineDetached(message, engine_id=sess.engine_id, attach_no=sess.attach_no,
                              alive=alive)

    async def detach(self, sess: EngineSession, reason: str, *, stuck: bool = False,
                     alive: bool = False) -> None:
        """Fail every request ``sess`` holds (retryable: the scheduler re-plans them) and
        report it not attached. ``stuck``: its connection stays open and its beats go on;
        one that shows the step ended attaches it again (:meth:`beat`). ``alive`` (so is
        ``stuck``): its process may still write into what it was handed, so those pages stay
        out of use until ``engine_release_timeout_s`` (``EngineDetached.alive``)."""
        alive = alive or stuck
        if sess.closed or (stuck and sess.stuck):
            return
        if stuck:
            sess.stuck = True
        else:
            sess.closed = True
            self.watch.forget(sess)
            self._by_conn.pop(sess.conn.conn_id, None)
        if self.sessions.get(sess.engine_id) is sess:
            del self.sessions[sess.engine_id]
        err = f"engine {sess.engine_id} on {self.node_id}: {reason}"
        held = sess.held
        for h in list(sess.prefill.values()):
            await h.fail(self._detached(sess, err, alive))
        for req in list(sess.decode.values()):
            await req.fail(self._detached(sess, err, alive))
        sess.prefill.clear()
        sess.decode.clear()
        sess.blocks.clear()
        self.ports[sess.engine_id].collectives.end_all(sess.engine_id, reason)
        self.counters["detaches"] += 1
        self.counters["requests_failed_on_detach"] += held
        log.info("engine_detached", node=self.node_id, engine=sess.engine_id, reason=reason,
                 requests_failed=held)

    def of(self, ctx: CallContext) -> EngineSession:
        """The engine this call's connection attached as (heard from now)."""
        sess = self._by_conn.get(ctx.conn_id)
        if sess is None or sess.closed:
            raise InvalidArgument("attach first (AttachEngine) — this connection is no engine")
        self.watch.heard(sess)
        return sess

    async def beat(self, sess: EngineSession, busy_s: float, steps: int) -> None:
        """A beat of ``sess``; its ``busy_s`` past ``stuck_s`` takes the engine out of
        service (its requests fail and re-plan, it is reported not attached) until a beat
        shows that step ended: then it is attached again, under a new attachment number."""
        if not (math.isfinite(busy_s) and busy_s >= 0):
            raise InvalidArgument(f"busy_s={busy_s} must be finite and >= 0")
        if steps < 0:
            raise InvalidArgument(f"steps={steps} must be >= 0")
        self.steps[sess.engine_id] = steps
        if not self.stuck_s or (busy_s > self.stuck_s) == sess.stuck:
            return
        if not sess.stuck:
            self.counters["engines_stuck"] += 1
            log.warning("engine_stuck", node=self.node_id, engine=sess.engine_id,
                        busy_s=round(busy_s, 3), stuck_s=self.stuck_s, requests_held=sess.held)
            await self.detach(sess, f"stuck: its step has run {busy_s:.1f} s "
                                    f"(engine_stuck_s={self.stuck_s:g})", stuck=True)
        elif self.sessions.get(sess.engine_id) is None:
            sess.stuck = False
            self._number(sess)
            self.counters["engines_unstuck"] += 1
            log.info("engine_unstuck", node=self.node_id, engine=sess.engine_id,
                     attach_no=sess.attach_no)
        else:                               # another process attached as it meanwhile
            await self.detach(sess, "replaced while it was stuck", alive=True)
            sess.conn.sender.abort(f"engine {sess.engine_id} was replaced while stuck")

    async def _silent(self, sess: EngineSession, silent_s: float) -> None:
        """Nothing from ``sess`` for ``silence_s``: its process stopped without dying. Detach
        it (its requests re-plan) and close its connection: if it runs again, its calls fail
        and it attaches anew, like an engine whose node restarted."""
        log.warning("engine_silent", node=self.node_id, engine=sess.engine_id,
                    silent_s=round(silent_s, 3), silence_s=self.watch.silence_s,
                    requests_held=sess.held)
        await self.detach(sess, f"silent for {silent_s:.1f} s (its process stopped or froze; "
                                 f"silence_s={self.watch.silence_s:g})", alive=True)
        sess.conn.sender.abort(f"engine {sess.engine_id} was silent for {silent_s:.1f} s")

