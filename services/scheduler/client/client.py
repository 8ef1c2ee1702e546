"""Frontend client of the scheduler: submit requests, follow their events, cancel, inspect.

Async (what an asyncio frontend embeds)::

    from services.scheduler.client.client import SchedulerClient
    from common.protocol import FirstToken, RequestFailed, RequestFinished

    async with SchedulerClient("127.0.0.1", 7700) as sched:
        async for ev in sched.submit("req-42", session_id="agent-7", prompt_tokens=33_150,
                                     gen_tokens=429, token_ids=prompt, deadline_s=60):
            match ev:
                case FirstToken():
                    print("ttft", ev.ttft_s, "sched/alloc/read/prefill", ev.sched_s,
                          ev.alloc_s, ev.read_s, ev.prefill_s)
                case RequestFinished():
                    print("done", ev.tokens, "tokens, tpot", ev.tpot_s)
                case RequestFailed():
                    print("failed", ev.code, ev.message, "retry" if ev.retryable else "")

        final = await sched.run("req-43", "agent-7", 33_600, 300, token_ids=prompt2)

Synchronous (a thread-based frontend; the client runs its own event loop in a thread)::

    from services.scheduler.client.client import SyncSchedulerClient

    with SyncSchedulerClient("127.0.0.1", 7700) as sched:
        for ev in sched.submit("req-44", "agent-8", 4_096, 64, token_ids=prompt3):
            print(ev)
        print(sched.cluster_status().queues)

Bad input raises a typed ``common.errors`` exception from the first event (InvalidArgument,
AlreadyExists, Overloaded with ``retry_after_s``); outcomes of accepted requests arrive as
events. Leaving the iteration early (``break``, ``aclose()``) cancels the request. A lost
connection (the scheduler killed or restarted) is not an outcome: the stream reconnects and
resubmits the request under the same id for up to ``resubmit_window_s`` (``resubmit``).
Event order and every message: docs/frontend-api.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

from common.config import RpcConfig
from common.errors import DualpathError, error_from_code
from common.portal import Portal
from common.protocol import (CancelRequest, CancelRequestReply, ClusterStatus, FrontendReply,
                             GetClusterStatus, RequestEvent, RequestFailed, RequestFinished,
                             SubmitRequest)
from common.rpc import RpcClient

from .resubmit import ResubmittingStream

STREAM_GRACE_S = 5.0          # the stream outlives the request's own deadline by this much
DEFAULT_STREAM_TIMEOUT_S = 24 * 3600.0   # requests without a deadline
DEFAULT_RESUBMIT_WINDOW_S = 60.0         # how long a lost request looks for a scheduler
FINAL = (RequestFinished, RequestFailed)


def failure_error(event: RequestFailed) -> DualpathError:
    """The typed exception a RequestFailed event stands for (to ``raise`` it)."""
    return error_from_code(event.code, f"request {event.request_id!r}: {event.message}",
                           event.retry_after_s)


class SchedulerClient:
    """Async client of the scheduler's frontend channel (one connection, reconnecting)."""

    def __init__(self, host: str, port: int, *, rpc: RpcConfig | None = None,
                 client_id: str = "frontend", auth_secret: bytes | None = None,
                 stream_timeout_s: float = DEFAULT_STREAM_TIMEOUT_S,
                 resubmit_window_s: float = DEFAULT_RESUBMIT_WINDOW_S,
                 resolve: Callable[[], Awaitable[tuple[str, int]]] | None = None) -> None:
        # resolve: the leader's address before each connection (etcd: election.LeaderResolver)
        self._rpc = RpcClient(rpc or RpcConfig(), host, port, role="frontend", node_id=client_id,
                              reply_type=FrontendReply, event_type=RequestEvent,
                              auth_secret=auth_secret, resolve=resolve)
        self._resolve = resolve
        self._stream_timeout_s = stream_timeout_s
        self._resubmit_window_s = resubmit_window_s     # 0: a lost connection fails the request
        # "resubmits" (requests submitted again after a lost connection), "duplicate_finals"
        self.stream_counts: Counter[str] = Counter()

    @property
    def address(self) -> str:
        return self._rpc.address

    async def connect(self, timeout: float | None = None) -> None:
        """Connect now (otherwise the first call does), retrying up to ``timeout`` seconds."""
        await self._rpc.wait_connected(timeout)

    async def close(self) -> None:
        """Close the connection; the scheduler cancels this client's unfinished requests
        (after ``scheduler_service.reattach_grace_s``)."""
        await self._rpc.close()
        close = getattr(self._resolve, "close", None)
        if close is not None:               # election.LeaderResolver holds an etcd client
            await close()

    async def __aenter__(self) -> SchedulerClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def submit(self, request_id: str, session_id: str, prompt_tokens: int, gen_tokens: int, *,
               block_keys: Sequence[str] = (), token_ids: Sequence[int] | None = None,
               hit_tokens: int | None = None,
               deadline_s: float | None = None) -> ResubmittingStream:
        """Submit one request; iterate the result for its RequestEvents (last: Finished/Failed).

        Give ``token_ids`` (the prompt) or ``block_keys`` (its full blocks' keys) so the
        scheduler can look up the stored prefix, or ``hit_tokens`` when the frontend knows it.
        """
        msg = SubmitRequest(request_id, session_id, prompt_tokens, gen_tokens, list(block_keys),
                            None if token_ids is None else list(token_ids), hit_tokens,
                            deadline_s)
        budget = (self._stream_timeout_s if deadline_s is None
                  else deadline_s + STREAM_GRACE_S)
        return ResubmittingStream(lambda left: self._rpc.stream(msg, timeout=left), request_id,
                                  budget, self._resubmit_window_s, self.stream_counts)

    @property
    def resubmits(self) -> int:
        return self.stream_counts["resubmits"]

    async def run(self, request_id: str, session_id: str, prompt_tokens: int, gen_tokens: int,
                  *, check: bool = False, **kw: Any) -> RequestFinished | RequestFailed:
        """Submit and wait for the final event; ``check=True`` raises a failure instead."""
        final = None
        async with self.submit(request_id, session_id, prompt_tokens, gen_tokens, **kw) as events:
            async for ev in events:
                if isinstance(ev, FINAL):
                    final = ev
        if final is None:
            raise DualpathError(f"request {request_id!r}: the stream ended without an outcome")
        if check and isinstance(final, RequestFailed):
            raise failure_error(final)
        return final

    async def cancel(self, request_id: str, timeout: float | None = None) -> bool:
        """Cancel a live request; False if it had already ended. Unknown ids raise NotFound."""
        reply: CancelRequestReply = await self._rpc.call(CancelRequest(request_id), timeout)
        return reply.cancelled

    async def cluster_status(self, timeout: float | None = None) -> ClusterStatus:
        return await self._rpc.call(GetClusterStatus(), timeout)


