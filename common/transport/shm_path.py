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
from typing import Any, NamedTuple

import numpy as np

from common.errors import InvalidArgument
from common.shm import ShmSegment, ShmUnavailable, open_segment, segment_of, valid_name
from common.transport.plan import Slots, is_device_array, slot_array

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


def slots_digest(slots: Slots) -> int:
    """64-bit digest of a slot list (zero-length slots ignored): both sides compute it."""
    arr = slot_array(slots)
    runs = np.ascontiguousarray(arr[arr[:, 1] != 0])
    return int.from_bytes(hashlib.blake2b(runs.tobytes(), digest_size=8).digest(), "little")


def check_within(slots: Slots, span: int) -> None:
    """Every slot inside ``[0, span)`` (the receiver's arena): a sender never writes past it
    (zero-length slots ignored, as the plans ignore them)."""
    arr = slot_array(slots)
    bad = (arr[:, 0] + arr[:, 1] > span) & (arr[:, 1] > 0)
    if bad.any():
        off, n = arr[int(np.argmax(bad))].tolist()
        raise InvalidArgument(f"slot ({off}, {n}) lies outside the receiver's arena "
                              f"of {span} B")


def stream_pieces(src: Sequence[Any], slots: Slots
                  ) -> Iterator[tuple[Any, int]]:
    """(source view, offset in the receiver's arena) per piece of the concatenation of
    ``src`` laid out at ``slots`` (stream order): where a slot and a source view overlap."""
    views = [v for v in src if v.nbytes]
    vi, vpos = 0, 0
    for off, n in slot_array(slots).tolist():     # (plain ints for the puts' ctypes)
        done = 0
        while done < n:
            view = views[vi]
            take = min(n - done, view.nbytes - vpos)
            yield view[vpos:vpos + take], off + done
            done += take
            vpos += take
            if vpos == view.nbytes:
                vi, vpos = vi + 1, 0


class Run(NamedTuple):
    """``rows`` pieces of ``n`` bytes, read back to back from ``view`` at ``vpos`` and
    written every ``stride`` bytes of the receiver's arena from ``at``: one strided copy."""
    view: Any
    vpos: int
    at: int
    n: int
    rows: int
    stride: int


def stream_runs(src: Sequence[Any], slots: Slots) -> Iterator[Run]:
    """The pieces of :func:`stream_pieces` merged into runs: consecutive pieces of one
    contiguous host view, of one size, at a constant stride in the receiver's arena (a page
    pool's equal pages, a layer's block pieces) — each run is one numpy copy instead of one
    per piece, which is what 4 KiB pages cost (~5 µs of Python each). Planned with numpy over
    the whole transfer: a piece joins the run before it when its view and size are the same
    and its distance from the previous piece is the one that piece had from its own
    predecessor (so a run's first piece after an irregular one may stand alone)."""
    views = [v for v in src if v.nbytes]
    arr = slot_array(slots)
    arr = arr[arr[:, 1] > 0]
    if not len(arr) or not views:
        return
    slot_end = np.cumsum(arr[:, 1])
    view_size = np.array([v.nbytes for v in views], np.int64)
    view_end = np.cumsum(view_size)
    if len(views) == 1:            # one source view (a page pool's run): the slots cut it
        cuts = slot_end
    else:                          # (union1d sorts: ~0.1 ms per 1,024 slots)
        cuts = np.union1d(slot_end, view_end)
        cuts = cuts[cuts <= slot_end[-1]]
    first: np.ndarray = np.r_[0, cuts[:-1]]            # each piece's stream offset
    n = cuts - first
    si = np.searchsorted(slot_end, first, side="right")    # each piece's slot
    vi = np.searchsorted(view_end, first, side="right")    # and source view
    at = arr[si, 0] + first - (slot_end[si] - arr[si, 1])
    vpos = first - (view_end - view_size)[vi]
    mergeable = np.array([not is_device_array(v) and bool(getattr(v, "flags", None))
                          and v.flags.c_contiguous for v in views])[vi]
    step: np.ndarray = np.r_[0, np.diff(at)]
    joins: np.ndarray = np.r_[False, (vi[1:] == vi[:-1]) & (n[1:] == n[:-1])
                              & (step[1:] >= n[1:]) & mergeable[1:] & mergeable[:-1]]
    # a piece after the run's second one must keep its stride
    joins[2:] &= ~joins[1:-1] | (step[2:] == step[1:-1])
    starts = np.flatnonzero(~joins)
    counts = np.diff(np.r_[starts, len(n)])
    for k, count in zip(starts.tolist(), counts.tolist()):
        stride = int(step[k + 1]) if count > 1 else int(n[k])
        yield Run(views[int(vi[k])], int(vpos[k]), int(at[k]), int(n[k]), count, stride)


