"""Storage gateway channel: prefix lookups, reads into posted receives, writes, telemetry."""

from __future__ import annotations

from typing import Union

from common.protocol.base import ErrorReply, Message
from common.protocol.connection import GetStats, GetStatsReply, Ping, Pong


# =========================================================================== storage gateway
# Channel of a node's storage gateway (its SNIC). Requesters are the node's PE receiver / DE
# loader (any node in tests), the scheduler (prefix lookups) and operators (stats).

class LookupPrefix(Message, tag="gw.lookup", frozen=True):
    """How many leading blocks of ``keys`` are stored (the request's hit length in blocks)."""

    keys: list[str]


class LookupPrefixReply(Message, tag="gw.lookup.reply", frozen=True):
    hit_blocks: int
    read_q_tokens: int


class ReadBatch(Message, tag="gw.read.batch", frozen=True, array_like=True):
    """One UCX transfer of a read: the next ``n_keys`` Full Blocks into the requester's ``slots``.

    The requester posted the receives before sending ReadBlocks; ``slots`` hold exactly
    ``n_keys`` Full Blocks in key order (scattered per layer if the requester wants).
    Several batches let the gateway pipeline: read batch k+1 while batch k is on the wire.

    ``layer_major``: the batch's byte stream is ordered layer by layer instead — layer 0 of
    every block (key order), then layer 1, ... For a requester whose region is laid out
    ``[L, tokens, B]`` the slots of one layer are then contiguous, so each layer of the batch
    travels as one direct message instead of many small packed ones (the gateway scatters
    while reading from disk, at no cost).
    """

    transfer_id: int
    n_keys: int
    slots: list[tuple[int, int]]
    layer_major: bool = False


class ReadBlocks(Message, tag="gw.read", frozen=True):
    """Read ``keys`` and write them over UCX into the requester's posted receives.

    Every slot is written, found or not: blocks not found (never stored, evicted, corrupt) are
    zero-filled and flagged in the reply, so no receive is ever left dangling; the caller treats
    its hit as the prefix of found blocks and recomputes the rest. If the read fails part-way
    the call ends with its typed error and batches not yet sent are never sent: the requester
    cancels the receives it still has posted (``storage_gateway.client`` does).
    """

    request_id: str
    keys: list[str]
    ucx_host: str
    ucx_port: int
    batches: list[ReadBatch]
    # Same-host shared memory (``common.shm``): when set, ``batches[*].slots`` are offsets in
    # the requester's segment ``/dev/shm/<shm_segment>`` of ``shm_bytes`` and the gateway
    # preads straight into them (no UCX, no receives posted; transfer ids only need to be
    # distinct). A gateway that cannot open the segment answers ``ShmUnavailable``.
    shm_segment: str = ""
    shm_bytes: int = 0


class ShmUnavailable(Message, tag="gw.read.shm_unavailable", frozen=True):
    """Answer to a shared-memory ReadBlocks the gateway cannot serve that way (segment not
    reachable from its host/container, other uid, shm disabled): nothing was read; the
    requester retries over UCX (and stops asking this gateway for shm)."""

    request_id: str
    reason: str


class ShmFence(Message, tag="gw.read.fence", frozen=True):
    """Wait until no shared-memory read ``request_id`` into ``shm_segment`` is running.

    A requester whose shm ReadBlocks failed on its side (deadline, cancelled, connection lost)
    sends this before reusing the slots: the gateway may still have been writing into them.
    """

    shm_segment: str
    request_id: str


class ShmFenceReply(Message, tag="gw.read.fence.reply", frozen=True):
    request_id: str
    waited: int                 # reads that were still running when the fence arrived


class ReadBlocksReply(Message, tag="gw.read.reply", frozen=True):
    request_id: str
    found: list[bool]
    prefix_blocks: int          # leading blocks found: the usable hit
    corrupt: int                # blocks that failed verification (quarantined, not served)
    nbytes: int
    queued_s: float
    read_s: float
    read_q_tokens: int


class WriteBlocks(Message, tag="gw.write", frozen=True):
    """Persist Full Blocks a requester holds; a streaming call.

    The gateway answers with one ``WriteSlots`` event (where to send the blocks it does not
    have yet; it posted those receives), the requester sends them over UCX, and the gateway
    ends with ``BlocksWritten`` once every new block is durable (fsync + rename).
    """

    request_id: str
    keys: list[str]
    ucx_host: str
    ucx_port: int


class WriteSlots(Message, tag="gw.write.slots", frozen=True):
    """Which keys to send (``send[i]``) and the slots of the one transfer carrying them."""

    request_id: str
    send: list[bool]
    transfer_id: int
    slots: list[tuple[int, int]]


class BlocksWritten(Message, tag="gw.write.done", frozen=True):
    request_id: str
    written: int                # new blocks made durable
    duplicates: int             # keys already stored (no-op)
    nbytes: int


class GetLimits(Message, tag="gw.limits", frozen=True):
    """Ask the bounds this gateway enforces on one request (answered with ``GatewayLimits``)."""


class GatewayLimits(Message, tag="gw.limits.reply", frozen=True):
    """What one request may ask of this gateway; a request above any of them is refused with
    INVALID_ARGUMENT, so ``storage_gateway.client`` asks once per connection and splits its
    reads and writes under them (issue #16)."""

    block_bytes: int            # one Full Block (a batch holds whole blocks)
    max_batch_bytes: int        # one ReadBatch, or the new blocks of one WriteBlocks
    max_slots_per_batch: int    # slots of one ReadBatch
    max_keys_per_request: int   # keys of one ReadBlocks / WriteBlocks
    max_bytes_per_request: int  # Full Block bytes of one ReadBlocks / WriteBlocks
    max_frame_bytes: int        # one encoded request (rpc.max_frame_bytes)


class WatchTelemetry(Message, tag="gw.watch", frozen=True):
    """Subscribe to the gateway's telemetry every ``interval_s`` (a streaming call)."""

    interval_s: float = 0.5


class GatewayTelemetry(Message, tag="gw.telemetry", frozen=True):
    node_id: str
    read_q_tokens: int
    bytes_read: int
    bytes_written: int
    blocks_stored: int


GatewayRequest = Union[LookupPrefix, ReadBlocks, WriteBlocks, WatchTelemetry, Ping, GetStats,
                       ShmFence, GetLimits]
GatewayReply = Union[LookupPrefixReply, ReadBlocksReply, WriteSlots, BlocksWritten,
                     GatewayTelemetry, Pong, GetStatsReply, ErrorReply, ShmUnavailable,
                     ShmFenceReply, GatewayLimits]
