"""A private event loop thread that blocking code hands coroutines to (:class:`Portal`).

The blocking clients — the engine API's for vLLM's synchronous connector, the scheduler's for
frontends without an event loop — run their asyncio clients on one of these.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Coroutine
from typing import Any

from common.errors import DeadlineExceeded, PeerFailed

WIND_DOWN_S = 2.0       # how long stop() lets cancelled calls unwind on the loop


class PortalStopped(PeerFailed):
    """The portal a blocking call went through was stopped (its client closed): the call did
    not run, or its answer can no longer come. A PeerFailed: what was behind it is gone."""


class Portal:
    """An event loop in a daemon thread that blocking callers hand coroutines to: the
    bridge of the blocking clients (the engine API's, the scheduler's) over their asyncio ones.

    Not anyio's blocking portal: that one measured ~3x the cost per call of
    ``run_coroutine_threadsafe`` here (0.3-0.5 ms against 0.1 ms on the loaded dev host), and
    a vLLM forward makes two calls per layer.

    Stopping never strands a caller: a call made while or after the portal stops raises
    :class:`PortalStopped`, and so does one whose coroutine the stopped loop will never finish.
    (A plain ``loop.stop()`` drops callbacks handed over as it stops; their callers waited
    forever — seen in CI: a vLLM worker's step failed a session through the attachment another
    thread was closing after the node died, and the instance hung.)
    """

    JOIN_S = 5.0            # how long stop() waits for the loop's thread to end

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._stopping = False
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Run ``coro`` on the loop and wait for it (DeadlineExceeded after ``timeout_s``;
        PortalStopped once the portal stops)."""
        with self._lock:
            if self._stopping:
                coro.close()
                raise PortalStopped(f"{self._thread.name}: closed")
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
            # the caller waits on its own future: stop() can fail it without racing the loop
            answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
            fut.add_done_callback(functools.partial(_relay, answer))
            self._inflight.add(answer)
        try:
            return answer.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise DeadlineExceeded(f"{self._thread.name}: no answer within {timeout_s}s") from None
        except concurrent.futures.CancelledError:      # only stop() cancels on this loop
            raise PortalStopped(f"{self._thread.name}: closed while this call was on its "
                                f"way") from None
        finally:
            with self._lock:
                self._inflight.discard(answer)

    def stop(self) -> None:
        """Cancel what still runs on the loop (its callers get PortalStopped), end the thread."""
        with self._lock:
            self._stopping = True          # no call is handed over from here on
        if not self.loop.is_closed():      # queued before run_forever starts: still obeyed
            asyncio.run_coroutine_threadsafe(self._wind_down(), self.loop)
        self._thread.join(timeout=self.JOIN_S)
        with self._lock:
            stranded = [f for f in self._inflight if not f.done()]
        for fut in stranded:               # the loop is stuck: its callers stop waiting for it
            try:
                fut.set_exception(PortalStopped(f"{self._thread.name}: closed while this call "
                                                f"was on its way"))
            except concurrent.futures.InvalidStateError:
                pass                       # it finished meanwhile
        if not self._thread.is_alive():
            self.loop.close()

    async def _wind_down(self) -> None:
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=WIND_DOWN_S)
        asyncio.get_running_loop().stop()


def _relay(answer: concurrent.futures.Future[Any], done: concurrent.futures.Future[Any]) -> None:
    """``done``'s outcome into ``answer``, unless stop() failed it first."""
    try:
        if done.cancelled():
            answer.cancel()
        elif (error := done.exception()) is not None:
            answer.set_exception(error)
        else:
            answer.set_result(done.result())
    except concurrent.futures.InvalidStateError:
        pass
