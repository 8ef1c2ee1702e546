"""Whether this scheduler replica serves: its fencing epoch and whether it is shutting down.

Both channels refuse work the same way, so the two facts live in one small object the service
hands to each: with etcd a replica is a standby (epoch 0, every call refused with a hint to
resolve the leader again) until it wins the election, which sets the epoch
(``SchedulerService.epoch``); a stopping scheduler admits nothing new and releases held fetches.
A leader that could not renew its etcd lease for a whole lease is *unconfirmed*: it may have
been deposed, so it refuses every call a standby refuses until etcd confirms the lease again
(``SchedulerService.lease_unconfirmed`` / ``lease_confirmed``, driven by
``SchedulerElection.keep``).
"""

from __future__ import annotations

import msgspec

from common.errors import Unavailable
from common.protocol import FetchWorkReply

STOP_RETRY_AFTER_S = 1.0


class Gate:
    """This replica's fencing epoch (told to nodes at registration; 0 = standby) and closing
    flag."""

    __slots__ = ("node_id", "epoch", "closing", "unconfirmed")

    def __init__(self, node_id: str, epoch: int) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.closing = False
        self.unconfirmed: str | None = None     # why the leader lease is in doubt; None: held

    def check_leading(self) -> None:
        """A standby replica (epoch 0 until it wins the election) serves nobody; neither does a
        leader whose lease etcd has not confirmed for a whole lease."""
        if not self.epoch:
            raise Unavailable(f"scheduler {self.node_id} is a standby, not the leader: resolve "
                              f"the leader again (etcd)", retry_after_s=0.2)
        if self.unconfirmed is not None:
            raise Unavailable(f"scheduler {self.node_id}: leader lease unconfirmed "
                              f"({self.unconfirmed}); serving again once etcd confirms it",
                              retry_after_s=0.2)

    def check_open(self) -> None:
        if self.closing:
            raise Unavailable("the scheduler is shutting down", retry_after_s=STOP_RETRY_AFTER_S)

    def fence(self, reply: FetchWorkReply) -> FetchWorkReply:
        """Stamp the epoch: a node refuses plans from below the highest epoch it has seen."""
        return msgspec.structs.replace(reply, scheduler_epoch=self.epoch)
