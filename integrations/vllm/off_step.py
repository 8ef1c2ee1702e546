"""The worker's work that never runs inside vLLM's step: claims and decode loads.

A claim may wait for the node to have the request — on a decode instance that is the whole
prefill (``claim_timeout_s``); a decode load copies the assembled prompt KV into the paged
cache. Both run on a thread pool, so every other request of the instance keeps stepping
(docs/vllm.md "Asynchronous loads"). Their outcomes are collected here and handed to the
step once per step: claims answered (→ the scheduler half, as worker metadata), loads done or
failed (→ ``get_finished`` / ``failed_recving``).

A request that cannot be opened (a refused cache layout, a claim that failed or timed out,
the request given up by vLLM while its claim waited) is abandoned on the node, which fails
that attempt at once instead of at its deadline; vLLM computes the request without dualpath.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
import torch

from common.errors import Cancelled, DeadlineExceeded, NotFound
from integrations.vllm.counters import ConnectorCounters
from integrations.vllm.decode_session import Post, inline
from integrations.vllm.metadata import AsyncLoad, OpenRequest
from integrations.vllm.sessions import ClaimStopped, KVSource

log = structlog.get_logger(__name__)

# (request, layer, token range, block ids) -> the hit rows copied into the paged cache
CopyHit = Callable[[Any, int, int, int, list[int]], None]


class LayoutRefused(RuntimeError):
    """The instance's cache layout is not verified for dualpath: every request recomputes."""


