"""Pure parts of the page transport: message planning, tag layout, transfer ids, staging.

Nothing here imports asyncio or ucxx (docs/contributing.md, 'Sans-I/O cores'), so the logic that
both sides of a transfer must agree on is unit-tested in milliseconds and reusable by a simulator.

A *transfer* moves one byte stream into the receiver's registered arena. The receiver
describes where the stream goes as ``slots``: ``(offset, nbytes)`` runs in its arena, stream
order = slot order. :func:`plan_messages` turns the slots into UCX messages; both sides run it
on the same slots (the receiver's, sent in a ``PageSlots`` message) with the same limits, so
they agree on message sizes and tags without any per-page control traffic.
"""

from __future__ import annotations

import bisect
import itertools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from common.buffers import is_device_array
from common.errors import InvalidArgument, ProtocolError

# A receiver's slots: (offset, nbytes) pairs in stream order, or those pairs as an [n, 2]
# int64 array (:func:`slot_array`: what a transfer converts them to once and passes on).
Slots = Sequence[tuple[int, int]] | np.ndarray

# Tag layout (64-bit UCX tag): ``transfer_id << INDEX_BITS | message_index``.
# 20 index bits allow 1,048,575 messages per transfer (4 GiB even at 4 KiB messages);
# the remaining 44 bits hold the transfer id: 20 random epoch bits + 24 counter bits.
# The last index (never a message's: indices stop at MAX_MESSAGES - 1) tags the transfer's
# *commit*, the sender's "every message was taken" note on single-copy links.
INDEX_BITS = 20
TRANSFER_ID_BITS = 64 - INDEX_BITS
MAX_MESSAGES = (1 << INDEX_BITS) - 1
COMMIT_INDEX = MAX_MESSAGES
COMMIT_BYTES = 8
MAX_TRANSFER_ID = (1 << TRANSFER_ID_BITS) - 1
EPOCH_BITS = 20
COUNTER_BITS = TRANSFER_ID_BITS - EPOCH_BITS


@dataclass(frozen=True, slots=True)
class MessagePlan:
    """One UCX message of a transfer.

    ``stream_offset``/``nbytes``: the transfer stream bytes it carries. ``pieces``: the
    receiver-arena ``(offset, nbytes)`` runs those bytes land in, in stream order. One piece
    = a *direct* message received straight into the arena; several = a *packed* message
    received into staging and scattered.
    """

    index: int
    stream_offset: int
    nbytes: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def packed(self) -> bool:
        return len(self.pieces) > 1

    @property
    def stream_end(self) -> int:
        return self.stream_offset + self.nbytes


def plan_messages(slots: Slots, max_message_bytes: int,
                  pack_below_bytes: int) -> list[MessagePlan]:
    """Cut the receiver's ``slots`` into messages (deterministic; both sides call it).

    Adjacent slots that are contiguous in the arena merge into runs; runs are cut at
    ``max_message_bytes``; consecutive runs smaller than ``pack_below_bytes`` are grouped
    into packed messages of at most ``max_message_bytes``. Zero-length slots are ignored.
    Computed with numpy over the whole slot list (a transfer of 1,024 4-KiB pages planned
    in ~0.1 ms; a loop over the slots took ~1.5 ms, on both sides of every transfer).
    """
    if max_message_bytes <= 0:
        raise InvalidArgument(f"max_message_bytes must be positive, got {max_message_bytes}")
    if pack_below_bytes < 0:
        raise InvalidArgument(f"pack_below_bytes must be >= 0, got {pack_below_bytes}")
    offs, lens = _cut_runs(*_merge_runs(slots), max_message_bytes)
    plan = _group_runs(offs, lens, max_message_bytes, pack_below_bytes)
    if len(plan) > MAX_MESSAGES:
        raise InvalidArgument(f"transfer needs {len(plan)} messages, more than {MAX_MESSAGES}; "
                              "raise transport.max_message_bytes or split the transfer")
    return plan


