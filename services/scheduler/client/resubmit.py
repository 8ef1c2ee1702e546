"""One request's event stream that survives the loss of its scheduler connection.

``SchedulerClient.submit`` returns a :class:`ResubmittingStream`. When the connection drops
(the scheduler was killed, restarted, or the network broke) or the scheduler says it is shutting
down, the stream reconnects — the RPC client's capped, jittered backoff, shared by every open
stream of the client — and submits the *same* ``SubmitRequest`` again under the same request id,
until ``resubmit_window_s`` has passed since the loss (and never past the request's own
budget). Then:

* the same scheduler still holds the request (a network blip): the resubmission takes over
  its event stream (``scheduler_service.reattach_grace_s``);
* a restarted scheduler finishes it at once if one of its nodes redelivered the result of an
  attempt that finished in the gap, or plans it again.

The frontend sees each request end at most once: one ``FirstToken`` and one final event are
passed on; a repeated ``RequestQueued`` / ``RequestPlaced`` (progress of the new submission)
is passed on as well. Semantics: docs/frontend-api.md, "Scheduler restart".
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable

import structlog

from common.errors import DualpathError, PeerFailed, Unavailable
from common.protocol import FirstToken, RequestEvent, RequestFailed, RequestFinished
from common.rpc import RpcStream

log = structlog.get_logger(__name__)

FINAL = (RequestFinished, RequestFailed)
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 1.0     # between resubmissions; the RPC client's connect backoff comes first
LOST = (PeerFailed, Unavailable)    # the connection (or the scheduler) went away: resubmit


class ResubmittingStream:
    """Async iterator of one request's events across reconnects (see the module docstring)."""

    def __init__(self, open_stream: Callable[[float], RpcStream], request_id: str,
                 budget_s: float, window_s: float,
                 counts: Counter[str] | None = None) -> None:
        self._open = open_stream            # budget seconds -> a fresh stream of the submit
        self.request_id = request_id
        self._budget_s = budget_s
        self._window_s = window_s
        # shared with the client: "resubmits", "duplicate_finals" (a second final event for
        # one request reached this stream: the server broke at-most-once; never passed on)
        self.counts: Counter[str] = counts if counts is not None else Counter()
        self._stream: RpcStream | None = None
        self._until: float | None = None    # end of the whole budget (loop time)
        self._give_up_at: float | None = None   # set while reconnecting: end of the window
        self._first_seen = False
        self._final_seen = False
        self._done = False
        self.resubmits = 0

    def __aiter__(self) -> ResubmittingStream:
        return self

    async def __aenter__(self) -> ResubmittingStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop following (before the end this cancels the request on the scheduler)."""
        self._done = True
        if self._stream is not None:
            await self._stream.aclose()

    async def __anext__(self) -> RequestEvent:
        loop = asyncio.get_running_loop()
        if self._until is None:
            self._until = loop.time() + self._budget_s
        while not self._done:
            if self._stream is None:
                self._stream = self._open(max(self._until - loop.time(), 0.001))
            try:
                async with asyncio.timeout_at(self._give_up_at):   # None: no bound
                    ev = await self._stream.__anext__()
            except TimeoutError:
                self._give_up(Unavailable(f"no scheduler took request {self.request_id!r} "
                                          f"back within {self._window_s}s"))
            except StopAsyncIteration:
                if self._final_seen:
                    break
                await self._lost(PeerFailed("the stream ended without an outcome"))
                continue
            except LOST as e:
                if self._final_seen:        # the outcome is in; the rest does not matter
                    break
                await self._lost(e)
                continue
            if isinstance(ev, RequestFailed) and ev.resubmit and self._window_s > 0 \
                    and not self._final_seen:
                await self._lost(Unavailable(ev.message))   # the scheduler is shutting down
                continue
            self._give_up_at = None         # the scheduler answers again
            if self._pass_on(ev):
                return ev
        self._done = True
        raise StopAsyncIteration

    def _give_up(self, err: DualpathError) -> None:
        self._done = True
        log.warning("resubmit_gave_up", request_id=self.request_id, resubmits=self.resubmits,
                    error=err.message)
        raise err

    def _pass_on(self, ev: RequestEvent) -> bool:
        """At most one FirstToken and one final event reach the frontend."""
        if isinstance(ev, FirstToken):
            if self._first_seen:
                return False
            self._first_seen = True
        elif isinstance(ev, FINAL):
            if self._final_seen:
                self.counts["duplicate_finals"] += 1
                return False
            self._final_seen = True
        return True

    async def _lost(self, err: DualpathError) -> None:
        """Wait (bounded) and resubmit; re-raise ``err`` once the window or budget is spent."""
        loop = asyncio.get_running_loop()
        assert self._until is not None
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None
        if self._give_up_at is None:        # the first loss since the last event
            self._give_up_at = min(loop.time() + self._window_s, self._until)
        delay = random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** self.resubmits))
        if loop.time() + delay >= self._give_up_at:
            self._give_up(err)
        await asyncio.sleep(delay)
        self.resubmits += 1
        self.counts["resubmits"] += 1
        log.info("request_resubmitting", request_id=self.request_id, resubmits=self.resubmits,
                 error=err.message)
