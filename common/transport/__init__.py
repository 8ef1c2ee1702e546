"""UCX page transport: write a byte stream into a peer's registered arena slots.

This package is the only code of dualpath that touches ``ucxx`` (docs/architecture.md). The
receiver posts every receive of a transfer in advance (:meth:`PageTransport.expect`),
straight into its arena (``force_tag`` tag receives); the sender cuts the same
:func:`~common.transport.plan.plan_messages` plan over the receiver's slots and sends each
message with its tag. Completion of the posted receives is the "data arrived" signal: no
per-page control message. The API is "these local ranges into those remote slots", so the
one-sided RMA path (``transport.kv_mode``: the sender puts pages straight into the receiver's
registered arena, then one COMMIT; :mod:`common.transport.rma_path`, docs/datapath.md
"One-sided RMA") uses the same calls.

Same host, one copy (``transport.same_host = "shm"``, the default): when the receiver's arena
lies in a ``/dev/shm`` segment it advertised in its hello and the sender could map it, the
sender copies every page straight into the receiver's slots in a worker thread and one COMMIT
completes the transfer; the receiver's READY (sent by ``expect``) says per transfer whether it
goes that way and with which slots, and a per-transfer file lock (the fence) keeps a sender
from writing into slots a receiver gave up. Only the links' endpoints (error handling on)
carry the two control messages, so a peer that dies mid-copy cannot abort the survivor.
Everything else (old peers, other hosts, private or device arenas) takes the tag path
(:mod:`common.transport.shm_transfers`, docs/datapath.md "Same host: one copy").

Settings (measured, docs/performance.md):

* One UCX context + worker per transport, options from ``cfg.traffic_classes[cfg.kv_class]``;
  options this UCX build cannot apply (``IB_SL`` without verbs) are logged once and skipped,
  or refuse the start when the class has ``require = true`` (docs/qos.md).
* Progress: our own event-driven driver (:class:`~common.transport.ucx_env.WorkerProgress`)
  on the worker's epoll fd. ucxx's ``BlockingMode`` never re-arms the worker after the first
  event, so once a connection exists it spins at 100 % of a core; ours arms after every
  round: 0 % idle.
* Failure: any error, deadline or cancellation part-way through a transfer aborts that
  endpoint (a half-received tag sequence is never reused), waits until every request of the
  transfer has completed (no receive left targeting the caller's buffers) and raises a typed
  error. Other transfers on the same endpoint fail with ``PeerFailed`` (retryable).
* Buffer lifetime: a ucxx request holds a raw pointer to its buffer, never a reference. A
  request that may still complete when we stop waiting for it (a handshake or commit receive
  given up on, a request still pending after ``_SETTLE_S``) keeps its buffer alive, parked
  by :class:`~common.transport.links.Links`, until UCX completed it; whatever is still
  pending at ``stop()`` is kept for the life of the process (``requests_orphaned``). Freed
  earlier, a late write would land in reused heap memory: a crash far from its cause.
* Single copy (same host, UCX's cma; opt-in, and not the one-copy path above): a link is
  the listener/``create_endpoint`` endpoint pair (error handling on: liveness, handshake,
  receives, aborts). Under error handling UCX never picks
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

Objects (composed, none inherits another):

* :class:`PageTransport` (``page_transport``) — the facade the services use: checks the
  config, and at ``start()`` creates the UCX context and the progress driver, then the two
  objects below; owns the lifecycle (``stop()`` in the order the buffer rules need), transfer
  ids and the merged ``stats()``.
* :class:`~common.transport.links.Links` (``links``) — the endpoints: the listener, connect
  and accept with the hello handshake, the link table, the single-copy endpoints, and the
  parked buffers of requests given up on.
* :class:`~common.transport.transfers.Transfers` (``transfers``) — given the ``Links``: posted
  receives and their staging, sends, and what a failure part-way does (abort the link, settle,
  type the error); a transfer on a link whose receiver advertised a segment goes through
* :class:`~common.transport.shm_transfers.ShmTransfers` (``shm_transfers``) — given the
  ``Links`` and the progress driver: the one-copy protocol (READY/COMMIT on one tag, their
  receives kept posted through a link, the copy thread, the fence on give-up). ``Links`` maps
  the peers' segments at link setup; ``shm_path`` holds the parts without UCX or asyncio
  (segments, fence locks, control messages, the copy).

The modules beside them: ``plan`` (pure: message plan, tags, transfer ids,
hello, staging pool), ``staging`` (pure: FIFO order of packed receives), ``device_staging``
(receives into device memory from a host-memory sender: pinned host staging, then one H2D
copy per message on the copy engines; the copies are an injected engine, cupy's by default),
``ucx`` (the lazy
``ucxx`` import, the UCX context, the link/transfer records and :class:`ReceiveHandle`),
``handshake`` (a memory-safe replacement for ucxx's endpoint handshake, installed on first
use), ``ucx_env`` (UCX environment variables and the event-driven progress driver), ``rma``
(ctypes bindings for UCP memory registration, remote keys, put/get/flush on the handles ucxx
exposes) and ``rma_path`` (the registered arena, the peers' keys and a transfer's puts; the
READY/COMMIT around them are ``shm_transfers``').

Tags: ``transfer_id << 20 | message_index`` (:mod:`common.transport.plan`); tag matching is
worker-wide, so transfer ids come from the *receiving* transport
(:meth:`PageTransport.new_transfer_id`).
"""

from common.transport.page_transport import PageTransport
from common.transport.ucx import Peer, ReceiveHandle

__all__ = ["PageTransport", "Peer", "ReceiveHandle"]