def slot_array(slots: Slots) -> np.ndarray:
    """``slots`` as an ``[n, 2]`` int64 array (offset, nbytes); InvalidArgument if not pairs
    of integers or any is negative."""
    if isinstance(slots, np.ndarray):
        arr = slots.astype(np.int64, copy=False)
    else:
        try:
            if set(map(len, slots)) - {2}:
                raise ValueError("an element is not a pair")
            # twice as fast as np.array on a list of tuples (0.12 vs 0.25 ms per 1,024)
            arr = np.fromiter(itertools.chain.from_iterable(slots), np.int64,
                              count=2 * len(slots)).reshape(-1, 2)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidArgument(f"slots must be (offset, nbytes) integer pairs: {e}") from None
    if arr.size == 0:
        return np.zeros((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise InvalidArgument(f"slots must be (offset, nbytes) pairs, got shape {arr.shape}")
    if arr.min() < 0:              # (one reduction: the common case costs no more)
        off, n = arr[int(np.argmax((arr < 0).any(axis=1)))].tolist()
        raise InvalidArgument(f"slot ({off}, {n}) has a negative offset or length")
    return arr


def _merge_runs(slots: Slots) -> tuple[np.ndarray, np.ndarray]:
    """Non-empty slots, those contiguous with the one before merged: (offsets, lengths)."""
    arr = slot_array(slots)
    arr = arr[arr[:, 1] > 0]
    if not len(arr):
        return arr[:, 0], arr[:, 1]
    offs, lens = arr[:, 0], arr[:, 1]
    starts = np.flatnonzero(np.r_[True, offs[1:] != offs[:-1] + lens[:-1]])
    return offs[starts], np.add.reduceat(lens, starts)


def _cut_runs(offs: np.ndarray, lens: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    if not len(lens) or int(lens.max()) <= limit:
        return offs, lens
    pieces = -(-lens // limit)                         # messages per run
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(int(pieces.sum())) - first           # which cut of its run
    run_off, run_len = np.repeat(offs, pieces), np.repeat(lens, pieces)
    return run_off + k * limit, np.minimum(limit, run_len - k * limit)


def _group_runs(offs: np.ndarray, lens: np.ndarray, limit: int,
                pack_below: int) -> list[MessagePlan]:
    """Greedy, in order: consecutive small runs join one pack while it stays within one
    message; any other run is its own (direct) message."""
    plan: list[MessagePlan] = []
    count = len(lens)
    if not count:
        return plan
    off_list, len_list = offs.tolist(), lens.tolist()
    packable = (lens < pack_below) & (lens <= limit)
    ends = np.cumsum(lens)
    # segments of consecutive packable / unpackable runs
    edges = np.flatnonzero(np.r_[True, packable[1:] != packable[:-1]]).tolist() + [count]
    pos = 0
    for a, b in zip(edges, edges[1:]):
        if not packable[a]:
            for i in range(a, b):
                plan.append(MessagePlan(len(plan), pos, len_list[i],
                                        ((off_list[i], len_list[i]),)))
                pos += len_list[i]
            continue
        i = a
        while i < b:                                   # the longest pack from i within limit
            j = min(b, int(np.searchsorted(ends, pos + limit, side="right")))
            total = int(ends[j - 1]) - pos
            plan.append(MessagePlan(len(plan), pos, total,
                                    tuple(zip(off_list[i:j], len_list[i:j]))))
            pos += total
            i = j
    return plan


def make_tag(transfer_id: int, index: int) -> int:
    """The UCX tag of message ``index`` of ``transfer_id`` (see the bit layout above)."""
    return (transfer_id << INDEX_BITS) | index


def check_transfer_id(transfer_id: int) -> None:
    if not isinstance(transfer_id, int) or not 0 < transfer_id <= MAX_TRANSFER_ID:
        raise InvalidArgument(f"transfer id {transfer_id!r} outside 1..{MAX_TRANSFER_ID} "
                              "— use the receiving transport's new_transfer_id()")


class TransferIdSource:
    """Unique transfer ids for one receiving worker: random epoch (high bits) + counter.

    The random epoch keeps a restarted process from reissuing ids a stale peer may still
    send to; when the counter wraps, a new epoch different from the old one is drawn.
    """

    def __init__(self, randbits: Callable[[int], int] = secrets.randbits) -> None:
        self._randbits = randbits
        self._epoch = randbits(EPOCH_BITS)
        self._counter = 0

    def next(self) -> int:
        self._counter += 1
        if self._counter >= (1 << COUNTER_BITS):
            old = self._epoch
            while self._epoch == old:
                self._epoch = self._randbits(EPOCH_BITS)
            self._counter = 1
        return (self._epoch << COUNTER_BITS) | self._counter


class StagingPool:
    """A preallocated host buffer handed out in aligned extents (first fit, coalescing).

    Used for packed messages (receiver scatters) and gathers (sender). ``try_alloc`` never
    blocks; callers wait for ``on_free`` (the transport wakes its waiters) and retry.
    """

    def __init__(self, nbytes: int, align: int = 4096,
                 on_free: Callable[[], None] | None = None,
                 buffer: np.ndarray | None = None) -> None:
        """``buffer``: the memory to hand out (e.g. page-locked, for H2D copies); default a
        new private one."""
        if nbytes < 0 or align <= 0:
            raise InvalidArgument(f"staging of {nbytes} B aligned to {align} is not valid")
        if buffer is not None and (not isinstance(buffer, np.ndarray) or buffer.nbytes != nbytes
                                   or buffer.dtype != np.uint8 or buffer.ndim != 1
                                   or not buffer.flags.c_contiguous):
            raise InvalidArgument(f"a staging buffer must be a flat contiguous uint8 host "
                                  f"array of {nbytes} B")
        self.buffer = np.empty(nbytes, dtype=np.uint8) if buffer is None else buffer
        self.buffer[::4096] = 0  # fault the pages in now, not during the first transfer
        self._align = align
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []
        self._used: dict[int, int] = {}
        self.on_free = on_free
        self.in_use = 0
        self.peak = 0
        self.allocations = 0

    @property
    def capacity(self) -> int:
        return int(self.buffer.nbytes)

    def try_alloc(self, nbytes: int) -> int | None:
        """Offset of a free extent of at least ``nbytes``, or None if none is free now."""
        size = -(-max(nbytes, 1) // self._align) * self._align
        if size > self.capacity:
            raise InvalidArgument(f"staging request of {nbytes} B exceeds the staging buffer "
                                  f"({self.capacity} B) — raise transport.staging_bytes")
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                self._free[i:i + 1] = [(off + size, n - size)] if n > size else []
                self._used[off] = size
                self.in_use += size
                self.peak = max(self.peak, self.in_use)
                self.allocations += 1
                return off
        return None

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buffer[offset:offset + nbytes]

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.in_use -= size
        self._insert_free(offset, size)
        if self.on_free is not None:
            self.on_free()

    def _insert_free(self, off: int, size: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < off:
            i += 1
        free.insert(i, (off, size))
        if i + 1 < len(free) and off + size == free[i + 1][0]:  # merge with the next
            free[i:i + 2] = [(off, size + free[i + 1][1])]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:    # merge with the previous
            free[i - 1:i + 1] = [(free[i - 1][0], free[i - 1][1] + free[i][1])]


HELLO_BYTES = 512
HELLO_VERSION = 1


class TransferHello(msgspec.Struct, array_like=True, frozen=True):
    """Identification both sides send on a new endpoint (on ucxx's own endpoint tag).

    Carries the planning limits: peers that cut messages differently must not talk.
    ``worker_address`` (the UCX worker address, empty when single copy is off on that side)
    and ``host_id`` (boot id + pid/ipc namespaces) decide whether the link moves data over a
    single-copy endpoint (:func:`single_copy_link`); ``process`` (``pid:start time``) lets a
    peer tell later whether this process still exists. ``shm*``: whether the link may move
    pages by one memcpy into the receiver's ``/dev/shm`` arena (:func:`shm_link`,
    :mod:`common.transport.shm_path`). Trailing fields with defaults: a peer without them
    decodes ours (msgspec ignores extra trailing fields) and vice versa.
    """

    version: int
    node_id: str
    host: str
    port: int
    max_message_bytes: int
    pack_below_bytes: int
    worker_address: bytes = b""
    host_id: str = ""
    process: str = ""
    shm: bool = False        # speaks the one-copy protocol (transport.same_host = "shm")
    shm_segment: str = ""    # the /dev/shm segment it receives into ("" = none)
    shm_bytes: int = 0
    shm_nonce: int = 0       # names this transport in shm control messages
    rma_mode: str = ""       # transport.kv_mode ("" = an old peer: tag)
    rma_dma: bool = False    # its UCX has verbs: RMA is one-sided DMA there (kv_mode auto)
    rma_rkey: bytes = b""    # the packed remote key of the arena it receives into ("" = none)
    rma_base: int = 0        # that arena's address and size in its process
    rma_bytes: int = 0
    # the pages it sends come from device memory (its pool is on a GPU): a device arena
    # receives them directly; from a host sender it stages (:func:`stage_to_device`)
    device_sources: bool = False


def encode_hello(hello: TransferHello) -> np.ndarray:
    """A fixed-size frame: 2-byte little-endian length, msgpack body, zero padding."""
    body = msgspec.msgpack.encode(hello)
    if len(body) > HELLO_BYTES - 2:
        raise InvalidArgument(f"transport hello of {len(body)} B is too long (node id?)")
    buf = np.zeros(HELLO_BYTES, dtype=np.uint8)
    buf[:2] = np.frombuffer(len(body).to_bytes(2, "little"), dtype=np.uint8)
    buf[2:2 + len(body)] = np.frombuffer(body, dtype=np.uint8)
    return buf


def fit_hello(hello: TransferHello) -> TransferHello:
    """``hello`` if it fits one frame, else without its worker address (no single copy),
    then without its remote key (no RMA into this side)."""
    for drop in ({}, {"worker_address": b""},
                 {"worker_address": b"", "rma_rkey": b"", "rma_base": 0, "rma_bytes": 0}):
        fitted = msgspec.structs.replace(hello, **drop)
        if len(msgspec.msgpack.encode(fitted)) <= HELLO_BYTES - 2:
            return fitted
    return fitted


def rma_link(mine: TransferHello, theirs: TransferHello) -> bool:
    """Whether pages between the two ends of a link may go by RMA (into a side whose hello
    carries a remote key): both speak it, and either both asked for it (``kv_mode = "rma"``)
    or both have verbs (``auto``: one-sided DMA; on other transports UCX emulates RMA with
    messages the target must progress, slower than tags). Symmetric, like
    :func:`single_copy_link`."""
    modes = {mine.rma_mode, theirs.rma_mode}
    if not mine.rma_mode or not theirs.rma_mode or "tag" in modes:
        return False
    return modes == {"rma"} or (mine.rma_dma and theirs.rma_dma)


def single_copy_link(mine: TransferHello, theirs: TransferHello) -> bool:
    """Whether a link moves data over a single-copy endpoint: both sides offer it (a worker
    address) and run on the same host, pid and ipc namespaces. Symmetric: both ends of a
    link compute the same answer from the same two hellos."""
    return bool(mine.worker_address and theirs.worker_address and mine.host_id
                and mine.host_id == theirs.host_id)


def shm_link(mine: TransferHello, theirs: TransferHello) -> bool:
    """Whether the two ends of a link run the shm handshake: both speak it, on the same
    host, pid and ipc namespaces, and at least one receives into a segment. Symmetric, like
    :func:`single_copy_link`; whether pages then go by shm in a direction also needs the
    sender to have mapped the receiver's segment."""
    return bool(mine.shm and theirs.shm and mine.host_id and mine.host_id == theirs.host_id
                and (mine.shm_segment or theirs.shm_segment))


def decode_hello(buf: np.ndarray) -> TransferHello:
    size = int.from_bytes(buf[:2].tobytes(), "little")
    try:
        return msgspec.msgpack.decode(buf[2:2 + size].tobytes(), type=TransferHello)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad transport hello: {e}") from e


def check_same_plan(mine: TransferHello, theirs: TransferHello) -> None:
    ours = (mine.version, mine.max_message_bytes, mine.pack_below_bytes)
    peer = (theirs.version, theirs.max_message_bytes, theirs.pack_below_bytes)
    if ours != peer:
        raise ProtocolError(f"transport peer {theirs.node_id} plans messages differently: "
                            f"(version, max_message_bytes, pack_below_bytes) = {peer}, ours "
                            f"{ours} — use the same [transport] settings on both sides")


class SourceMap:
    """Locates stream byte ranges in the sender's source views (their concatenation)."""

    def __init__(self, views: Sequence) -> None:
        self.views = list(views)
        self.starts: list[int] = []
        pos = 0
        for v in self.views:
            self.starts.append(pos)
            pos += int(v.nbytes)
        self.nbytes = pos

    def single(self, start: int, nbytes: int):
        """The zero-copy view of ``[start, start+nbytes)`` if one source view holds it."""
        i = self._index(start)
        local = start - self.starts[i]
        view = self.views[i]
        if local + nbytes <= view.nbytes:
            return view[local:local + nbytes]
        return None

    def gather_into(self, dst: np.ndarray, start: int) -> None:
        """Copy stream bytes ``[start, start+len(dst))`` from the source views into ``dst``."""
        i, done, total = self._index(start), 0, dst.nbytes
        local = start - self.starts[i]
        while done < total:
            view = self.views[i]
            take = min(view.nbytes - local, total - done)
            dst[done:done + take] = view[local:local + take]
            done += take
            i, local = i + 1, 0

    def _index(self, pos: int) -> int:
        # Last view starting at or before pos; an empty view can only be last of its start.
        i = bisect.bisect_right(self.starts, pos) - 1
        while self.starts[i] + self.views[i].nbytes <= pos:
            i += 1
        return i


def stage_to_device(arena: Any, peer_sends_device: bool) -> bool:
    """Whether receives into ``arena`` from a peer land in pinned host staging first, then
    one H2D copy per message (:mod:`common.transport.device_staging`): ``arena`` is device
    memory and the peer's hello says it sends host memory (``device_sources`` false: a
    gateway, a node whose pool is on the host, an older peer). Device to device stays
    direct (UCX's ``cuda_ipc``); host arenas never stage."""
    return is_device_array(arena) and not peer_sends_device


def check_flat_bytes(buf: Any, what: str, writable: bool = False) -> None:
    ok = getattr(buf, "ndim", 0) == 1 and str(getattr(buf, "dtype", "")) == "uint8"
    flags = getattr(buf, "flags", None)
    ok = ok and flags is not None and flags.c_contiguous
    if ok and writable and isinstance(buf, np.ndarray):
        ok = buf.flags.writeable
    if not ok:
        raise InvalidArgument(f"{what} must be a flat, contiguous{', writable' if writable else ''}"
                              " uint8 numpy or cupy array")
    if is_device_array(buf) and not cuda_available():
        raise InvalidArgument(f"{what} is a device array but no CUDA device is available")


def cuda_available() -> bool:
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # cupy missing or broken: no device path
        return False
