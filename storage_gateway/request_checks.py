"""Requests checked whole before the gateway touches a file or a buffer (sans-I/O).

A ReadBlocks: key count and bytes against the per-request limits; each batch against
``[gateway_service]`` (bytes, slots, transfer ids, slots summing to its Full Blocks); the
requester's UCX address; for a same-host read, every slot inside the named segment. A bad
request is an ``InvalidArgument`` naming the first problem, never a partial read
(docs/storage.md, "The RPC channel"). Writes check the requester's address the same way
(``check_peer``)."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import InvalidArgument
from common.kv import KVSpec, validate_keys
from common.protocol import ReadBatch, ReadBlocks
from common.shm import valid_name
from common.transport.plan import check_transfer_id, plan_messages
from storage_gateway.config import GatewayServiceConfig


@dataclass
class BatchPlan:
    """One checked batch: which keys it carries and where they land in staging."""

    batch: ReadBatch
    first: int                 # index of its first key in the request
    keys: list[str]
    nbytes: int


def check_read(msg: ReadBlocks, spec: KVSpec, svc: GatewayServiceConfig, max_keys: int,
               max_bytes: int, max_message_bytes: int, pack_below_bytes: int) -> list[BatchPlan]:
    """Validate a ReadBlocks before any I/O; InvalidArgument names the first problem."""
    keys = validate_keys(msg.keys)
    bb = spec.full_block_bytes
    if not keys:
        raise InvalidArgument("ReadBlocks needs at least one key")
    if len(keys) > max_keys or len(keys) * bb > max_bytes:
        raise InvalidArgument(f"read of {len(keys)} blocks ({len(keys) * bb} B) is above the limit "
                              f"of {max_keys} blocks / {max_bytes} B per request — split it")
    check_peer(msg.ucx_host, msg.ucx_port)
    shm = bool(msg.shm_segment)
    if shm and not valid_name(msg.shm_segment):
        raise InvalidArgument(f"shm_segment {msg.shm_segment[:80]!r} is not a dualpath segment name")
    if shm and msg.shm_bytes <= 0:
        raise InvalidArgument(f"shm_bytes must be positive, got {msg.shm_bytes}")
    if sum(b.n_keys for b in msg.batches) != len(keys):
        raise InvalidArgument(f"batches carry {sum(b.n_keys for b in msg.batches)} keys, "
                              f"the request has {len(keys)}")
    plans, first, ids = [], 0, set()
    for j, b in enumerate(msg.batches):
        plans.append(_check_batch(j, b, keys[first:first + b.n_keys], first, bb, svc))
        if shm:                                # every slot inside the segment
            if any(off + n > msg.shm_bytes for off, n in b.slots):
                raise InvalidArgument(f"batch {j}: a slot ends beyond the {msg.shm_bytes} B segment")
        else:
            plan_messages(b.slots, max_message_bytes, pack_below_bytes)  # too many messages → raises
        if b.transfer_id in ids:
            raise InvalidArgument(f"batch {j}: transfer id {b.transfer_id} used twice")
        ids.add(b.transfer_id)
        first += b.n_keys
    return plans


def _check_batch(j: int, b: ReadBatch, keys: list[str], first: int, bb: int,
                 svc: GatewayServiceConfig) -> BatchPlan:
    if b.n_keys <= 0:
        raise InvalidArgument(f"batch {j}: n_keys must be positive, got {b.n_keys}")
    check_transfer_id(b.transfer_id)
    nbytes = b.n_keys * bb
    if nbytes > svc.max_batch_bytes:
        raise InvalidArgument(f"batch {j}: {nbytes} B above gateway_service.max_batch_bytes "
                              f"({svc.max_batch_bytes} B) — use smaller batches")
    if len(b.slots) > svc.max_slots_per_batch:
        raise InvalidArgument(f"batch {j}: {len(b.slots)} slots above the limit of "
                              f"{svc.max_slots_per_batch} — coalesce them or use smaller batches")
    if any(off < 0 or n < 0 for off, n in b.slots):
        raise InvalidArgument(f"batch {j}: slots need non-negative offsets and lengths")
    total = sum(n for _, n in b.slots)
    if total != nbytes:
        raise InvalidArgument(f"batch {j}: slots hold {total} B, {b.n_keys} Full Blocks are "
                              f"{nbytes} B")
    return BatchPlan(b, first, keys, nbytes)


def check_peer(host: str, port: int) -> None:
    """The requester's UCX address, which the gateway will connect to, is well formed."""
    if not host or len(host) > 255 or not 0 < port < 65536:
        raise InvalidArgument(f"requester UCX address {host!r}:{port} is not valid")
