"""The node side of the scheduler's node channel, for PE receivers, DE loaders and gateways.

:class:`NodeSession` keeps one registration alive and speaks the protocol's rules so a node
service does not have to: a fresh epoch per process, heartbeats at the interval the scheduler
asks for, ``FetchWork`` with ``ack_seq`` (at-least-once delivery, duplicates dropped), and
re-registration with a higher epoch when the scheduler says the lease is gone (the owner's
``on_lease_lost`` callback must then drop all in-flight work: the scheduler has re-planned it).
When the new registration shows another scheduler incarnation (``scheduler_epoch``: the
scheduler restarted), ``on_scheduler_changed(old_epoch)`` runs next, so the owner can
redeliver the results of attempts that finished while no scheduler listened.

Fencing (etcd mode, docs/cluster.md "etcd"): replies carry the scheduler's epoch; a register
or fetch reply from an epoch below the highest this session has seen comes from a deposed
leader — it is refused (``stale_replies``), the connection dropped, and the leader resolved
again (``resolve``: the address is asked for before each connection attempt).

A group leader's loop, in short::

    session = NodeSession(rpc_cfg, sched_host, sched_port, node_id="p0", service="pe_receiver",
                          role="prefill", control=(host, port), ucx=(ucx_host, ucx_port),
                          engines=[EngineInfo("p0.e0", "prefill")], on_lease_lost=drop_all)
    await session.start()                      # register + heartbeat task
    while running:
        reply = await session.fetch(engine_loads(), read_q_tokens=None)
        for r in reply.revoked: abort(r.request_id, r.attempt)
        for b in reply.bindings: reserve(b)    # DE loaders
        for p in reply.plans: start(p)         # PE receivers: report stages with session.report
        if not reply.more:
            await asyncio.sleep(session.fetch_interval_s)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog

from common.config import RpcConfig
from common.errors import DualpathError, NotFound, Unavailable
from common.faults import failpoint
from common.protocol import (Stage, EngineInfo, EngineLoad, FetchWork, FetchWorkReply, Heartbeat,
                             NodeReply, RegisterNode, RegisterNodeReply, ReportProgress,
                             ReportProgressReply)
from common.rpc import RpcClient

log = structlog.get_logger(__name__)


class NodeSession:
    """One node service's registration, lease and calls on the scheduler."""

    def __init__(self, rpc: RpcConfig, host: str, port: int, *, node_id: str, service: str,
                 role: str = "", control: tuple[str, int] = ("", 0),
                 ucx: tuple[str, int] = ("", 0), engines: Sequence[EngineInfo] = (),
                 epoch: int | None = None, kv_fingerprint: str = "",
                 auth_secret: bytes | None = None,
                 on_lease_lost: Callable[[], Any] | None = None,
                 on_scheduler_changed: Callable[[int], Any] | None = None,
                 resolve: Callable[[], Awaitable[tuple[str, int]]] | None = None,
                 kv_tls: str = "") -> None:
        self.node_id, self.service, self.role = node_id, service, role
        self.kv_tls = kv_tls
        self.engines = list(engines)
        self.epoch = time.time_ns() if epoch is None else epoch
        self._control, self._ucx = control, ucx
        self._on_lease_lost = on_lease_lost
        self._on_scheduler_changed = on_scheduler_changed
        self.scheduler_epoch = 0                # RegisterNodeReply.scheduler_epoch, last seen
        self._relogin = asyncio.Lock()          # heartbeat and fetch may both see NotFound
        self._rpc = RpcClient(rpc, host, port, role=service, node_id=node_id,
                              reply_type=NodeReply, kv_fingerprint=kv_fingerprint,
                              auth_secret=auth_secret, resolve=resolve)
        self._resolve = resolve
        self.highest_epoch = 0                  # fencing: the highest scheduler epoch seen
        self.stale_replies = 0
        self.lease_s = self.heartbeat_s = self.fetch_interval_s = self.fetch_wait_s = 0.0
        self.block_tokens = 0
        self._acked: int | None = None
        self._registered_epoch: int | None = None
        self._heartbeats: asyncio.Task | None = None
        self.read_q_tokens: int | None = None   # reported with each heartbeat when set
        self.heartbeat_gaps = {"loop": 0, "reply": 0}   # heartbeats delayed (_note_gap)
        self.heartbeat_gap_max_s = 0.0
        self.heartbeats_sent = 0

    async def start(self) -> RegisterNodeReply:
        """Register and keep the lease with a heartbeat task."""
        reply = await self.register()
        self._heartbeats = asyncio.create_task(self._heartbeat_loop(),
                                               name=f"heartbeat-{self.node_id}-{self.service}")
        return reply

    async def register(self) -> RegisterNodeReply:
        msg = RegisterNode(self.node_id, self.service, self.role, *self._control, *self._ucx,
                           self.engines, self.epoch, kv_tls=self.kv_tls)
        reply: RegisterNodeReply = await self._call(msg)
        await self._fence(reply.scheduler_epoch)
        self.lease_s, self.heartbeat_s = reply.lease_s, reply.heartbeat_s
        self.fetch_interval_s, self.block_tokens = reply.fetch_interval_s, reply.block_tokens
        self.fetch_wait_s = reply.fetch_wait_s      # long-poll bound (0: plain periodic pull)
        self.scheduler_epoch = reply.scheduler_epoch
        if self._registered_epoch != self.epoch:    # a new incarnation starts a new outbox
            self._registered_epoch, self._acked = self.epoch, 0
        return reply

    async def close(self) -> None:
        """Stop heartbeating and close (the scheduler notices when the lease runs out)."""
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeats
            self._heartbeats = None
        await self._rpc.close()
        await _close_resolver(self._resolve)

    async def __aenter__(self) -> NodeSession:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def heartbeat(self) -> None:
        epoch = self.epoch
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            await self._call(Heartbeat(self.node_id, self.service, epoch,
                                           self.read_q_tokens), timeout=self.lease_s)
        except NotFound:
            self._note_gap("reply", loop.time() - sent)
            await self._lease_lost(epoch)   # registering again is not the reply's delay
        else:
            self._note_gap("reply", loop.time() - sent)

    async def _heartbeat_loop(self) -> None:
        """A heartbeat every ``heartbeat_s``, each awaited before the next sleep.

        Two things can keep the next one from being sent, and the scheduler then drops the
        node once it has heard nothing for ``lease_s``: this process not running (its loop
        blocked, or the host starving it: the sleep ends late) or a reply that is slow to
        come. Either, past a quarter of the lease, is logged (``heartbeat_loop_stalled`` /
        ``heartbeat_reply_slow``) and counted (:meth:`stats`), so a lost lease names its cause
        instead of only its effect (bench engine_agents, 2026-12-07: a DE loader silent for
        5 s, nothing in its log to say why). A reply that is slow because a scheduler is
        (re)starting shows too, once per restart."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.heartbeat_s
            await asyncio.sleep(self.heartbeat_s)
            self._note_gap("loop", loop.time() - due)
            self.heartbeats_sent += 1
            try:
                await self.heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception as e:      # scheduler unreachable: keep trying, lease may survive
                # unreachable / timed out is expected; anything else is a bug: keep its traceback
                expected = isinstance(e, TimeoutError | OSError | DualpathError)
                log.warning("heartbeat_failed", node=self.node_id, node_service=self.service,
                            error=repr(e), exc_info=not expected)

    _GAP_EVENTS = {"loop": "heartbeat_loop_stalled", "reply": "heartbeat_reply_slow"}

    def _note_gap(self, cause: str, seconds: float) -> None:
        """Count and log a delay of the next heartbeat past a quarter of the lease."""
        if seconds <= self.lease_s / 4:
            return
        self.heartbeat_gaps[cause] += 1
        self.heartbeat_gap_max_s = max(self.heartbeat_gap_max_s, seconds)
        log.warning(self._GAP_EVENTS[cause], node=self.node_id, node_service=self.service,
                    seconds=round(seconds, 3), lease_s=self.lease_s)

    def stats(self) -> dict[str, float]:
        """The session's counters for the node's stats: heartbeats delayed past a quarter of
        the lease by this process not running (``loop``) or by a slow reply (``reply``), the
        longest such delay, heartbeats sent, and the deposed leaders' replies refused."""
        out = {f"heartbeats_late_{k}": float(v) for k, v in self.heartbeat_gaps.items()}
        out["heartbeats_sent"] = float(self.heartbeats_sent)
        out["heartbeat_late_max_s"] = self.heartbeat_gap_max_s
        out["stale_replies"] = float(self.stale_replies)
        return out

    async def _lease_lost(self, seen: int) -> None:
        """The scheduler forgot registration ``seen`` (the epoch the refused call was sent
        under): new epoch, register again, tell the owner to drop work.

        ``seen`` is the call's epoch, not the current one: a heartbeat or fetch sent before
        another caller re-registered is refused for the old epoch, and must not throw away the
        registration made meanwhile (each extra one makes the scheduler drop the node's engines
        and re-plan their requests, once per call that was in flight)."""
        async with self._relogin:
            if self.epoch != seen:              # already registered again since that call
                return
            log.warning("lease_lost", node=self.node_id, node_service=self.service,
                        epoch=self.epoch)
            self.epoch = max(self.epoch + 1, time.time_ns())
            await _maybe_await(self._on_lease_lost)
            old = self.scheduler_epoch
            await self.register()
            if old != self.scheduler_epoch:
                log.warning("scheduler_restarted", node=self.node_id, node_service=self.service,
                            old_epoch=old, new_epoch=self.scheduler_epoch)
                await _maybe_await(self._on_scheduler_changed, old)

    async def fetch(self, engines: Sequence[EngineLoad] = (), read_q_tokens: int | None = None,
                    group_id: str = "") -> FetchWorkReply:
        """Pull work for the group; the reply is acknowledged by the next fetch."""
        msg = FetchWork(self.node_id, group_id, self.role, self.epoch, list(engines),
                        read_q_tokens, self._acked, self.fetch_wait_s)
        try:
            reply: FetchWorkReply = await self._call(msg)
        except NotFound:
            await self._lease_lost(msg.epoch)
            return FetchWorkReply(0, [], [], [], more=True)
        try:
            await self._fence(reply.scheduler_epoch)
        except Unavailable as e:                # a deposed leader's plans: not run
            log.warning("stale_epoch_refused", node=self.node_id, error=e.message)
            return FetchWorkReply(0, [], [], [], more=False)
        if msg.epoch != self.epoch:
            # we registered again while this fetch was out: its plans and bindings belong to
            # the registration the scheduler drops (and re-plans) when it sees the new epoch;
            # run them and they hold pages for requests no one will finish here
            return FetchWorkReply(0, [], [], [], more=True)
        if self._acked is not None and reply.seq <= self._acked:    # a resend we applied
            return FetchWorkReply(reply.seq, [], [], [], reply.more)
        self._acked = reply.seq
        return reply

    async def report(self, request_id: str, attempt: int, stage: Stage,
                     **kw: Any) -> ReportProgressReply:
        """Report a stage of a request attempt (``tokens``, ``code``, ``message``, ...)."""
        return await self.send_report(ReportProgress(request_id, attempt, stage,
                                                     node_id=self.node_id, **kw))

    async def _call(self, msg: Any, timeout: float | None = None) -> Any:
        failpoint("node.sched.call")    # chaos: a node cut off from the scheduler (faults)
        return await self._rpc.call(msg, timeout)

    async def _fence(self, epoch: int) -> None:
        """Refuse a reply from below the highest scheduler epoch seen (a deposed leader)."""
        if epoch and epoch < self.highest_epoch:
            self.stale_replies += 1
            await self._rpc.drop_connection()
            raise Unavailable(f"scheduler epoch {epoch} is below {self.highest_epoch}, the "
                              f"highest seen: a deposed leader — refused")
        self.highest_epoch = max(self.highest_epoch, epoch)

    async def send_report(self, msg: ReportProgress) -> ReportProgressReply:
        """Send a report as built (a redelivered one keeps its ``scheduler_epoch``)."""
        return await self._call(msg)


async def _close_resolver(resolve: Any) -> None:
    """A resolver that holds a connection (``election.LeaderResolver``) is closed with us."""
    close = getattr(resolve, "close", None)
    if close is not None:
        await close()


async def _maybe_await(callback: Callable[..., Any] | None, *args: Any) -> None:
    if callback is not None:
        result = callback(*args)
        if inspect.isawaitable(result):
            await result