def plan_runs(src: Sequence[Any], slots: Slots) -> list[Run]:
    """:func:`stream_runs` as a list: planned once per transfer, then walked by every thread
    that copies a share of it (where it is planned: ``ShmTransfers._copy``)."""
    return list(stream_runs(src, slots))


def copy_stream(src: Sequence[Any], dst: np.ndarray, slots: Slots,
                stop: threading.Event, share: int = 0, shares: int = 1,
                runs: Sequence[Run] | None = None) -> int:
    """Copy the concatenation of ``src`` into ``dst`` at ``slots`` (stream order): one copy
    per run of equal, evenly spaced pieces (:func:`stream_runs`; ``runs`` when the caller
    planned them already, :func:`plan_runs`) — numpy's memcpy without the GIL, or a
    device-to-host copy per piece for a device view. With ``shares`` > 1 only share ``share``
    of the stream's bytes (the ``share``-th of ``shares`` contiguous byte ranges), so that
    many threads copy one transfer at once, each walking the same plan; a run cut by a
    share's edge copies its whole pieces in one go and the cut ones alone. Stops between runs
    once ``stop`` is set; returns the copies made."""
    if runs is None:
        runs = plan_runs(src, slots)
    lo, hi = share_bounds(sum(r.n * r.rows for r in runs), share, shares)
    pos, copies = 0, 0
    for run in runs:
        begin, pos = pos, pos + run.n * run.rows
        if pos <= lo:
            continue
        if begin >= hi:
            break
        if stop.is_set():
            return copies
        copies += _copy_run(run, dst, max(lo, begin) - begin, min(hi, pos) - begin)
    return copies


def _copy_run(run: Run, dst: np.ndarray, first: int, end: int) -> int:
    """Copy bytes ``[first, end)`` of ``run`` (counted in its stream); the copies made."""
    n = run.n
    whole_from = -(-first // n)                  # pieces wholly inside [first, end)
    whole_to = end // n
    copies = 0
    for k in sorted({first // n, (end - 1) // n}):
        if whole_from <= k < whole_to:
            continue                             # a whole piece: in the strided copy below
        a, b = max(first, k * n) - k * n, min(end, (k + 1) * n) - k * n
        src = run.view[run.vpos + k * n + a:run.vpos + k * n + b]
        out = dst[run.at + k * run.stride + a:run.at + k * run.stride + b]
        if is_device_array(src):
            src.get(out=out)
        else:
            np.copyto(out, src)
        copies += 1
    rows = whole_to - whole_from
    if rows <= 0:
        return copies
    src = run.view[run.vpos + whole_from * n:run.vpos + whole_to * n]
    at = run.at + whole_from * run.stride
    if rows == 1 or run.stride == n:             # contiguous in the arena too
        out = dst[at:at + (rows - 1) * run.stride + n]
        if is_device_array(src):
            src.get(out=out)
        else:
            np.copyto(out, src)
    else:
        region = dst[at:at + (rows - 1) * run.stride + n]
        if region.nbytes != (rows - 1) * run.stride + n or src.nbytes != rows * n:
            # as_strided checks nothing: never let a wrong run write outside the arena
            raise InvalidArgument(f"run of {rows} x {n} B every {run.stride} B at {at} does "
                                  f"not fit the arena of {dst.nbytes} B")
        out = np.lib.stride_tricks.as_strided(region, shape=(rows, n), strides=(run.stride, 1))
        np.copyto(out, src.reshape(rows, n))
    return copies + 1


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

