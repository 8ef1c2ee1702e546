"""The endpoint side of the page transport: links to peers, their handshake, the
single-copy endpoints, and the parking of buffers that ucxx requests may still point into.

A layer of :class:`common.transport.PageTransport` (which holds the state, the lifecycle and
the module doc that explains the design); :mod:`common.transport_transfers` builds the
transfers on these links. Only ``common/transport*.py`` and ``common/ucxx_handshake.py``
touch ``ucxx`` (docs/contributing.md, 'Layers').
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import numpy as np
import structlog

from common.config import TransportConfig
from common.errors import DeadlineExceeded, PeerFailed, ProtocolError, Unavailable
from common.transport_plan import (HELLO_BYTES, HELLO_VERSION, StagingPool, TransferHello,
                                   TransferIdSource, check_same_plan, decode_hello,
                                   encode_hello, fit_hello, single_copy_link)
from common.transport_ucx import Link as _Link
from common.transport_ucx import Peer
from common.transport_ucx import Transfer as _Transfer
from common.transport_ucx import claim_progress as _claim_progress
from common.transport_ucx import ucxx as _ucxx
from common.ucx_env import WorkerProgress, process_gone

log = structlog.get_logger("common.transport")

_GONE_CHECKS, _GONE_RECHECK_S = 5, 2.0  # is a failed single-copy peer's process gone?


class LinkTable:
    """Links to peer transports, keyed by their listener address (a PageTransport layer).

    The attributes are set by ``PageTransport.__init__``/``start``; they are declared here so
    every layer is type-checked against the same state.
    """

    _cfg: TransportConfig
    node_id: str
    _ids: TransferIdSource
    _links: dict[Peer, _Link]
    _all_links: set[_Link]
    _connecting: dict[Peer, asyncio.Lock]
    _receiving: dict[int, _Transfer]
    _active: set[_Transfer]
    _handshaking: set[Any]
    _retired: collections.OrderedDict[int, None]
    _state: str
    _ctx: Any
    _listener: Any
    _worker_progress: WorkerProgress | None
    _loop: asyncio.AbstractEventLoop | None
    _staging_pool: StagingPool | None
    _worker_address: bytes
    _host_id: str
    _process_id: str
    _data_eps: dict[bytes, Any]
    _parked: list[tuple[Any, Any]]
    _n: collections.Counter[str]

    @property
    def _progress(self) -> WorkerProgress:
        """The progress driver; set by ``start()`` (kept, closed, after ``stop()``)."""
        if self._worker_progress is None:
            raise RuntimeError(f"page transport of {self.node_id} was never started")
        return self._worker_progress

    @property
    def _staging(self) -> StagingPool:
        """The staging pool of a started transport (released by ``stop()``)."""
        if self._staging_pool is None:
            raise RuntimeError(f"page transport of {self.node_id} is {self._state}: no staging")
        return self._staging_pool

    def _check_running(self) -> None:
        if self._state != "running":
            raise Unavailable(f"page transport of {self.node_id} is {self._state}, not running")

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

    # ------------------------------------------------------------------ endpoints

    async def endpoint(self, peer: Peer, deadline_s: float | None = None) -> Any:
        """The ucxx endpoint page messages to ``peer`` travel on (connecting if needed) — for
        baselines/diagnostics: on a single-copy link the worker-address endpoint (no error
        handling: a dead peer is not reported on it), else the link's own endpoint."""
        self._check_running()
        budget = self._cfg.connect_timeout_s if deadline_s is None else deadline_s
        link = await self._link_to((peer[0], peer[1]), asyncio.get_running_loop().time() + budget)
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
        if self._worker_progress is not None:
            self._worker_progress.kick()

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