class Sessions:
    """Request id → open session, shared by the step and the off-step threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Any] = {}

    def get(self, rid: str) -> Any:
        with self._lock:
            return self._by_id.get(rid)

    def put(self, rid: str, session: Any) -> None:
        with self._lock:
            self._by_id[rid] = session

    def pop(self, rid: str) -> Any:
        with self._lock:
            return self._by_id.pop(rid, None)


class OffStep:
    """Claims and decode loads on a thread pool; outcomes drained once per step."""

    def __init__(self, source: KVSource, sessions: Sessions, *, decode: bool,
                 claim_timeout_s: float, num_layers: int, check_layout: Callable[[], None],
                 copy_hit: CopyHit, threads: int, counters: ConnectorCounters,
                 post: Post = inline) -> None:
        self._source, self._sessions, self._decode = source, sessions, decode
        self._counters = counters
        self._claim_timeout_s = claim_timeout_s
        self._num_layers = num_layers
        self._check_layout = check_layout
        self._copy_hit = copy_hit
        self._post = post               # a decode session's notices, off the step
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dualpath-open")
        self._cond = threading.Condition()
        self._pending: set[str] = set()          # claims and loads in flight
        self._given_up: set[str] = set()         # vLLM ended them while in flight
        self._opened: dict[str, int | None] = {}
        self._received: set[str] = set()
        self._failed: set[str] = set()

    # ------------------------------------------------------------------ from the step
    def open(self, op: OpenRequest) -> None:
        with self._cond:
            self._pending.add(op.req_id)
        self._pool.submit(self._open, op)

    def load(self, load: AsyncLoad) -> None:
        with self._cond:
            self._pending.add(load.req_id)
        self._pool.submit(self._load, load)

    def give_up(self, rid: str) -> bool:
        """vLLM ended ``rid``; True when a claim or load of it is in flight (it then ends
        the session itself)."""
        with self._cond:
            if rid in self._pending:
                self._given_up.add(rid)
                return True
            return False

    def drain(self) -> tuple[dict[str, int | None], set[str], set[str]]:
        """Claims answered, loads ended, loads failed (a subset) since the last drain."""
        with self._cond:
            out = (self._opened, self._received, self._failed)
            self._opened, self._received, self._failed = {}, set(), set()
            return out

    def wait_idle(self, timeout_s: float) -> None:
        """A step without a forward: wait (bounded) for an outcome to report, so an instance
        whose requests all wait for their claims does not spin vLLM's empty steps."""
        with self._cond:
            if self._pending and not (self._opened or self._received):
                self._cond.wait(timeout_s)

    def shutdown(self) -> None:
        with self._cond:
            self._given_up |= self._pending
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ off the step
    def _open(self, op: OpenRequest) -> None:
        hit: int | None = None
        try:
            with self._counters.claim_wait():
                session = self._claim(op)
        except Exception as e:  # noqa: BLE001 -- an unusable hit is recomputed, never fatal
            log.warning("dualpath_open_failed", request_id=op.req_id, error=str(e))
            # refused here, the node never handed it within the claim's time, or its answer
            # never came back (the claim may have been handed to us on the way): the node's
            # attempt still waits for this engine — tell it (a node that failed it already
            # answered Cancelled: nothing to tell)
            if isinstance(e, (LayoutRefused, NotFound, ClaimStopped, DeadlineExceeded)):
                self._source.abandon(op.dualpath_id, f"not opened by vLLM: {e}", op.attempt)
        else:
            hit = self._usable_hit(op, session)
        with self._cond:
            self._pending.discard(op.req_id)
            ended = op.req_id in self._given_up
            if ended:
                self._given_up.discard(op.req_id)
                if hit is not None:
                    self._sessions.pop(op.req_id)
            else:
                if hit is None:         # vLLM computes it without dualpath
                    self._counters.add("recompute_fallbacks")
                else:
                    self._counters.hit(session.info.read_side, hit)
                self._opened[op.req_id] = hit
                self._cond.notify_all()
        if ended and hit is not None:   # a round trip: never under the lock the step takes
            session.fail("request ended in vLLM before its first step")

    def _claim(self, op: OpenRequest) -> Any:
        self._check_layout()
        stop = lambda: op.req_id in self._given_up      # noqa: E731 -- read under the GIL
        if self._decode:
            from integrations.vllm.decode_session import DecodeSession

            return DecodeSession(self._source.open_decode(  # type: ignore[attr-defined]
                op.dualpath_id, op.token_ids, self._claim_timeout_s, stop, op.attempt),
                op.token_ids, self._post)
        return self._source.open_prefill(op.dualpath_id, op.token_ids, op.planned_hit,
                                         self._claim_timeout_s, stop, op.attempt)

    def _usable_hit(self, op: OpenRequest, session: Any) -> int | None:
        """The claimed hit vLLM will load, or None (the session failed: recompute). The node
        may have shortened the planned hit (a block it could not read): vLLM loads what the
        node holds, never more."""
        hit = session.hit_tokens
        if not 0 <= hit < len(op.token_ids):
            session.fail(f"claimed hit {hit} outside the prompt of {len(op.token_ids)} tokens")
            return None
        self._sessions.put(op.req_id, session)
        return int(hit)

    def _load(self, load: AsyncLoad) -> None:
        rid = load.req_id
        session = self._sessions.get(rid)
        failed = session is None
        try:
            with torch.inference_mode():      # vLLM's cache tensors are inference tensors
                for layer in range(self._num_layers):
                    if session is None or rid in self._given_up:
                        raise Cancelled(f"request {rid!r} ended in vLLM during its load")
                    self._copy_hit(session, layer, load.start, load.stop, load.block_ids)
            session.loaded()
        except Exception as e:  # noqa: BLE001 -- a failed load is recomputed by vLLM
            failed = True
            self._counters.add("load_errors")
            self._counters.add("recompute_fallbacks")
            log.warning("dualpath_async_load_failed", request_id=rid, error=str(e))
            if (dropped := self._sessions.pop(rid)) is not None:
                dropped.fail(f"load failed: {e}")
        with self._cond:
            self._pending.discard(rid)
            self._given_up.discard(rid)
            self._received.add(rid)
            if failed:
                self._failed.add(rid)
            self._cond.notify_all()


def refuse_unverified(isa: object, verified: tuple[str, ...]) -> None:
    """LayoutRefused unless ``isa`` is one whose in-block KV layout was measured."""
    if isa not in verified:
        raise LayoutRefused(f"vLLM CPU attention ISA {isa!r}: its KV cache layout is not "
                            f"verified for dualpath (verified: {verified})")
