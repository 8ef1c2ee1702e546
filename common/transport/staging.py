"""Who gets freed staging next: packed receives wait in FIFO order across transfers.

A receiver posts every receive of a transfer at once (``PageTransport.expect``); packed ones
need a piece of the transport's shared staging pool, and those that find none wait. They
must get staging in the order they started waiting, across transfers, not only within one:
a sender (the gateway) sends its transfers in order through a bounded pipeline
(``gateway_service.pipeline_depth``), so if freed staging went to a *later* transfer, the next
transfer the sender sends would have no receive posted, its rendezvous sends would wait for
one and fill the pipeline, and the later transfers holding the staging would never be sent
— stuck until the deadline (seen with DeepSeek-V3.2 reads: 17 batches of one 2.44 MiB packed
message each through 16 MiB of staging). Strict FIFO: the head waits for room even when a
smaller message behind it would fit.

Pure (no asyncio, no ucxx): the transport passes in the function that posts a receive.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Owner = TypeVar("Owner", bound=Hashable)
Msg = TypeVar("Msg")

STAGING_ALIGN = 4096  # extents of the staging pool (StagingPool's align): one page


def staged_bytes(nbytes: int, align: int = STAGING_ALIGN) -> int:
    """What a message of ``nbytes`` takes from the staging pool (rounded to ``align``)."""
    return -(-max(nbytes, 1) // align) * align


class StagingQueue(Generic[Owner, Msg]):
    """Transfers whose packed receives wait for staging, in the order they began waiting.

    Each owner (a transfer) brings its own deque of waiting messages, kept in its order. A
    failure while posting one of them (UCX refused the receive) belongs to that transfer, not
    to whichever transfer's loop happened to drain: it is kept for the owner to raise
    (:meth:`failure`) and the owner leaves the queue so the others go on.
    """

    def __init__(self) -> None:
        self._waiting: dict[Owner, collections.deque[Msg]] = {}
        self._failed: dict[Owner, Exception] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, owner: object) -> bool:
        return owner in self._waiting

    def defer(self, owner: Owner, waiting: collections.deque[Msg], msg: Msg) -> None:
        """Queue ``msg`` at the end of ``owner``'s ``waiting`` (the owner joins at the end)."""
        waiting.append(msg)
        self._waiting.setdefault(owner, waiting)

    def remove(self, owner: Owner) -> None:
        """``owner`` ended or failed: it gives up its place (its messages are its own)."""
        self._waiting.pop(owner, None)
        self._failed.pop(owner, None)

    def failure(self, owner: Owner) -> Exception | None:
        """The error posting one of ``owner``'s messages raised (once), or None."""
        return self._failed.pop(owner, None)

    def drain(self, post: Callable[[Owner, Msg], bool]) -> int:
        """Post waiting messages from the head on while ``post`` finds staging (returns
        False when it does not); stop at the first that does not fit. Returns how many."""
        posted = 0
        while self._waiting:
            owner, waiting = next(iter(self._waiting.items()))
            try:
                while waiting:
                    if not post(owner, waiting[0]):
                        return posted
                    waiting.popleft()
                    posted += 1
            except Exception as e:  # raised again in the owner's own task (failure())
                self._failed[owner] = e
            del self._waiting[owner]
        return posted
