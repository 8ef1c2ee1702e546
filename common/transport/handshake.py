"""A memory-safe replacement for ucxx's endpoint peer-info exchange (ucxx 0.52).

Why: ucxx's ``exchange_peer_info`` (run by ``create_endpoint`` and by the listener for every
new endpoint) posts a UCX stream receive into a 16-byte ``bytearray`` and awaits it under
``asyncio.wait_for``. When that wait times out or its task is cancelled — a request whose
deadline is nearly spent connects to a peer, a peer paused past the connect timeout — the
bytearray is freed while the receive is still posted, because a ucxx request holds a raw
pointer, never a reference. When the peer's 16 bytes arrive, UCX writes them into freed
pymalloc memory and the process crashes later somewhere unrelated (``pymalloc_alloc`` under
the fuzz tests; ``tests/test_transport.py`` reproduces it with connects on tiny budgets).

A second defect, found by a CI run: an endpoint whose connect fails before the exchange posts
its receive (nothing listens on that port any more: the peer died) never completes that
receive, so the exchange waited out the whole connect timeout and a send to a dead peer came
back as ``DeadlineExceeded`` after 5 s instead of ``Unavailable`` at once (failing late, the
receive completes with an error). This version looks at the endpoint's ``alive`` flag before
it posts anything and fails at once when UCX already reported the endpoint dead (nothing is
then posted, so nothing is left pending).

This version puts the same bytes on the wire in the same order (two unsigned 64-bit words: the
tag and its hash), so it interoperates with unpatched peers. On any failure it closes the UCX
endpoint (which cancels what it posted) and keeps both buffers alive in :data:`_PENDING` until
every request it posted has completed. :func:`install` swaps it into ucxx's two call sites; it
refuses (and says so) when ucxx's function no longer has the signature this was written for.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import struct
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger(__name__)

_FMT = "QQ"
_SIGNATURE = ["endpoint", "msg_tag", "listener", "connect_timeout"]
_CLOSE_NS = 100_000_000          # bound on closing a failed endpoint (cancels its requests)
# (requests, what they point into) of exchanges that failed before their requests completed
_PENDING: list[tuple[list[Any], tuple[Any, ...]]] = []


def pending() -> int:
    """Failed exchanges whose buffers are still held (their requests have not completed)."""
    prune()
    return len(_PENDING)


def prune() -> None:
    _PENDING[:] = [(reqs, keep) for reqs, keep in _PENDING
                   if not all(r.completed for r in reqs)]


_POLL_FIRST_S, _POLL_MAX_S = 0.0002, 0.005


async def until_complete(req: Any) -> None:
    """Wait for a ucxx request without spinning, then raise its error if it failed.

    ucxx's ``Request.wait()`` (without its notifier thread) loops on ``asyncio.sleep(0)``:
    100 % of a core for as long as a handshake waits — measured 1.16 s of CPU in a 3-s connect
    to a stopped peer, on a loaded 2-core host. Beside the real-engine tests that spin took CPU
    from the very peer being waited for (the project's CI on 3c62e6f: a handshake that
    outlasted its connect timeout again and again for 20 s). The worker is progressed by the
    transport's own driver (its fd and timers: common.transport.ucx_env.WorkerProgress); this
    only looks at the request, 0.2 ms after it was posted, then ever less often, at most 5 ms
    apart — where the driver's timer ticks during a connect anyway."""
    pause = _POLL_FIRST_S
    while not req.completed:
        await asyncio.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    req.check_error()


async def exchange_peer_info(endpoint: Any, msg_tag: int, listener: bool,
                             connect_timeout: float = 5.0) -> dict[str, int]:
    """ucxx's exchange, with buffers that outlive every request posted into them."""
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits

    mine = np.frombuffer(struct.pack(_FMT, msg_tag, hash64bits(msg_tag)), np.uint8).copy()
    theirs = np.zeros(mine.nbytes, np.uint8)
    posted: list[Any] = []

    async def step(post: Any) -> None:
        # UCX reports an endpoint dead only inside worker progress, which runs on this thread:
        # nothing can change between this check and the post (module doc)
        if not getattr(endpoint, "alive", True):
            raise ConnectionRefusedError("the endpoint failed before the peers exchanged "
                                         "their info (nothing listens there, or it died)")
        req = post()
        posted.append(req)
        async with asyncio.timeout(connect_timeout):
            await until_complete(req)

    try:
        if listener:
            await step(lambda: endpoint.stream_send(Array(mine)))
            await step(lambda: endpoint.stream_recv(Array(theirs)))
        else:
            await step(lambda: endpoint.stream_recv(Array(theirs)))
            await step(lambda: endpoint.stream_send(Array(mine)))
    except BaseException:
        prune()
        if not all(r.completed for r in posted):
            _PENDING.append((posted, (mine, theirs, endpoint)))
            with contextlib.suppress(Exception):
                endpoint.close_blocking(period=_CLOSE_NS, max_attempts=1)
        raise
    tag, checksum = struct.unpack(_FMT, theirs.tobytes())
    if hash64bits(tag) != checksum:
        raise RuntimeError(f"Checksum invalid! {hex(hash64bits(tag))} != {hex(checksum)}")
    return {"msg_tag": tag, "checksum": checksum}


def install() -> bool:
    """Replace ``exchange_peer_info`` where ucxx's endpoint creation calls it; False (and a
    warning) when this ucxx's function differs from the one this replacement mirrors."""
    import ucxx._lib_async.application_context as app
    import ucxx._lib_async.listener as listener

    done = True
    for mod in (app, listener):
        current = getattr(mod, "exchange_peer_info", None)
        if current is exchange_peer_info:
            continue
        if current is None or list(inspect.signature(current).parameters) != _SIGNATURE:
            log.warning("ucxx_handshake_not_patched", module=mod.__name__,
                        reason="exchange_peer_info changed in this ucxx: check whether its "
                               "buffers still die before their requests "
                               "(common/transport/handshake.py)")
            done = False
            continue
        mod.exchange_peer_info = exchange_peer_info
    return done
