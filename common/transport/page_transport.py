"""The page transport of one process: a small facade over :class:`Links` and
:class:`Transfers` (the package doc explains the design and who does what).

It checks the config, and at ``start()`` makes the UCX context and progress driver both
objects run on; ``stop()`` ends them in the order the buffer rules need. The services use
only this API: ``start``/``stop``, ``expect``, ``send``, ``endpoint``, ``address``,
``new_transfer_id`` and ``stats``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

import structlog

from common.config import TransportConfig
from common.errors import ConfigError, Unavailable
from common.transport.device_staging import CopyEngine, DeviceStaging
from common.transport.links import Links
from common.transport.plan import Slots, TransferIdSource
from common.transport.rma_path import RmaPath
from common.transport.shm_path import LocalSegment
from common.transport.shm_transfers import ShmTransfers
from common.transport.staging import STAGING_ALIGN, staged_bytes
from common.transport.transfers import Transfers
from common.transport.ucx import Peer, ReceiveHandle, claim_progress, create_context
from common.transport.ucx_env import WorkerProgress, apply_ucx_env, single_copy_supported

log = structlog.get_logger("common.transport")

# Buffers a stopped transport could not prove idle (a request still pending at stop): ucxx
# requests hold raw pointers, not references, so freeing these could let a late UCX write land
# in reused heap memory. Kept for the life of the process (counted in ``requests_orphaned``).
_ORPHANED: list[Any] = []

# every key of stats(), in order (0 until the part that counts it has started)
_STATS = (
    "bytes_sent", "bytes_received", "messages_sent", "messages_received",
    "transfers_sent_ok", "transfers_sent_failed", "transfers_received_ok",
    "transfers_received_failed", "packed_messages", "packed_bytes", "gathered_bytes",
    "connects", "connect_retries", "accepts", "endpoint_aborts", "single_copy_endpoints",
    "sends_abandoned", "requests_parked", "requests_orphaned", "requests_parked_now",
    "staging_in_use_bytes", "staging_peak_bytes", "staging_capacity_bytes", "endpoints",
    "single_copy_links", "single_copy_endpoints_open", "transfers_active",
    "ucx_options_skipped", "shm_links", "shm_segments_mapped", "shm_transfers_sent",
    "shm_transfers_received", "shm_bytes_sent", "shm_bytes_received", "shm_pieces_copied",
    "shm_transfers_tag_fallback", "shm_commits_dropped", "shm_ready_dropped", "shm_fences",
    "shm_fences_not_settled", "shm_sends_refused", "shm_ready_waiting", "shm_fences_held",
    "device_staged_messages", "device_staged_bytes", "device_copies_in_flight",
    "device_copies_abandoned", "device_staging_in_use_bytes", "device_staging_peak_bytes",
    "device_staging_capacity_bytes")


class PageTransport:
    """UCX page transport of one process (one context/worker for the KV traffic class)."""

    def __init__(self, cfg: TransportConfig, node_id: str, shm_arena: Any = None, *,
                 device_sources: bool = False, copy_engine: CopyEngine | None = None) -> None:
        """``shm_arena``: the arena this transport receives into, when it lies in a
        ``/dev/shm`` segment (``PagePool(shm=True)``): same-host peers then copy pages
        straight into it (``cfg.same_host = "shm"``, docs/datapath.md).
        ``device_sources``: the pages this side sends come from device memory (a pool on
        the GPU), said in the hello so that a device receiver takes them directly rather than
        through pinned staging (:mod:`common.transport.device_staging`); ``copy_engine``: the
        H2D copies of that staging (default cupy's, made on first use; tests inject one)."""
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
        self._device_sources, self._copy_engine = device_sources, copy_engine
        self._ids = TransferIdSource()
        self._lock = asyncio.Lock()
        self._stopped = False    # stop() before start(): the transport never starts
        self._progress: WorkerProgress | None = None
        self._links: Links | None = None
        self._transfers: Transfers | None = None
        self._shm: ShmTransfers | None = None
        self._shm_arena = shm_arena if cfg.same_host == "shm" else None
        # the same arena, registered for RMA (``kv_mode`` rma/auto): peers may put into it
        self._rma_arena = shm_arena if cfg.kv_mode != "tag" else None
        self._n: collections.Counter[str] = collections.Counter()   # requests_orphaned
        self.single_copy_reason = ""
        self.skipped_options: list[str] = []
        self._options: list[str] = []     # the KV lane's UCX option names (once started)

    # ------------------------------------------------------------------ lifecycle

    @property
    def _state(self) -> str:
        if self._links is not None:
            return self._links.state    # running, closing, closed
        return "closed" if self._stopped else "init"

    @property
    def links(self) -> Links:
        """The endpoints of a started transport (for diagnostics and tests)."""
        if self._links is None:
            raise Unavailable(f"page transport of {self.node_id} is {self._state}, not running")
        return self._links

    @property
    def transfers(self) -> Transfers:
        """The transfers of a started transport (for diagnostics and tests)."""
        if self._transfers is None:
            raise Unavailable(f"page transport of {self.node_id} is {self._state}, not running")
        return self._transfers

    async def start(self) -> None:
        """Create the UCX context, the progress driver, the links (listening) and transfers."""
        async with self._lock:
            if self._state != "init":
                return
            cfg, loop = self._cfg, asyncio.get_running_loop()
            env = apply_ucx_env(cfg.shared_memory)
            claim_progress(loop)
            lane = cfg.traffic_classes[cfg.kv_class]
            options = lane.ucx_options()
            ctx, self.skipped_options = create_context(options, cfg.kv_class, lane.require)
            self._options = list(options)
            single, self.single_copy_reason = single_copy_supported(options.get("TLS"))
            progress = WorkerProgress(ctx.worker, loop)
            segment = LocalSegment.of(self._shm_arena)
            if self._shm_arena is not None and segment is None:
                log.info("shm_arena_not_shared", node_id=self.node_id,
                         reason="not in a /dev/shm segment: same-host peers send over UCX")
            nonce = ShmTransfers.new_nonce()
            rma: RmaPath | None = None
            try:
                rma = RmaPath(cfg.kv_mode, ctx.context.handle, self._rma_arena, progress,
                              options.get("TLS"))
                links = Links(cfg, self.node_id, ctx, progress, single_copy=single,
                              segment=segment, shm_nonce=nonce, rma=rma,
                              device_sources=self._device_sources)
                shm = ShmTransfers(links, progress, segment, nonce)
                transfers = Transfers(cfg, links, progress, shm,
                                      DeviceStaging(cfg.staging_bytes, progress.kick,
                                                    self._copy_engine))
                links.listen()
            except BaseException:
                if rma is not None:
                    rma.close()
                progress.close()
                if segment is not None:
                    segment.close()
                raise
            self._progress, self._links, self._transfers = progress, links, transfers
            self._shm = shm
            log.info("transport_started", node_id=self.node_id, host=cfg.host,
                     port=links.address[1], traffic_class=cfg.kv_class, kv_mode=cfg.kv_mode,
                     rma_region_bytes=rma.region.nbytes if rma.region else 0,
                     rma_dma=rma.dma,
                     options=options, skipped=self.skipped_options, env_set=env,
                     single_copy=bool(links.worker_address),
                     single_copy_reason=self.single_copy_reason, same_host=cfg.same_host,
                     shm_segment=segment.name if segment else "")

    async def stop(self) -> None:
        """Stop accepting, cancel transfers, close endpoints, release UCX (idempotent)."""
        async with self._lock:
            links, transfers, progress = self._links, self._transfers, self._progress
            shm = self._shm
            if links is None or transfers is None or progress is None or shm is None \
                    or not links.running:
                self._stopped = True
                return
            links.begin_close("transport stopping")   # before any await: no new link
            transfers.cancel_receives()
            await self._drain(links, transfers, progress, self._cfg.connect_timeout_s)
            self._orphan_unsettled(links, transfers, shm.close())
            links.close()
            progress.close()
            transfers.close()
            log.info("transport_stopped", node_id=self.node_id,
                     **(links.counts + transfers.counts + self._n))

    def _orphan_unsettled(self, links: Links, transfers: Transfers, control: list[Any]) -> None:
        """At stop: keep alive every buffer a request may still write into or read from."""
        parked, unsettled = links.take_parked() + control, transfers.unsettled()
        if parked or unsettled:
            _ORPHANED.append([*parked, *unsettled, transfers.staging_pool])
            self._n["requests_orphaned"] += len(parked) + len(unsettled)
            log.warning("transport_buffers_orphaned", requests=len(parked),
                        transfers=len(unsettled))

    @staticmethod
    async def _drain(links: Links, transfers: Transfers, progress: WorkerProgress,
                     timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while (transfers.in_flight or links.handlers_active) and time.monotonic() < end:
            await asyncio.wait([progress.tick()], timeout=0.01)
        if transfers.in_flight or links.handlers_active:
            log.warning("transport_stop_timed_out", transfers=transfers.in_flight,
                        handlers=links.handlers_active)

    async def __aenter__(self) -> PageTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ the API

    @property
    def address(self) -> Peer:
        """The ``(host, port)`` peers connect to (``cfg.host`` is advertised as is)."""
        return self.links.address

    def new_transfer_id(self) -> int:
        """A transfer id unique on this (receiving) transport; the sender uses it as is."""
        return self._ids.next()

    async def endpoint(self, peer: Peer, deadline_s: float | None = None) -> Any:
        """The ucxx endpoint page messages to ``peer`` travel on (see :meth:`Links.endpoint`)."""
        return await self.links.endpoint(peer, deadline_s)

    async def expect(self, peer: Peer, transfer_id: int, arena: Any,
                     slots: Slots, deadline_s: float) -> ReceiveHandle:
        """Post every receive of ``transfer_id`` from ``peer`` into ``arena`` ``slots`` now
        (see :meth:`Transfers.expect`); ``await handle.wait()`` before reading the arena."""
        return await self.transfers.expect(peer, transfer_id, arena, slots, deadline_s)

    async def send(self, peer: Peer, transfer_id: int, src: Sequence[Any],
                   slots: Slots, deadline_s: float,
                   inflight: int | None = None) -> None:
        """Send the concatenation of ``src`` into the receiver's ``slots`` (its PageSlots);
        returns when every message has left (see :meth:`Transfers.send`)."""
        await self.transfers.send(peer, transfer_id, src, slots, deadline_s, inflight)

    def stats(self) -> dict[str, float]:
        """Counters for metrics (bytes, messages, transfers, staging, endpoints, and which of
        the KV lane's UCX options were applied: ``ucx_option_applied_<NAME>``)."""
        out = dict.fromkeys(_STATS, 0.0)
        if self._links is not None:
            out.update(self._links.stats())
        if self._transfers is not None:
            out.update(self._transfers.stats())
        out["requests_orphaned"] = float(self._n["requests_orphaned"])
        out["ucx_options_skipped"] = float(len(self.skipped_options))
        out["ucx_options_required"] = float(self._cfg.traffic_classes[self._cfg.kv_class].require)
        for name in self._options:     # 1: applied (or set by UCX_<NAME>), 0: UCX rejected it
            out[f"ucx_option_applied_{name}"] = float(name not in self.skipped_options)
        return out
