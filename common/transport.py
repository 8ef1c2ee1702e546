"""UCX page transport: write a byte stream into a peer's registered arena slots.

With :mod:`common.transport_ucx` (the ``ucxx`` import, the UCX context, link and transfer
book-keeping) and :mod:`common.ucxx_handshake` (a memory-safe replacement for ucxx's endpoint
handshake, installed on first use), the only code of dualpath that touches ``ucxx``
(docs/contributing.md, 'Layers'). The receiver posts every
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

Layers: :class:`PageTransport` (state, lifecycle, stats; this module) on
:class:`~common.transport_transfers.TransferEngine` (receive, send, failure) on
:class:`~common.transport_links.LinkTable` (links, handshakes, single-copy endpoints, parked
buffers).

Tags: ``transfer_id << 20 | message_index`` (``common.transport_plan``); tag matching is
worker-wide, so transfer ids come from the *receiving* transport (:meth:`new_transfer_id`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import structlog

from common.config import TransportConfig
from common.errors import ConfigError
from common.transport_plan import StagingPool, TransferIdSource
from common.transport_staging import STAGING_ALIGN, StagingQueue, staged_bytes
from common.transport_transfers import TransferEngine
from common.transport_ucx import Link as _Link
from common.transport_ucx import Peer, ReceiveHandle
from common.transport_ucx import Transfer as _Transfer
from common.transport_ucx import claim_progress as _claim_progress
from common.transport_ucx import create_context as _create_context
from common.transport_ucx import ucxx as _ucxx  # noqa: F401  (tests import ucxx through here)
from common.ucx_env import (WorkerProgress, apply_ucx_env, local_host_id, local_process_id,
                            single_copy_supported)

__all__ = ["PageTransport", "Peer", "ReceiveHandle"]

log = structlog.get_logger(__name__)

# Buffers a stopped transport could not prove idle (a request still pending at stop): ucxx
# requests hold raw pointers, not references, so freeing these could let a late UCX write land
# in reused heap memory. Kept for the life of the process (counted in ``requests_orphaned``).
_ORPHANED: list[Any] = []


class PageTransport(TransferEngine):
    """UCX page transport of one process (one context/worker for the KV traffic class)."""

    def __init__(self, cfg: TransportConfig, node_id: str) -> None:
        if cfg.kv_class not in cfg.traffic_classes:
            raise ConfigError(f"transport.kv_class {cfg.kv_class!r} is not one of "
                              f"transport.traffic_classes {sorted(cfg.traffic_classes)}")
        if cfg.max_message_bytes <= 0 or cfg.max_inflight_messages <= 0:
            raise ConfigError("transport.max_message_bytes and max_inflight_messages must be > 0")
        if cfg.staging_bytes < staged_bytes(cfg.max_message_bytes):  # or a packed message
            raise ConfigError(                                          # could never be posted
                f"transport.staging_bytes ({cfg.staging_bytes}) must hold one message of "
                f"max_message_bytes ({cfg.max_message_bytes}) rounded up to {STAGING_ALIGN} B")
        self._cfg, self.node_id = cfg, node_id
        self._ids = TransferIdSource()
        self._links: dict[Peer, _Link] = {}
        self._all_links: set[_Link] = set()
        self._connecting: dict[Peer, asyncio.Lock] = {}
        self._receiving: dict[int, _Transfer] = {}
        self._active: set[_Transfer] = set()
        self._handshaking: set[Any] = set()
        self._retired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._staging_queue = StagingQueue()
        self._state = "init"
        self._lock = asyncio.Lock()
        self._ctx: Any = None
        self._listener: Any = None
        self._worker_progress: WorkerProgress | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._staging_pool: StagingPool | None = None
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
            self._worker_progress = WorkerProgress(self._ctx.worker, loop)
            self._loop = loop
            try:
                self._staging_pool = StagingPool(cfg.staging_bytes, align=STAGING_ALIGN,
                                                 on_free=self._progress.kick)
                _claim_progress(loop)
                self._listener = self._ctx.create_listener(
                    self._on_accept, port=cfg.port, endpoint_error_handling=True,
                    connect_timeout=cfg.connect_timeout_s)
            except BaseException:
                self._progress.close()
                self._ctx = self._staging_pool = None
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
                if rx.task is not None:   # set before expect() yields: always, in practice
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
            self._listener = self._ctx = self._staging_pool = None
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
            keep.append(self._staging_pool)
            _ORPHANED.append(keep)
            self._n["requests_orphaned"] += len(self._parked) + len(self._active)
            log.warning("transport_buffers_orphaned", requests=len(self._parked),
                        transfers=len(self._active))
        self._parked = []

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
        staging = self._staging_pool
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
