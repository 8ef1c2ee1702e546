"""The endpoints of one page transport: links to peers, their handshake, the single-copy
endpoints, the peers' shm segments this side copies into, and the parking of buffers that
ucxx requests may still point into.

:class:`Links` owns all of that state. :class:`~common.transport.transfers.Transfers` is given
a ``Links`` and asks it for a usable link to a peer (connecting on first use), the endpoint to
send page messages on, and to abort a link a transfer failed on; the facade
:class:`~common.transport.page_transport.PageTransport` creates both (the package doc explains
the design).
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog

from common.config import TransportConfig
from common.errors import (DeadlineExceeded, InvalidArgument, PeerFailed, ProtocolError,
                           Unavailable)
from common.shm import SHM_DIR, ShmUnavailable
from common.transport.plan import (HELLO_BYTES, HELLO_VERSION, TransferHello, check_same_plan,
                                   decode_hello, encode_hello, fit_hello, rma_link, shm_link,
                                   single_copy_link)
from common.transport.rma_path import RmaPath
from common.transport.shm_path import LocalSegment, PeerSegment, PeerSegments
from common.transport.ucx import Link, Peer, claim_progress, ucxx
from common.transport.ucx_env import (WorkerProgress, local_host_id, local_process_id,
                                      process_gone)

log = structlog.get_logger("common.transport")

_GONE_CHECKS, _GONE_RECHECK_S = 5, 2.0  # is a failed single-copy peer's process gone?


def _link_closed(links_ref: weakref.ref[Links], link_ref: weakref.ref[Link]) -> None:
    """An endpoint's close callback, holding its transport and link only weakly.

    ucxx's ``Endpoint`` has a ``weakref.finalize`` (a global registry) whose arguments hold
    the raw ``UCXEndpoint``, and that holds its close callback: a bound method of the
    transport there made the ``Endpoint`` reachable from the registry through its own link,
    so it was never collected and never closed — nor the worker, context and page pools
    behind the transport (every in-process cluster that moved a page leaked its arenas:
    10 GB of /dev/shm mappings by the end of the suite)."""
    links, link = links_ref(), link_ref()
    if links is not None and link is not None:
        links._on_link_closed(link)


class Links:
    """Links to peer transports, keyed by their listener address, over one UCX context.

    Made by a starting transport from its UCX context and progress driver; :meth:`listen`
    accepts peers, :meth:`begin_close` then :meth:`close` end it (``state``: running →
    closing → closed). The transfers of the transport read ``running`` to know whether a
    failure is the transport stopping.
    """

    def __init__(self, cfg: TransportConfig, node_id: str, ctx: Any, progress: WorkerProgress,
                 single_copy: bool, segment: LocalSegment | None = None,
                 shm_nonce: int = 0, rma: RmaPath | None = None,
                 device_sources: bool = False) -> None:
        self.node_id = node_id
        self.device_sources = device_sources     # said in our hello (device_staging)
        self.state = "running"
        # our worker's address, sent in the hello when single copy is allowed here (else b"")
        self.worker_address = bytes(ctx.worker.address.tobytes()) if single_copy else b""
        self.counts: collections.Counter[str] = collections.Counter()
        self._cfg, self._ctx, self._progress = cfg, ctx, progress
        self._loop = asyncio.get_running_loop()
        self._host_id = local_host_id()
        # the one-copy path: whether we speak it, the segment we receive into, our name
        self._shm, self._segment, self._shm_nonce = cfg.same_host == "shm", segment, shm_nonce
        self._peer_segments = PeerSegments(SHM_DIR)          # the peers' we send into
        self.rma = rma                                       # the RMA path (None: tag only)
        self.down_hooks: list[Callable[[Link], None]] = []  # a link went down (shm waits)
        self.up_hooks: list[Callable[[], None]] = []         # a link registered (shm control)
        self._process_id = local_process_id()
        self._listener: Any = None
        self._links: dict[Peer, Link] = {}
        self._all_links: set[Link] = set()
        self._connecting: dict[Peer, asyncio.Lock] = {}
        self._handshaking: set[Any] = set()
        self._data_eps: dict[bytes, Any] = {}    # peer worker address -> endpoint (single copy)
        self._parked: list[tuple[Any, Any]] = []  # (request, buffers it points into): park()

    # ------------------------------------------------------------------ lifecycle

    def listen(self) -> None:
        """Accept peers on ``cfg.port`` (0: any free port)."""
        claim_progress(self._loop)
        self._listener = self._ctx.create_listener(
            self._on_accept, port=self._cfg.port, endpoint_error_handling=True,
            connect_timeout=self._cfg.connect_timeout_s)

    @property
    def running(self) -> bool:
        return self.state == "running"

    def check_running(self) -> None:
        if self.state != "running":
            raise Unavailable(f"page transport of {self.node_id} is {self.state}, not running")

    @property
    def address(self) -> Peer:
        """The ``(host, port)`` peers connect to (``cfg.host`` is advertised as is)."""
        self.check_running()
        return (self._cfg.host, int(self._listener.port))

    @property
    def handlers_active(self) -> int:
        """Accept handlers (handshakes) the listener still runs."""
        return int(self._listener.active_clients) if self._listener is not None else 0

    def begin_close(self, reason: str) -> None:
        """Stop registering links and abort every link and handshake (receives on them fail)."""
        self.state = "closing"
        for link in list(self._all_links):
            self.abort(link, reason)
        for ep in list(self._handshaking):
            ep.abort()

    def close(self) -> None:
        """Abort every endpoint (their close callbacks removed first: nothing of this
        transport runs after it closed), close the listener and let go of the context."""
        for link in self._all_links | set(self._links.values()):
            if link.ep._ep is not None:
                link.ep._ep.remove_close_callback()
                link.ep.abort()
        for ep in self._data_eps.values():
            ep.abort()
        self._data_eps.clear()
        self._peer_segments.close()
        if self.rma is not None:     # the keys and the registration before the context goes
            self.rma.close()
        if self._listener is not None:
            self._listener.close()
        self._listener = self._ctx = None
        self.worker_address = b""
        self._links.clear()
        self._all_links.clear()
        self.state = "closed"

    def progress_now(self) -> bool:
        """Progress the worker once, outside the driver; False once the context is released."""
        if self._ctx is None:
            return False
        self._ctx.worker.progress()
        return True

    # ------------------------------------------------------------------ parked buffers

    def park(self, req: Any, keep: Any) -> None:
        """ucxx requests hold raw pointers, never references: a request that may still
        complete keeps the buffers it points into alive (here) until it has completed."""
        if req is not None and not req.completed:
            self._prune_parked()
            self._parked.append((req, keep))
            self.counts["requests_parked"] += 1

    def _prune_parked(self) -> None:
        if self._parked:
            self._parked = [(r, k) for r, k in self._parked if not r.completed]

    def take_parked(self) -> list[Any]:
        """At stop: hand over what still-pending requests point into (the caller keeps it)."""
        self._prune_parked()
        keep, self._parked = [k for _, k in self._parked], []
        return keep

    # ------------------------------------------------------------------ endpoints

    async def endpoint(self, peer: Peer, deadline_s: float | None = None) -> Any:
        """The ucxx endpoint page messages to ``peer`` travel on (connecting if needed) — for
        baselines/diagnostics: on a single-copy link the worker-address endpoint (no error
        handling: a dead peer is not reported on it), else the link's own endpoint."""
        self.check_running()
        budget = self._cfg.connect_timeout_s if deadline_s is None else deadline_s
        link = await self.link_to((peer[0], peer[1]), asyncio.get_running_loop().time() + budget)
        return await self.data_ep(link)

    async def link_to(self, peer: Peer, deadline_at: float) -> Link:
        """A usable link to ``peer``, connecting (once, whoever asks) if there is none."""
        link = self._links.get(peer)
        if link is not None and link.usable:
            return link
        async with self._connecting.setdefault(peer, asyncio.Lock()):
            link = self._links.get(peer)
            if link is not None and link.usable:
                return link
            while True:
                try:
                    return await self._connect(peer, deadline_at)
                except Unavailable as e:
                    # a handshake that ran out of connect_timeout_s (a peer or this host
                    # starved of CPU: ci103, ci106) is tried again while the caller's deadline
                    # allows; a refused one (nothing listens) fails at once
                    if not isinstance(e.__cause__, TimeoutError):
                        raise
                    self.counts["connect_retries"] += 1
                    log.info("page_transport_connect_retry", peer=f"{peer[0]}:{peer[1]}",
                             retries=self.counts["connect_retries"])

    async def _connect(self, peer: Peer, deadline_at: float) -> Link:
        u, loop, cfg = ucxx(), asyncio.get_running_loop(), self._cfg
        budget = min(cfg.connect_timeout_s, deadline_at - loop.time())
        if budget <= 0:
            raise DeadlineExceeded(f"deadline passed before connecting to {peer}")
        ep = None
        try:
            with self._progress.busy():
                async with asyncio.timeout(budget):
                    claim_progress(loop)
                    ep = await self._ctx.create_endpoint(
                        peer[0], peer[1], endpoint_error_handling=True, connect_timeout=budget)
                    await self._send_hello(ep)
                    hello = await self._recv_hello(ep)
                    self._check_hello(hello)
                    out, shm_in, _ = await self._shm_handshake(ep, hello, answer_now=True)
        except (TimeoutError, ProtocolError, u.Error, OSError, RuntimeError) as e:
            if ep is not None:
                ep.abort()
            self._prune_segments()
            if isinstance(e, ProtocolError):
                raise
            if loop.time() >= deadline_at:
                raise DeadlineExceeded(f"deadline passed while connecting to {peer}") from e
            raise Unavailable(f"cannot connect to page transport {peer[0]}:{peer[1]} "
                              f"({type(e).__name__}: {e}) — is the peer started?") from e
        self.counts["connects"] += 1
        link = self._register(self._new_link(peer, ep, hello, out, shm_in))
        await self._open_data_ep(link)
        return link

    async def _on_accept(self, ep: Any) -> None:
        if self.state != "running":
            ep.abort()
            return
        self._handshaking.add(ep)
        try:
            with self._progress.busy():
                async with asyncio.timeout(self._cfg.connect_timeout_s):
                    hello = await self._recv_hello(ep)
                    await self._send_hello(ep)  # ours first: the client reports a mismatch
                    self._check_hello(hello)
                    out, shm_in, answer = await self._shm_handshake(ep, hello, answer_now=False)
            link = self._register(self._new_link((hello.host, hello.port), ep, hello, out,
                                                 shm_in))
            if answer is not None:  # only now: the connecting side is done when it has it, and
                await self._send_shm_answer(ep, answer)  # may send at once, on this link
            await self._open_data_ep(link)
            self.counts["accepts"] += 1
        except (TimeoutError, ProtocolError, Unavailable, ucxx().Error) as e:
            log.warning("peer_handshake_failed", error=repr(e))
            ep.abort()
            self._prune_segments()
        finally:
            self._handshaking.discard(ep)

    def _new_link(self, addr: Peer, ep: Any, hello: TransferHello,
                  shm_out: PeerSegment | None = None, shm_in: bool = False) -> Link:
        single = single_copy_link(self._hello(), hello)
        if shm_out is not None and shm_out.closing:  # let go while this handshake ran
            shm_out = self._map_peer(hello)
        link = Link(addr, ep, hello.node_id, single_copy=single,
                    peer_worker_address=hello.worker_address if single else b"",
                    peer_process=hello.process, shm_out=shm_out, shm_in=shm_in,
                    peer_nonce=hello.shm_nonce, peer_device=hello.device_sources)
        mine = self._hello()
        if self.rma is not None and rma_link(mine, hello):
            link.rma_in = bool(mine.rma_rkey)
            link.rma_peer = bool(hello.rma_rkey)
            if hello.rma_rkey:     # after both hellos: the endpoint's wire-up is done
                link.rma_out = self.rma.unpack(link, hello.rma_rkey, hello.rma_base,
                                               hello.rma_bytes)
        return link

    async def _shm_handshake(self, ep: Any, hello: TransferHello, answer_now: bool
                             ) -> tuple[PeerSegment | None, bool, np.ndarray | None]:
        """(the peer's segment mapped here, whether the peer mapped ours, our answer if not
        sent yet): each side maps the other's advertised segment and says whether it could,
        so both know per direction whether pages may come by copy. Only between peers that
        both speak it (an old peer or one with ``same_host = "ucx"`` sends no answer, and
        none is awaited). The connecting side answers first; the accepting side answers
        after it registered the link (:meth:`_send_shm_answer`)."""
        if not shm_link(self._hello(), hello):
            return None, False, None
        out = self._map_peer(hello) if hello.shm_segment else None
        u = ucxx()
        mine = np.array([1 if out is not None else 0], np.uint64).view(np.uint8)
        theirs = np.zeros(8, np.uint8)
        if answer_now:
            await self._send_shm_answer(ep, mine)
        await self._wait_one(ep._ep.tag_recv(u.Array(theirs), u.Tag(ep._tags["msg_recv"]),
                                             u.Mask), theirs)
        shm_in = bool(theirs.view(np.uint64)[0]) and self._segment is not None
        return out, shm_in, None if answer_now else mine

    async def _send_shm_answer(self, ep: Any, mine: np.ndarray) -> None:
        u = ucxx()
        await self._wait_one(ep._ep.tag_send(u.Array(mine), u.Tag(ep._tags["msg_send"])), mine)

    def _map_peer(self, hello: TransferHello) -> PeerSegment | None:
        try:
            return self._peer_segments.map(hello.shm_segment, hello.shm_bytes)
        except (ShmUnavailable, InvalidArgument, OSError) as e:  # e.g. another /dev/shm
            log.info("shm_peer_segment_unavailable", peer=hello.node_id, error=str(e))
            return None

    def _prune_segments(self) -> None:
        """Unmap the peers' segments no usable link sends into (a link went down, or a
        handshake that mapped one failed)."""
        self._peer_segments.keep_only({link.shm_out.name for link in self._all_links
                                       if link.usable and link.shm_out is not None})

    def _link_down(self, link: Link) -> None:
        for hook in self.down_hooks:
            hook(link)
        if self.rma is not None:
            self.rma.forget(link)
        self._prune_segments()

    async def _open_data_ep(self, link: Link) -> None:
        """Make the single-copy endpoint to the link's peer worker now (see the package doc)."""
        if not link.single_copy or link.peer_worker_address in self._data_eps:
            return
        u = ucxx()
        claim_progress(asyncio.get_running_loop())
        try:
            ep = await self._ctx.create_endpoint_from_worker_address(
                u.lib.UCXAddress.create_from_buffer(link.peer_worker_address),
                endpoint_error_handling=False)
        except Exception as e:  # a bad address, a UCX refusal: data then goes over link.ep
            log.warning("single_copy_endpoint_failed", peer=link.addr, error=repr(e))
            return
        if self.state != "running" or link.peer_worker_address in self._data_eps:
            ep.abort()
            return
        self._data_eps[link.peer_worker_address] = ep
        self.counts["single_copy_endpoints"] += 1

    async def data_ep(self, link: Link) -> Any:
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

    def _forget_if_gone(self, link: Link, checks_left: int = _GONE_CHECKS) -> None:
        """Close the single-copy endpoint of a failed link's peer once its process has ended
        (a process that just closed its endpoints may still be exiting: look again later)."""
        addr = link.peer_worker_address
        if not link.single_copy or addr not in self._data_eps or self.state != "running":
            return
        if any(other.usable and other.peer_worker_address == addr for other in self._all_links):
            return  # the peer is connected again: it is alive
        if process_gone(link.peer_process):
            self._data_eps.pop(addr).abort()
        elif checks_left > 1:
            self._loop.call_later(_GONE_RECHECK_S, self._forget_if_gone, link, checks_left - 1)

    def _register(self, link: Link) -> Link:
        """Make a handshaken link the one to its peer. Its endpoint may have closed since the
        handshake (the peer died just then: ci134, a DE loader killed as the PE connected to
        it): ucxx then refuses the close callback with a bare RuntimeError, which used to
        escape the caller's typed handling and leave its request to its deadline; it is
        ``Unavailable`` now, like any connect to a peer that is gone, and no link is kept."""
        if self.state != "running":
            link.ep.abort()
            raise Unavailable(f"page transport of {self.node_id} is stopping")
        try:
            link.ep.set_close_callback(_link_closed,
                                       cb_args=(weakref.ref(self), weakref.ref(link)))
        except RuntimeError as e:         # "Endpoint is closing or has already closed."
            self.abort(link, f"endpoint closed during the handshake: {e}")
            raise Unavailable(f"page transport {link.addr[0]}:{link.addr[1]} closed its "
                              f"endpoint during the handshake ({e}) — the peer failed or "
                              f"left") from e
        self._all_links.add(link)
        current = self._links.get(link.addr)
        if current is None or not current.usable:
            self._links[link.addr] = link
        log.debug("endpoint_registered", peer=link.addr, node_id=link.node_id,
                  send_path="shm" if link.shm_out else "tag",
                  receive_path="shm" if link.shm_in else "tag")
        for hook in self.up_hooks:
            hook()
        return link

    def paths(self) -> list[dict[str, Any]]:
        """Per usable link: the peer and how pages go each way (``shm``, ``rma`` or ``tag``;
        an arena outside the segment or the registered region takes the next one)."""
        return [{"peer": f"{link.addr[0]}:{link.addr[1]}", "node_id": link.node_id,
                 "send": "shm" if link.shm_out else "rma" if link.rma_out else "tag",
                 "receive": "shm" if link.shm_in else "rma" if link.rma_in else "tag",
                 "single_copy": link.single_copy, "peer_device": link.peer_device}
                for link in self._all_links if link.usable]

    def usable_link(self) -> Link | None:
        """Any usable link (the shm control receives are posted through one: see
        ``ShmTransfers``), or None."""
        return next((link for link in self._all_links if link.usable), None)

    def _on_link_closed(self, link: Link) -> None:
        if link.failure is None:
            link.failure = "endpoint closed (peer failed or left)"
        if self._links.get(link.addr) is link:
            del self._links[link.addr]
        if link.single_copy:  # not inside UCX's callback
            self._loop.call_soon_threadsafe(self._forget_if_gone, link)
        self._loop.call_soon_threadsafe(self._link_down, link)
        self._progress.kick()

    def abort(self, link: Link, reason: str) -> None:
        """Abort ``link``'s endpoint: UCX cancels every request posted on it (a half-received
        tag sequence is never reused); the next transfer to that peer connects afresh."""
        if link.failure is None:
            link.failure = reason
        if self._links.get(link.addr) is link:
            del self._links[link.addr]
        self._all_links.discard(link)
        self._forget_if_gone(link)
        self._link_down(link)
        if link.ep._ep is not None:
            self.counts["endpoint_aborts"] += 1
            log.info("endpoint_aborted", peer=link.addr, reason=reason)
            link.ep.abort()

    # ------------------------------------------------------------------ handshake

    def _hello(self) -> TransferHello:
        cfg = self._cfg
        seg = self._segment
        return fit_hello(TransferHello(HELLO_VERSION, self.node_id, cfg.host,
                                       int(self._listener.port), cfg.max_message_bytes,
                                       cfg.pack_below_bytes, self.worker_address,
                                       self._host_id, self._process_id, self._shm,
                                       seg.name if seg else "", seg.nbytes if seg else 0,
                                       self._shm_nonce,
                                       **(self.rma.hello_fields() if self.rma else {}),
                                       device_sources=self.device_sources))

    async def _send_hello(self, ep: Any) -> None:
        u, buf = ucxx(), encode_hello(self._hello())
        await self._wait_one(ep._ep.tag_send(u.Array(buf), u.Tag(ep._tags["msg_send"])), buf)

    async def _recv_hello(self, ep: Any) -> TransferHello:
        u, buf = ucxx(), np.zeros(HELLO_BYTES, dtype=np.uint8)
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
            self.park(req, buf)
        req.check_error()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, float]:
        """Counters and gauges of the endpoint side (part of ``PageTransport.stats``)."""
        out = {k: float(self.counts.get(k, 0)) for k in (
            "connects", "connect_retries", "accepts", "endpoint_aborts", "single_copy_endpoints",
            "requests_parked")}
        out["requests_parked_now"] = float(len(self._parked))
        out["endpoints"] = float(sum(1 for link in self._all_links if link.usable))
        out["single_copy_links"] = float(sum(1 for link in self._all_links
                                             if link.usable and link.single_copy))
        out["single_copy_endpoints_open"] = float(len(self._data_eps))
        out["shm_links"] = float(sum(1 for link in self._all_links
                                     if link.usable and (link.shm_out or link.shm_in)))
        out["shm_segments_mapped"] = float(len(self._peer_segments))
        out["rma_links"] = float(sum(1 for link in self._all_links
                                     if link.usable and (link.rma_out or link.rma_in)))
        if self.rma is not None:
            out.update(self.rma.stats())
        return out
