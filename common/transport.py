"""UCX page transport: write a byte stream into a peer's registered arena slots.

With :mod:`common.transport_ucx` (the ``ucxx`` import, the UCX context, link and transfer
book-keeping) and :mod:`common.ucxx_handshake` (a memory-safe replacement for ucxx's endpoint
handshake, installed on first use), the only code of dualpath that touches ``ucxx`` (DESIGN
§5). The receiver posts every
receive of a transfer in advance (:meth:`PageTransport.expect`), straight into its arena
(``force_tag`` tag receives); the sender cuts the same :func:`plan_messages` plan over the
receiver's slots and sends each message with its tag. Completion of the posted receives is
the "data arrived" signal: no per-page control message. The API is "these local ranges into
those remote slots", so a one-sided RMA backend can replace tags later.

Settings (measured, docs/performance.md):

* One UCX context + worker per transport, options from ``cfg.traffic_classes[cfg.kv_class]``;
  options this UCX build cannot apply (``IB_SL`` without verbs) are logged once and skipped.
* Progress: our own event-driven driver (:class:`WorkerProgress`) on the worker's epoll fd.
  ucxx's ``BlockingMode`` never re-arms the worker after the first event, so once a
  connection exists it spins at 100 % of a core; ours arms after every round: 0 % idle.
* Failure: any error, deadline or cancellation part-way through a transfer aborts that
  endpoint (a half-received tag sequence is never reused), waits until every request of the
  transfer has completed (no receive left targeting the caller's buffers) and raises a typed
  error. Other transfers on the same endpoint fail with ``PeerFailed`` (retryable).
* Buffer lifetime: a ucxx request holds a raw pointer to its buffer, never a reference. A
  request that may still complete when we stop waiting for it (a handshake or commit receive
  given up on, a request still pending after ``_SETTLE_S``) keeps its buffer alive in
  ``_parked`` until UCX completed it; whatever is still pending at ``stop()`` is kept for the
  life of the process (``requests_orphaned``). Freed earlier, a late write would land in
  reused heap memory: a crash far from its cause.
* Single copy (same host): a link is the listener/``create_endpoint`` endpoint pair (error
  handling on: liveness, handshake, receives, aborts). Under error handling UCX never picks
  ``cma`` for rendezvous, so bytes would cross as sysv fragments, copied in by the sender and
  out by the receiver. When both hellos carry a worker address and the same host id, the
  sender instead sends its messages over a second endpoint made from the peer's worker
  address without error handling: cma get-zcopy, one copy done by the receiver, ~0 CPU on
  the sender. Receives stay posted on the link's endpoint (tag matching is worker-wide), so
  a dead or aborting peer still fails them at once. Because that endpoint cannot be
  cancelled, the sender ends every transfer with a *commit* (tag index ``COMMIT_INDEX``, on
  the link's endpoint, sent after every message completed, i.e. after the receiver took
  every byte) and the receiver's transfer completes only with it: a sender that fails can
  reuse its buffers at once (a receiver still reading them never gets the commit and fails),
  and its unfinished sends are abandoned (``sends_abandoned``), not awaited.
  There is one such endpoint per peer *worker*, made when the first link to it registers and
  kept until ``stop()`` or until that peer's process is gone: UCX pairs endpoints made from
  worker addresses by a per-peer sequence number (the second side adopts the endpoint the
  first side's wireup created), so closing one side while the other lives would pair a later
  endpoint with a dead one.

Tags: ``transfer_id << 20 | message_index`` (``common.transport_plan``); tag matching is
worker-wide, so transfer ids come from the *receiving* transport (:meth:`new_transfer_id`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from common.config import TransportConfig
from common.errors import (Cancelled, ConfigError, DeadlineExceeded, DualpathError,
                           InvalidArgument, PeerFailed, ProtocolError, Unavailable)
from common.transport_plan import (COMMIT_BYTES, COMMIT_INDEX, HELLO_BYTES, HELLO_VERSION,
                                   INDEX_BITS, MessagePlan, SourceMap, StagingPool,
                                   TransferHello, TransferIdSource, check_flat_bytes,
                                   check_same_plan, check_transfer_id, decode_hello,
                                   encode_hello, fit_hello, is_device_array, plan_messages,
                                   single_copy_link)
from common.transport_ucx import Link as _Link
from common.transport_ucx import Peer, ReceiveHandle
from common.transport_ucx import Transfer as _Transfer
from common.transport_ucx import claim_progress as _claim_progress
from common.transport_ucx import create_context as _create_context
from common.transport_ucx import ucxx as _ucxx
from common.ucx_env import (WorkerProgress, apply_ucx_env, local_host_id, local_process_id,
                            process_gone, single_copy_supported)

log = structlog.get_logger(__name__)

_RETIRED_IDS = 4096          # failed transfer ids remembered (never reused)
_SETTLE_S = 5.0              # bound on waiting for cancelled requests to complete
_GONE_CHECKS, _GONE_RECHECK_S = 5, 2.0  # is a failed single-copy peer's process gone?
# Buffers a stopped transport could not prove idle (a request still pending at stop): ucxx
# requests hold raw pointers, not references, so freeing these could let a late UCX write land
# in reused heap memory. Kept for the life of the process (counted in ``requests_orphaned``).
_ORPHANED: list[Any] = []


class PageTransport:
    """UCX page transport of one process (one context/worker for the KV traffic class)."""

    def __init__(self, cfg: TransportConfig, node_id: str) -> None:
        if cfg.kv_class not in cfg.traffic_classes:
            raise ConfigError(f"transport.kv_class {cfg.kv_class!r} is not one of "
                              f"transport.traffic_classes {sorted(cfg.traffic_classes)}")
        if cfg.max_message_bytes <= 0 or cfg.max_inflight_messages <= 0:
            raise ConfigError("transport.max_message_bytes and max_inflight_messages must be > 0")
        if cfg.staging_bytes < cfg.max_message_bytes:
            raise ConfigError(f"transport.staging_bytes ({cfg.staging_bytes}) must hold one "
                              f"message of max_message_bytes ({cfg.max_message_bytes})")
        self._cfg, self.node_id = cfg, node_id
        self._ids = TransferIdSource()
        self._links: dict[Peer, _Link] = {}
        self._all_links: set[_Link] = set()
        self._connecting: dict[Peer, asyncio.Lock] = {}
        self._receiving: dict[int, _Transfer] = {}
        self._active: set[_Transfer] = set()
        self._handshaking: set[Any] = set()
        self._retired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._state = "init"
        self._lock = asyncio.Lock()
        self._ctx: Any = None
        self._listener: Any = None
        self._progress: WorkerProgress | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._staging: StagingPool | None = None
        self._worker_address = b""
        self._host_id = ""
        self._process_id = local_process_id()
        self._data_eps: dict[bytes, Any] = {}   # peer worker address -> endpoint (single copy)
        self._parked: list[tuple[Any, Any]] = []  # (request, buffers it points into): _park
        self.single_copy_reason = ""
        self.skipped_options: list[str] = []
        self._n: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the UCX context, the progress driver, staging and the listener."""
        async with self._lock:
            if self._state != "init":
                return
            cfg, loop = self._cfg, asyncio.get_running_loop()
            env = apply_ucx_env(cfg.shared_memory)
            _claim_progress(loop)
            options = cfg.traffic_classes[cfg.kv_class].ucx_options()
            self._ctx, self.skipped_options = _create_context(options, cfg.kv_class)
            single, self.single_copy_reason = single_copy_supported(options.get("TLS"))
            self._host_id = local_host_id() if single else ""
            self._worker_address = bytes(self._ctx.worker.address.tobytes()) if single else b""
            self._progress = WorkerProgress(self._ctx.worker, loop)
            self._loop = loop
            try:
                self._staging = StagingPool(cfg.staging_bytes, on_free=self._progress.kick)
                _claim_progress(loop)
                self._listener = self._ctx.create_listener(
                    self._on_accept, port=cfg.port, endpoint_error_handling=True,
                    connect_timeout=cfg.connect_timeout_s)
            except BaseException:
                self._progress.close()
                self._ctx = self._staging = None
                raise
            self._state = "running"
            log.info("transport_started", node_id=self.node_id, host=cfg.host,
                     port=self._listener.port, traffic_class=cfg.kv_class,
                     options=options, skipped=self.skipped_options, env_set=env,
                     single_copy=bool(self._worker_address), single_copy_reason=self.single_copy_reason)

    async def stop(self) -> None:
        """Stop accepting, cancel transfers, close endpoints, release UCX (idempotent)."""
        async with self._lock:
            if self._state != "running":
                self._state = "closed"
                return
            self._state = "closing"
            for rx in list(self._receiving.values()):
                rx.task.cancel()
            for link in list(self._all_links):
                self._abort_link(link, "transport stopping")
            for ep in list(self._handshaking):
                ep.abort()
            await self._drain(self._cfg.connect_timeout_s)
            self._orphan_unsettled()
            for ep in self._data_eps.values():
                ep.abort()
            self._data_eps.clear()
            self._listener.close()
            self._progress.close()
            self._listener = self._ctx = self._staging = None
            self._worker_address = b""
            self._links.clear()
            self._all_links.clear()
            self._state = "closed"
            log.info("transport_stopped", node_id=self.node_id, **self._n)

    def _orphan_unsettled(self) -> None:
        """At stop: keep alive every buffer a request may still write into or read from."""
        self._prune_parked()
        keep = [k for _, k in self._parked]
        for t in self._active:       # the drain timed out on these
            keep.append((t.keep, t.arena, t.commit))
        if keep:
            keep.append(self._staging)
            _ORPHANED.append(keep)
            self._n["requests_orphaned"] += len(self._parked) + len(self._active)
            log.warning("transport_buffers_orphaned", requests=len(self._parked),
                        transfers=len(self._active))
        self._parked = []

    def _park(self, req: Any, keep: Any) -> None:
        """ucxx requests hold raw pointers, never references: a request that may still
        complete keeps the buffers it points into alive (here) until it has completed."""
        if req is not None and not req.completed:
            self._prune_parked()
            self._parked.append((req, keep))
            self._n["requests_parked"] += 1

    def _prune_parked(self) -> None:
        if self._parked:
            self._parked = [(r, k) for r, k in self._parked if not r.completed]

    async def _drain(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while (self._active or self._listener.active_clients) and time.monotonic() < end:
            await asyncio.wait([self._progress.tick()], timeout=0.01)
        if self._active or self._listener.active_clients:
            log.warning("transport_stop_timed_out", transfers=len(self._active),
                        handlers=self._listener.active_clients)

    async def __aenter__(self) -> PageTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def address(self) -> Peer:
        """The ``(host, port)`` peers connect to (``cfg.host`` is advertised as is)."""
        self._check_running()
        return (self._cfg.host, int(self._listener.port))

    def new_transfer_id(self) -> int:
        """A transfer id unique on this (receiving) transport; the sender uses it as is."""
        return self._ids.next()

    def _check_running(self) -> None:
        if self._state != "running":
            raise Unavailable(f"page transport of {self.node_id} is {self._state}, not running")

    # ------------------------------------------------------------------ endpoints

    async def endpoint(self, peer: Peer, deadline_s: float | None = None) -> Any:
        """The ucxx endpoint page messages to ``peer`` travel on (connecting if needed) — for
        baselines/diagnostics: on a single-copy link the worker-address endpoint (no error
        handling: a dead peer is not reported on it), else the link's own endpoint."""
        self._check_running()
        budget = self._cfg.connect_timeout_s if deadline_s is None else deadline_s
        link = await self._link_to(tuple(peer), asyncio.get_running_loop().time() + budget)
        return await self._data_ep(link)

    async def _link_to(self, peer: Peer, deadline_at: float) -> _Link:
        link = self._links.get(peer)
        if link is not None and link.usable:
            return link
        async with self._connecting.setdefault(peer, asyncio.Lock()):
            link = self._links.get(peer)
            if link is not None and link.usable:
                return link
            return await self._connect(peer, deadline_at)

    async def _connect(self, peer: Peer, deadline_at: float) -> _Link:
        u, loop, cfg = _ucxx(), asyncio.get_running_loop(), self._cfg
        budget = min(cfg.connect_timeout_s, deadline_at - loop.time())
        if budget <= 0:
            raise DeadlineExceeded(f"deadline passed before connecting to {peer}")
        ep = None
        try:
            with self._progress.busy():
                async with asyncio.timeout(budget):
                    _claim_progress(loop)
                    ep = await self._ctx.create_endpoint(
                        peer[0], peer[1], endpoint_error_handling=True, connect_timeout=budget)
                    await self._send_hello(ep)
                    hello = await self._recv_hello(ep)
                    self._check_hello(hello)
        except (TimeoutError, ProtocolError, u.Error, OSError, RuntimeError) as e:
            if ep is not None:
                ep.abort()
            if isinstance(e, ProtocolError):
                raise
            if loop.time() >= deadline_at:
                raise DeadlineExceeded(f"deadline passed while connecting to {peer}") from e
            raise Unavailable(f"cannot connect to page transport {peer[0]}:{peer[1]} "
                              f"({type(e).__name__}: {e}) — is the peer started?") from e
        self._n["connects"] += 1
        link = self._register(self._new_link(peer, ep, hello))
        await self._open_data_ep(link)
        return link

    async def _on_accept(self, ep: Any) -> None:
        if self._state != "running":
            ep.abort()
            return
        self._handshaking.add(ep)
        try:
            with self._progress.busy():
                async with asyncio.timeout(self._cfg.connect_timeout_s):
                    hello = await self._recv_hello(ep)
                    await self._send_hello(ep)  # ours first: the client reports a mismatch
                    self._check_hello(hello)
            link = self._register(self._new_link((hello.host, hello.port), ep, hello))
            await self._open_data_ep(link)
            self._n["accepts"] += 1
        except (TimeoutError, ProtocolError, Unavailable, _ucxx().Error) as e:
            log.warning("peer_handshake_failed", error=repr(e))
            ep.abort()
        finally:
            self._handshaking.discard(ep)

    def _new_link(self, addr: Peer, ep: Any, hello: TransferHello) -> _Link:
        single = single_copy_link(self._hello(), hello)
        return _Link(addr, ep, hello.node_id, single_copy=single,
                     peer_worker_address=hello.worker_address if single else b"",
                     peer_process=hello.process)

    async def _open_data_ep(self, link: _Link) -> None:
        """Make the single-copy endpoint to the link's peer worker now (see the module doc)."""
        if not link.single_copy or link.peer_worker_address in self._data_eps:
            return
        u = _ucxx()
        _claim_progress(asyncio.get_running_loop())
        try:
            ep = await self._ctx.create_endpoint_from_worker_address(
                u.lib.UCXAddress.create_from_buffer(link.peer_worker_address),
                endpoint_error_handling=False)
        except Exception as e:  # a bad address, a UCX refusal: data then goes over link.ep
            log.warning("single_copy_endpoint_failed", peer=link.addr, error=repr(e))
            return
        if self._state != "running" or link.peer_worker_address in self._data_eps:
            ep.abort()
            return
        self._data_eps[link.peer_worker_address] = ep
        self._n["single_copy_endpoints"] += 1

    async def _data_ep(self, link: _Link) -> Any:
        """The endpoint this side sends page messages to ``link`` on."""
        if not link.single_copy:
            return link.ep
        ep = self._data_eps.get(link.peer_worker_address)
        if ep is None:
            if not link.usable:
                raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
            await self._open_data_ep(link)
            ep = self._data_eps.get(link.peer_worker_address)
        return link.ep if ep is None else ep

    def _forget_if_gone(self, link: _Link, checks_left: int = _GONE_CHECKS) -> None:
        """Close the single-copy endpoint of a failed link's peer once its process has ended
        (a process that just closed its endpoints may still be exiting: look again later)."""
        addr = link.peer_worker_address
        if not link.single_copy or addr not in self._data_eps or self._state != "running":
            return
        if any(other.usable and other.peer_worker_address == addr for other in self._all_links):
            return  # the peer is connected again: it is alive
        if process_gone(link.peer_process):
            self._data_eps.pop(addr).abort()
        elif checks_left > 1 and self._loop is not None:
            self._loop.call_later(_GONE_RECHECK_S, self._forget_if_gone, link, checks_left - 1)

    def _register(self, link: _Link) -> _Link:
        if self._state != "running":
            link.ep.abort()
            raise Unavailable(f"page transport of {self.node_id} is stopping")
        self._all_links.add(link)
        link.ep.set_close_callback(self._on_link_closed, cb_args=(link,))
        current = self._links.get(link.addr)
        if current is None or not current.usable:
            self._links[link.addr] = link
        log.debug("endpoint_registered", peer=link.addr, node_id=link.node_id)
        return link

    def _on_link_closed(self, link: _Link) -> None:
        if link.failure is None:
            link.failure = "endpoint closed (peer failed or left)"
        if self._links.get(link.addr) is link:
            del self._links[link.addr]
        if link.single_copy and self._loop is not None:  # not inside UCX's callback
            self._loop.call_soon_threadsafe(self._forget_if_gone, link)
        if self._progress is not None:
            self._progress.kick()

    def _abort_link(self, link: _Link, reason: str) -> None:
        if link.failure is None:
            link.failure = reason
        if self._links.get(link.addr) is link:
            del self._links[link.addr]
        self._all_links.discard(link)
        self._forget_if_gone(link)
        if link.ep._ep is not None:
            self._n["endpoint_aborts"] += 1
            log.info("endpoint_aborted", peer=link.addr, reason=reason)
            link.ep.abort()

    def _hello(self) -> TransferHello:
        cfg = self._cfg
        return fit_hello(TransferHello(HELLO_VERSION, self.node_id, cfg.host,
                                       int(self._listener.port), cfg.max_message_bytes,
                                       cfg.pack_below_bytes, self._worker_address,
                                       self._host_id, self._process_id))

    async def _send_hello(self, ep: Any) -> None:
        u, buf = _ucxx(), encode_hello(self._hello())
        await self._wait_one(ep._ep.tag_send(u.Array(buf), u.Tag(ep._tags["msg_send"])), buf)

    async def _recv_hello(self, ep: Any) -> TransferHello:
        u, buf = _ucxx(), np.zeros(HELLO_BYTES, dtype=np.uint8)
        await self._wait_one(ep._ep.tag_recv(u.Array(buf), u.Tag(ep._tags["msg_recv"]), u.Mask),
                             buf)
        return decode_hello(buf)

    def _check_hello(self, hello: TransferHello) -> None:
        check_same_plan(self._hello(), hello)

    async def _wait_one(self, req: Any, buf: Any) -> None:
        """Wait for one request on ``buf``; a timed-out or cancelled wait parks ``buf``."""
        self._progress.kick()
        try:
            while not req.completed:
                await self._progress.tick()
        finally:
            self._park(req, buf)
        req.check_error()

    # ------------------------------------------------------------------ receive

    async def expect(self, peer: Peer, transfer_id: int, arena: Any,
                     slots: Sequence[tuple[int, int]], deadline_s: float) -> ReceiveHandle:
        """Post every receive of ``transfer_id`` from ``peer`` into ``arena`` ``slots`` now.

        ``slots`` are ``(offset, nbytes)`` runs of the flat uint8 ``arena`` (the registered
        pool), in stream order — send the same list to the peer (``PageSlots``). Direct
        messages land in the arena; packed ones (small, non-contiguous runs) in staging, then
        are scattered — those beyond the free staging are posted as staging frees up (in
        order). ``deadline_s`` is the budget from now. Device (cupy) arenas take direct
        messages only. ``await handle.wait()`` before reading the arena; after a failure or
        ``await handle.cancel()`` no receive targets it any more.
        """
        self._check_running()
        check_transfer_id(transfer_id)
        if transfer_id in self._receiving or transfer_id in self._retired:
            raise InvalidArgument(f"transfer id {transfer_id} is in use or was aborted; "
                                  "take a new one from new_transfer_id()")
        check_flat_bytes(arena, "arena", writable=True)
        plan = plan_messages(slots, self._cfg.max_message_bytes, self._cfg.pack_below_bytes)
        self._check_slots(plan, arena)
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline_s
        link = await self._link_to(tuple(peer), deadline_at)
        if transfer_id in self._receiving:
            raise InvalidArgument(f"transfer id {transfer_id} is already expected")
        rx = _Transfer(transfer_id, link, plan, plan[-1].stream_end if plan else 0,
                       collections.deque(), collections.deque(), arena, keep=arena)
        self._receiving[transfer_id] = rx
        self._active.add(rx)
        try:
            self._post_receives(rx)
        except BaseException as e:
            self._receiving.pop(transfer_id, None)
            self._active.discard(rx)
            raise await self._fail(rx, e, "receive", deadline_s) from e
        rx.task = loop.create_task(self._receive(rx, deadline_at, deadline_s))
        handle = ReceiveHandle(transfer_id, link.addr, rx.nbytes, rx.task)
        try:  # let the task reach its first await: from then on, cancelling it cleans up
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            await handle.cancel()
            raise
        return handle

    def _check_slots(self, plan: list[MessagePlan], arena: Any) -> None:
        size = int(arena.nbytes)
        for msg in plan:
            if msg.packed and is_device_array(arena):
                raise InvalidArgument("device arenas need direct messages: make the slots "
                                      "contiguous or set transport.pack_below_bytes = 0")
            for off, n in msg.pieces:
                if off + n > size:
                    raise InvalidArgument(f"slot ({off}, {n}) ends beyond the arena ({size} B)")

    def _post_receives(self, rx: _Transfer) -> None:
        u, ep, base = _ucxx(), rx.link.ep._ep, rx.transfer_id << INDEX_BITS
        Array, Tag, mask, arena = u.Array, u.Tag, u.Mask, rx.arena
        if rx.link.single_copy:
            buf = np.zeros(COMMIT_BYTES, np.uint8)
            rx.commit = (ep.tag_recv(Array(buf), Tag(base | COMMIT_INDEX), mask), buf)
        for msg in rx.plan:
            if not msg.packed:
                off = msg.pieces[0][0]
                req = ep.tag_recv(Array(arena[off:off + msg.nbytes]), Tag(base | msg.index), mask)
                rx.posted.append((req, msg, None))
            elif rx.deferred or not self._post_packed(rx, msg):
                rx.deferred.append(msg)  # keep packed posts in order (no staging deadlock)
        self._progress.kick()

    def _post_packed(self, rx: _Transfer, msg: MessagePlan) -> bool:
        stg = self._staging.try_alloc(msg.nbytes)
        if stg is None:
            return False
        u = _ucxx()
        req = rx.link.ep._ep.tag_recv(u.Array(self._staging.view(stg, msg.nbytes)),
                                      u.Tag((rx.transfer_id << INDEX_BITS) | msg.index), u.Mask)
        rx.posted.append((req, msg, stg))
        return True

    async def _receive(self, rx: _Transfer, deadline_at: float, deadline_s: float) -> None:
        try:
            async with asyncio.timeout_at(deadline_at):
                await self._receive_loop(rx)
            self._n["transfers_received_ok"] += 1
            self._n["bytes_received"] += rx.nbytes
        except BaseException as e:
            self._n["transfers_received_failed"] += 1
            raise await self._fail(rx, e, "receive", deadline_s) from e
        finally:
            self._receiving.pop(rx.transfer_id, None)
            self._active.discard(rx)

    async def _receive_loop(self, rx: _Transfer) -> None:
        posted, deferred, staging = rx.posted, rx.deferred, self._staging
        while posted or deferred:
            while deferred and self._post_packed(rx, deferred[0]):
                deferred.popleft()
                self._progress.kick()
            if posted and posted[0][0].completed:
                req, msg, stg = posted.popleft()
                req.check_error()
                self._n["messages_received"] += 1
                if stg is not None:
                    self._scatter(rx.arena, msg, stg)
                    staging.free(stg)
                continue
            await self._progress.tick()
        if rx.commit is not None:  # the sender saw every message taken: the bytes are good
            req, buf = rx.commit
            while not req.completed:
                await self._progress.tick()
            req.check_error()
            rx.commit = None
            if int(buf.view(np.uint64)[0]) != rx.nbytes:
                raise ProtocolError(f"transfer {rx.transfer_id}: the sender committed "
                                    f"{int(buf.view(np.uint64)[0])} B, expected {rx.nbytes} B")

    def _scatter(self, arena: np.ndarray, msg: MessagePlan, stg: int) -> None:
        src, pos = self._staging.buffer, stg
        for off, n in msg.pieces:
            arena[off:off + n] = src[pos:pos + n]
            pos += n
        self._n["packed_messages"] += 1
        self._n["packed_bytes"] += msg.nbytes

    # ------------------------------------------------------------------ send

    async def send(self, peer: Peer, transfer_id: int, src: Sequence[Any],
                   slots: Sequence[tuple[int, int]], deadline_s: float,
                   inflight: int | None = None) -> None:
        """Send the concatenation of ``src`` into the receiver's ``slots`` (its PageSlots).

        At most ``inflight`` (default ``cfg.max_inflight_messages``) messages are in flight.
        Device (cupy) sources: synchronize the producing stream first. Returns when every
        message has left (UCX send completion: the buffers are reusable; for rendezvous
        messages the receiver has pulled the bytes).
        A cancelled caller gets ``CancelledError`` after the endpoint was aborted and all
        sends completed; failures raise PeerFailed / DeadlineExceeded / InvalidArgument.
        """
        self._check_running()
        check_transfer_id(transfer_id)
        for i, view in enumerate(src):
            check_flat_bytes(view, f"src[{i}]")
        source = SourceMap(src)
        plan = plan_messages(slots, self._cfg.max_message_bytes, self._cfg.pack_below_bytes)
        total = plan[-1].stream_end if plan else 0
        if source.nbytes != total:
            raise InvalidArgument(f"transfer {transfer_id}: source holds {source.nbytes} B but "
                                  f"the receiver's slots hold {total} B")
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline_s
        link = await self._link_to(tuple(peer), deadline_at)
        tx = _Transfer(transfer_id, link, plan, total, collections.deque(), collections.deque(),
                       keep=tuple(src))
        self._active.add(tx)
        try:
            async with asyncio.timeout_at(deadline_at):
                device = any(is_device_array(v) for v in src)
                ep = link.ep if device else await self._data_ep(link)
                await self._send_loop(tx, ep, source, device,
                                      inflight or self._cfg.max_inflight_messages)
                if link.single_copy:
                    await self._send_commit(tx)
            self._n["transfers_sent_ok"] += 1
            self._n["bytes_sent"] += total
        except BaseException as e:
            self._n["transfers_sent_failed"] += 1
            err = await self._fail(tx, e, "send", deadline_s)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise err from e
        finally:
            self._active.discard(tx)

    async def _send_loop(self, tx: _Transfer, ep: Any, source: SourceMap, device: bool,
                         limit: int) -> None:
        u, staging, window, link = _ucxx(), self._staging, tx.posted, tx.link
        ep, base = ep._ep, tx.transfer_id << INDEX_BITS
        Array, Tag, plan, i, count = u.Array, u.Tag, tx.plan, 0, len(tx.plan)
        while i < count or window:
            if not link.usable:  # a data endpoint never reports its peer: the link does
                raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
            posted = reaped = 0
            while i < count and len(window) < limit:
                msg, stg = plan[i], None
                buf = source.single(msg.stream_offset, msg.nbytes)
                if buf is None:
                    if device:
                        raise InvalidArgument("device sources must not split a message across "
                                              "views (no device staging): pass one view")
                    stg = staging.try_alloc(msg.nbytes)
                    if stg is None:
                        break
                    buf = staging.view(stg, msg.nbytes)
                    source.gather_into(buf, msg.stream_offset)
                    self._n["gathered_bytes"] += msg.nbytes
                window.append((ep.tag_send(Array(buf), Tag(base | i)), msg, stg))
                i += 1
                posted += 1
            if posted:
                self._progress.kick()
            while window and window[0][0].completed:
                req, msg, stg = window.popleft()
                req.check_error()
                if stg is not None:
                    staging.free(stg)
                reaped += 1
            self._n["messages_sent"] += reaped
            if not posted and not reaped:
                await self._progress.tick()

    async def _send_commit(self, tx: _Transfer) -> None:
        """After every message completed (the receiver took every byte): the commit."""
        u, link = _ucxx(), tx.link
        if not link.usable:
            raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
        buf = np.array([tx.nbytes], np.uint64).view(np.uint8)
        req = link.ep._ep.tag_send(u.Array(buf), u.Tag((tx.transfer_id << INDEX_BITS) | COMMIT_INDEX))
        tx.posted.append((req, None, None))
        tx.keep = (tx.keep, buf)
        self._progress.kick()
        while not req.completed:
            if not link.usable:
                raise PeerFailed(f"endpoint to {link.addr} is down: {link.failure}")
            await self._progress.tick()
        tx.posted.clear()
        req.check_error()

    # ------------------------------------------------------------------ failure

    async def _fail(self, t: _Transfer, exc: BaseException, side: str,
                    deadline_s: float) -> DualpathError:
        """Abort the endpoint, wait until no request of ``t`` is pending, type the error."""
        err = self._classify(t, exc, side, deadline_s)
        if side == "receive":
            self._retire(t.transfer_id)
        if t.posted or t.deferred or t.commit is not None:
            self._abort_link(t.link, f"{side} of transfer {t.transfer_id} failed: {err.code}")
        if side == "send" and t.link.single_copy:
            self._abandon(t)   # the receiver fails without our commit: buffers are free now
        await self._settle(t)
        log.warning("transfer_failed", side=side, transfer_id=t.transfer_id, peer=t.link.addr,
                    error=err.code.value, detail=err.message)
        return err

    def _classify(self, t: _Transfer, exc: BaseException, side: str,
                  deadline_s: float) -> DualpathError:
        what = f"{side} of transfer {t.transfer_id} with {t.link.addr[0]}:{t.link.addr[1]}"
        if isinstance(exc, DualpathError):
            return exc
        if self._state != "running":
            return Cancelled(f"{what}: transport stopping")
        if isinstance(exc, TimeoutError):
            return DeadlineExceeded(f"{what}: deadline of {deadline_s:.3g}s passed with "
                                    f"{len(t.posted) + len(t.deferred)} messages outstanding")
        if isinstance(exc, asyncio.CancelledError):
            return Cancelled(f"{what}: cancelled")
        if isinstance(exc, _ucxx().Error):
            cause = t.link.failure or f"{type(exc).__name__}: {exc}"
            return PeerFailed(f"{what}: peer {t.link.node_id or t.link.addr} failed ({cause})")
        return PeerFailed(f"{what}: {type(exc).__name__}: {exc}")

    def _retire(self, transfer_id: int) -> None:
        self._retired[transfer_id] = None
        while len(self._retired) > _RETIRED_IDS:
            self._retired.popitem(last=False)

    def _abandon(self, t: _Transfer) -> None:
        """Drop a failed single-copy send's requests: the data endpoint cannot cancel them
        (they complete only if the receiver takes the bytes), and without the commit no
        receiver counts bytes read from these buffers, so they go back to the caller now."""
        for req, _, stg in t.posted:
            if not req.completed:  # (UCX may only read these buffers later, never write)
                self._n["sends_abandoned"] += 1
            if stg is not None:
                self._staging.free(stg)
        t.posted = collections.deque()

    async def _settle(self, t: _Transfer) -> None:
        """Cancelled/aborted requests must complete before buffers go back to the caller."""
        if t.commit is not None:  # posted on the link's endpoint: the abort cancels it
            t.posted.append((t.commit[0], None, None))
            t.keep, t.commit = (t.keep, t.commit[1]), None
        end = time.monotonic() + _SETTLE_S
        while self._ctx is not None:
            self._ctx.worker.progress()
            pending = collections.deque()
            for entry in t.posted:
                if not entry[0].completed:
                    pending.append(entry)
                elif entry[2] is not None:
                    self._staging.free(entry[2])
            t.posted = pending
            if not pending or time.monotonic() > end:
                break
            await asyncio.sleep(0.001)
        t.deferred.clear()
        if t.posted:  # their staging stays allocated and their buffers parked: UCX may still
            log.error("transfer_requests_not_settled", transfer_id=t.transfer_id,  # write
                      pending=len(t.posted))
            for req, _, _ in t.posted:
                self._park(req, (t.keep, self._staging.buffer if self._staging else None))
            t.posted = collections.deque()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, float]:
        """Counters for metrics (bytes, messages, transfers, staging, endpoints)."""
        out = {k: float(self._n.get(k, 0)) for k in (
            "bytes_sent", "bytes_received", "messages_sent", "messages_received",
            "transfers_sent_ok", "transfers_sent_failed", "transfers_received_ok",
            "transfers_received_failed", "packed_messages", "packed_bytes", "gathered_bytes",
            "connects", "accepts", "endpoint_aborts", "single_copy_endpoints",
            "sends_abandoned", "requests_parked", "requests_orphaned")}
        out["requests_parked_now"] = float(len(self._parked))
        staging = self._staging
        out["staging_in_use_bytes"] = float(staging.in_use if staging else 0)
        out["staging_peak_bytes"] = float(staging.peak if staging else 0)
        out["staging_capacity_bytes"] = float(staging.capacity if staging else 0)
        out["endpoints"] = float(sum(1 for link in self._all_links if link.usable))
        out["single_copy_links"] = float(sum(1 for link in self._all_links
                                             if link.usable and link.single_copy))
        out["single_copy_endpoints_open"] = float(len(self._data_eps))
        out["transfers_active"] = float(len(self._active))
        out["ucx_options_skipped"] = float(len(self.skipped_options))
        return out