class SyncSchedulerClient:
    """Blocking wrapper of :class:`SchedulerClient` for frontends without an event loop.

    Owns a :class:`~common.portal.Portal` (a private event loop thread); every method hands
    its coroutine to it and waits. Thread-safe; ``close()`` (or the ``with`` block) stops the
    thread, and a call on its way or made afterwards raises PortalStopped (a PeerFailed).
    """

    def __init__(self, host: str, port: int, **kw: Any) -> None:
        self._portal = Portal(f"scheduler-client-{host}:{port}")
        self._closed = False
        try:
            self._client = self._call(_build(host, port, kw))
        except BaseException:
            self._portal.stop()
            raise

    def _call(self, coro: Any) -> Any:
        """PortalStopped (a PeerFailed) once closed, also for a call on its way."""
        return self._portal.call(coro)

    def connect(self, timeout: float | None = None) -> None:
        self._call(self._client.connect(timeout))

    def submit(self, request_id: str, session_id: str, prompt_tokens: int, gen_tokens: int,
               **kw: Any) -> Iterator[RequestEvent]:
        """Events of one request as a plain iterator; stopping early cancels the request."""
        stream = self._client.submit(request_id, session_id, prompt_tokens, gen_tokens, **kw)
        try:
            while True:
                ev = self._call(next_event(stream))
                if ev is None:
                    return
                yield ev
        finally:
            if not self._closed:
                self._call(stream.aclose())

    def run(self, request_id: str, session_id: str, prompt_tokens: int, gen_tokens: int,
            **kw: Any) -> RequestFinished | RequestFailed:
        return self._call(self._client.run(request_id, session_id, prompt_tokens, gen_tokens,
                                           **kw))

    def cancel(self, request_id: str, timeout: float | None = None) -> bool:
        return self._call(self._client.cancel(request_id, timeout))

    def cluster_status(self, timeout: float | None = None) -> ClusterStatus:
        return self._call(self._client.cluster_status(timeout))

    def close(self) -> None:
        """Close the connection and stop the loop thread; idempotent."""
        if self._closed:
            return
        try:
            self._call(self._client.close())
        finally:
            self._closed = True
            self._portal.stop()

    def __enter__(self) -> SyncSchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _build(host: str, port: int, kw: dict[str, Any]) -> SchedulerClient:
    return SchedulerClient(host, port, **kw)


async def next_event(stream: AsyncIterator[RequestEvent]) -> RequestEvent | None:
    """One event, or None at the end (StopAsyncIteration must not cross the thread boundary)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
