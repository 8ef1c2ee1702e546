"""Whether this scheduler replica serves: its fencing epoch and whether it is shutting down.

Both channels refuse work the same way, so the two facts live in one small object the service
hands to each: with etcd a replica is a standby (epoch 0, every call refused with a hint to
resolve the leader again) until it wins the election, which sets the epoch
(``SchedulerService.epoch``); a stopping scheduler admits nothing new and releases held fetches.
"""

from __future__ import annotations

import msgspec

from common.errors import Unavailable
from common.protocol import FetchWorkReply

STOP_RETRY_AFTER_S = 1.0


class Gate:
    """This replica's fencing epoch (told to nodes at registration; 0 = standby) and closing
    flag."""

    __slots__ = ("node_id", "epoch", "closing")

    def __init__(self, node_id: str, epoch: int) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.closing = False

    def check_leading(self) -> None:
        """A standby replica (epoch 0 until it wins the election) serves nobody."""
        if not self.epoch:
            raise Unavailable(f"scheduler {self.node_id} is a standby, not the leader: resolve "
                              f"the leader again (etcd)", retry_after_s=0.2)

    def check_open(self) -> None:
        if self.closing:
            raise Unavailable("the scheduler is shutting down", retry_after_s=STOP_RETRY_AFTER_S)

    def fence(self, reply: FetchWorkReply) -> FetchWorkReply:
        """Stamp the epoch: a node refuses plans from below the highest epoch it has seen."""
        return msgspec.structs.replace(reply, scheduler_epoch=self.epoch)
