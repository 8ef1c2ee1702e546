"""Long-poll of group leaders' fetches: an idle cluster must not poll every 20 ms.

The paper's engines pull work periodically (§6.1); at ``fetch_interval_s`` = 20 ms that is 50
fetches a second per group leader even when nothing happens (measured: ~2 % of a core per node
service and ~4 % in the scheduler for an idle 1P2D cluster). A fetch from a group whose engines
are all idle and which has nothing to receive is therefore *held*: it waits on a
:class:`WorkSignal` that the scheduler kicks whenever something changes that could give a group
work (a submission, a re-plan, a revocation, a progress report, a registration coming or
going, shutdown), then placement runs again. Busy groups are never held, so their telemetry
stays fresh; a held fetch still ends within its bound, well inside the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from common.protocol import EngineLoad


class WorkSignal:
    """A broadcast "something changed": every waiter wakes on the next :meth:`kick`."""

    __slots__ = ("_gen", "kicks")

    def __init__(self) -> None:
        self._gen: asyncio.Future[None] | None = None
        self.kicks = 0

    def kick(self) -> None:
        self.kicks += 1
        gen, self._gen = self._gen, None
        if gen is not None and not gen.done():
            gen.set_result(None)

    async def wait(self, timeout: float) -> bool:
        """Until the next kick (True) or ``timeout`` seconds (False)."""
        if timeout <= 0:
            return False
        if self._gen is None:
            self._gen = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._gen), timeout)
            return True
        return False


def group_idle(engines: Sequence[EngineLoad]) -> bool:
    """The leader reported every engine without unfinished requests (and reported some)."""
    return bool(engines) and all(e.seq == 0 and e.tok == 0 for e in engines)
