"""The one-copy same-host path's parts that need no UCX and no event loop: the receiver's
advertised segment, the sender's mapping of it, the fence locks, the control messages and
the copy itself (the protocol is :mod:`common.transport.shm_transfers`; docs/datapath.md,
"Same host: one copy").

Why a fence: a sender writes into the receiver's arena with plain stores, which the receiver
cannot cancel the way it cancels a posted UCX receive. A receiver that gives a transfer up
(deadline, cancel, its peer's link down) hands the slots back to its pool, so it must first
know that no copy into them is running or can still start. Each transfer id names one byte
of the segment file as an open-file-description lock (``F_OFD_SETLK``; the byte may lie
beyond the end of the file): the sender holds a *shared* lock on it while it copies and
takes it without waiting (refused: the receiver gave up, nothing is written); a receiver that
gives up takes the *exclusive* lock, which it gets only once the copy ended, and keeps it
while the id is remembered as retired. The kernel drops a process's locks when it dies, so
a sender killed mid-copy never blocks a survivor, and no UCX request is involved that a dead
peer could make UCX abort on. OFD locks belong to an open file, not a process, so two
transports of one process (the tests) exclude each other as two processes do.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import InvalidArgument
from common.shm import ShmSegment, ShmUnavailable, open_segment, segment_of, valid_name
from common.transport.plan import is_device_array

# Control messages travel on one fixed tag (transfer id 0 is never a transfer's, so no data
# tag equals it) and name their transfer in the payload: tag matching is worker-wide.
CONTROL_TAG = 1
READY, COMMIT = 1, 2
_CONTROL = struct.Struct("<7Q")
CONTROL_BYTES = _CONTROL.size
PATH_TAG, PATH_SHM, PATH_RMA = 0, 1, 2     # PATH_RMA: common.transport.rma_path
_FLOCK = struct.Struct("@hhqqi4x")     # struct flock (Linux, 64-bit off_t)


@dataclass(frozen=True, slots=True)
class Control:
    """One control message of the shm protocol.

    READY (receiver → sender, sent by ``expect``): ``nonce`` is the receiver's, ``path`` says
    whether the sender copies (``PATH_SHM``, into ``offset``.. ``offset + span`` of the
    segment) or sends tag messages (``PATH_TAG``: that arena is not in the segment).
    COMMIT (sender → receiver, after the copy): ``nonce`` is the sender's, ``offset`` the
    pieces copied. Both carry the stream's byte count and the digest of the slot list, so a
    sender never writes and a receiver never completes on a plan the other side did not post.
    """

    kind: int
    transfer_id: int
    nonce: int
    nbytes: int
    digest: int
    path: int = PATH_TAG
    offset: int = 0
    span: int = 0

    def encode(self) -> np.ndarray:
        word = self.path | (self.kind << 8)
        raw = _CONTROL.pack(word, self.transfer_id, self.nonce, self.nbytes, self.digest,
                            self.offset, self.span)
        return np.frombuffer(raw, np.uint8).copy()

    @classmethod
    def decode(cls, buf: np.ndarray) -> Control:
        word, tid, nonce, nbytes, digest, offset, span = _CONTROL.unpack(buf.tobytes())
        return cls(word >> 8, tid, nonce, nbytes, digest, word & 0xFF, offset, span)


def slots_digest(slots: Sequence[tuple[int, int]]) -> int:
    """64-bit digest of a slot list (zero-length slots ignored): both sides compute it."""
    runs = np.array([(o, n) for o, n in slots if n], np.int64).reshape(-1, 2)
    return int.from_bytes(hashlib.blake2b(runs.tobytes(), digest_size=8).digest(), "little")


def check_within(slots: Sequence[tuple[int, int]], span: int) -> None:
    """Every slot inside ``[0, span)`` (the receiver's arena): a sender never writes past it."""
    for off, n in slots:
        if off < 0 or n < 0 or off + n > span:
            raise InvalidArgument(f"slot ({off}, {n}) lies outside the receiver's arena "
                                  f"of {span} B")


def stream_pieces(src: Sequence[Any], slots: Sequence[tuple[int, int]]
                  ) -> Iterator[tuple[Any, int]]:
    """(source view, offset in the receiver's arena) per piece of the concatenation of
    ``src`` laid out at ``slots`` (stream order): where a slot and a source view overlap."""
    views = [v for v in src if v.nbytes]
    vi, vpos = 0, 0
    for off, n in slots:
        done = 0
        while done < n:
            view = views[vi]
            take = min(n - done, view.nbytes - vpos)
            yield view[vpos:vpos + take], off + done
            done += take
            vpos += take
            if vpos == view.nbytes:
                vi, vpos = vi + 1, 0


def copy_stream(src: Sequence[Any], dst: np.ndarray, slots: Sequence[tuple[int, int]],
                stop: threading.Event, share: int = 0, shares: int = 1) -> int:
    """Copy the concatenation of ``src`` into ``dst`` at ``slots`` (stream order): one copy
    per piece (:func:`stream_pieces`) — numpy's memcpy without the GIL, or a device-to-host
    copy for a device view. With ``shares`` > 1 only share ``share`` of the stream's bytes
    (the ``share``-th of ``shares`` contiguous byte ranges), so that many threads copy one
    transfer at once, each walking the pieces itself (nothing is planned on the event loop).
    Stops between pieces once ``stop`` is set; returns the copies made."""
    lo, hi = share_bounds(sum(n for _, n in slots), share, shares)
    pos, copies = 0, 0
    for part, at in stream_pieces(src, slots):
        begin, pos = pos, pos + part.nbytes
        if pos <= lo:
            continue
        if begin >= hi:
            break
        if stop.is_set():
            return copies
        a, b = max(lo, begin) - begin, min(hi, pos) - begin    # this share's part of the piece
        out = dst[at + a:at + b]
        if is_device_array(part):
            part[a:b].get(out=out)
        else:
            np.copyto(out, part[a:b])
        copies += 1
    return copies


def share_bounds(total: int, share: int, shares: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of a stream of ``total`` bytes that copy share ``share`` of
    ``shares`` writes (contiguous, about equal)."""
    return total * share // shares, total * (share + 1) // shares


class Fence:
    """The fence locks of one segment file, on this transport's own open file (module doc)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def _lock(self, kind: int, transfer_id: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK,
                        _FLOCK.pack(kind, os.SEEK_SET, transfer_id, 1, 0))
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def try_share(self, transfer_id: int) -> bool:
        """Sender: may copy now (False: the receiver gave the transfer up)."""
        return self._lock(fcntl.F_RDLCK, transfer_id)

    def try_exclusive(self, transfer_id: int) -> bool:
        """Receiver giving up: no copy runs now and none can start (False: one runs)."""
        return self._lock(fcntl.F_WRLCK, transfer_id)

    def release(self, transfer_id: int) -> None:
        self._lock(fcntl.F_UNLCK, transfer_id)

    def close(self) -> None:
        """Close the file: the kernel drops every lock this transport holds on it."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalSegment:
    """The ``/dev/shm`` segment this transport receives into and advertises in its hello."""

    def __init__(self, seg: ShmSegment) -> None:
        self.name, self.nbytes, self.array = seg.name, seg.nbytes, seg.array
        self.fence = Fence(os.open(seg.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC))
        self._base = int(seg.array.ctypes.data)

    @classmethod
    def of(cls, arena: Any) -> LocalSegment | None:
        """The segment ``arena`` lies in (None: private or device memory: no shm receives)."""
        found = segment_of(arena) if isinstance(arena, np.ndarray) else None
        return None if found is None else cls(found[0])

    def locate(self, arena: Any) -> int | None:
        """Offset of ``arena`` in the segment, or None (elsewhere, or device memory)."""
        if is_device_array(arena) or not isinstance(arena, np.ndarray):
            return None
        addr = int(arena.ctypes.data)
        if self._base <= addr and addr + arena.nbytes <= self._base + self.nbytes:
            return addr - self._base
        return None

    def close(self) -> None:
        self.fence.close()


class PeerSegment:
    """A peer's advertised segment, mapped read-write by this (sending) transport."""

    def __init__(self, name: str, nbytes: int, directory: str) -> None:
        if not valid_name(name):
            raise ShmUnavailable(f"peer segment name {name!r} is not a dualpath segment")
        self.array, fd = open_segment(os.path.join(directory, name), nbytes)
        self.name, self.nbytes, self.fence = name, nbytes, Fence(fd)
        self._users, self._closing = 0, False

    @property
    def closing(self) -> bool:
        return self._closing

    def acquire(self) -> bool:
        """A copy starts (False once let go: the fence's file is closing)."""
        if self._closing:
            return False
        self._users += 1
        return True

    def release(self) -> None:
        self._users -= 1
        if self._closing and not self._users:
            self.fence.close()

    def close(self) -> None:
        """Let go; the fence's file closes when the last copy ended (closing it earlier would
        drop the shared locks of copies still running). The mapping goes with the last view
        of ``array``."""
        self._closing = True
        if not self._users:
            self.fence.close()


class PeerSegments:
    """The peers' segments this transport has mapped, by name (several links to one peer
    share one mapping). A segment no usable link uses is let go at once: a dead peer's
    pages would otherwise live on in /dev/shm as long as we map them."""

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._maps: dict[str, PeerSegment] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def map(self, name: str, nbytes: int) -> PeerSegment:
        """The mapping of ``name`` (made now if new); ShmUnavailable, InvalidArgument,
        OSError when it cannot be mapped from here."""
        seg = self._maps.get(name)
        if seg is None:
            seg = self._maps[name] = PeerSegment(name, nbytes, self._directory)
        return seg

    def keep_only(self, used: set[str]) -> None:
        """Let go of every mapping whose name is not in ``used`` (the live links' ones)."""
        for name in [n for n in self._maps if n not in used]:
            self._maps.pop(name).close()

    def close(self) -> None:
        self.keep_only(set())

