"""Named shared-memory segments: a requester's buffer the node's gateway can read straight into.

Why: a gateway that preads into its own staging and then moves the bytes into the requester over
UCX copies every byte twice (same-host cma is one ``process_vm_readv`` per run on top of the
pread); ``pread`` into the requester's buffer copies once. Like 3FS USRBIO (the client
registers a shared-memory "Iov" and the FUSE daemon reads straight into it), the requester's
arena here lives in a file ``/dev/shm/dualpath-<32 hex>`` that the gateway maps once and
``preadv``s the Full Blocks into — one copy, no staging.

Requester side (``ShmSegment.create``): ``os.open(O_CREAT|O_EXCL|O_NOFOLLOW, 0600)`` +
``posix_fallocate`` (tmpfs reserves the pages now, so a full /dev/shm is an ``OSError`` here,
never a SIGBUS later) + ``mmap``. No ``multiprocessing.shared_memory`` (its resource tracker in
3.11 unlinks segments other processes still use). The owner unlinks its name on ``close()``
(and, through a finalizer, at interpreter exit). A SIGKILLed owner leaves its file behind: the
name encodes the owner's pid and a tag of its host + pid namespace, and every ``create`` first
removes segments of the same tag whose owner pid is dead (``sweep_stale``) — never one of
another namespace, where that pid means nothing.

Gateway side (``ShmMappings``): only names matching ``NAME_RE`` are looked at, only under
``SHM_DIR``, opened ``O_NOFOLLOW``; the file must be a regular file with one link, owned by the
gateway's own uid, of exactly the size the requester declared. Mappings are cached (bounded
LRU, re-validated by ``stat`` on every use, so an unlinked or replaced segment is never used).
The trust boundary is the uid: a process that can write the segment (same uid) could also
signal the gateway. See docs/storage.md "Same-host shared memory".
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import mmap
import os
import re
import secrets
import stat
import weakref
from dataclasses import dataclass

import numpy as np
import structlog

from common.errors import InvalidArgument

log = structlog.get_logger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "dualpath-"
NAME_RE = re.compile(r"dualpath-[0-9a-f]{32}\Z")
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)   # page tables filled once


class ShmUnavailable(Exception):
    """The segment cannot be used from here (another host or container, other uid, no
    /dev/shm): not the requester's fault — it falls back to the UCX path."""


def valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_RE.match(name) is not None


@functools.cache
def _namespace_tag() -> str:
    """8 hex chars naming this host + pid namespace (+ boot): pids are only comparable within."""
    parts = [os.uname().nodename]
    for p in ("/proc/self/ns/pid", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(str(os.stat(p).st_ino) if p.endswith("pid") else open(p).read().strip())
        except OSError:
            parts.append("?")
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=4).hexdigest()


def make_name() -> str:
    """``dualpath-`` + owner pid (8 hex) + namespace tag (8 hex) + 16 random hex."""
    return f"{PREFIX}{os.getpid() & 0xFFFFFFFF:08x}{_namespace_tag()}{secrets.token_hex(8)}"


def owner_of(name: str) -> tuple[int, str]:
    """(pid, namespace tag) encoded in a segment name."""
    if not valid_name(name):
        raise InvalidArgument(f"not a dualpath shared-memory segment name: {name!r}")
    return int(name[9:17], 16), name[17:25]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists here (one of another uid counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink our uid's segments of this host + pid namespace whose owner pid is dead."""
    removed: list[str] = []
    tag, uid = _namespace_tag(), os.geteuid()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not valid_name(name):
            continue
        pid, their_tag = owner_of(name)
        if their_tag != tag or pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid != uid:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    if removed:
        log.warning("shm_stale_segments_removed", count=len(removed), names=removed[:8])
    return removed


# --------------------------------------------------------------------------- owner side

_LIVE: dict[int, weakref.ref] = {}          # base address → segment (for ``segment_of``)


def _unlink(path: str, base: int) -> None:
    _LIVE.pop(base, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmSegment:
    """A named shared-memory segment owned by this process; ``array`` is its bytes (uint8)."""

    def __init__(self, name: str, nbytes: int, mm: mmap.mmap, directory: str) -> None:
        self.name, self.nbytes, self.directory = name, nbytes, directory
        self.path = os.path.join(directory, name)
        self._mm = mm
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.base = self.array.ctypes.data
        _LIVE[self.base] = weakref.ref(self)
        self._finalizer = weakref.finalize(self, _unlink, self.path, self.base)

    @classmethod
    def create(cls, nbytes: int, directory: str = SHM_DIR, sweep: bool = True) -> ShmSegment:
        """A new zeroed segment of ``nbytes``; ``OSError`` if /dev/shm cannot hold it."""
        if nbytes <= 0:
            raise InvalidArgument(f"segment size must be positive, got {nbytes}")
        if sweep:
            sweep_stale(directory)
        name = make_name()
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)      # ENOSPC now, not SIGBUS on first touch
            mm = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, nbytes, mm, directory)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unlink the name now; the mapping goes when the last view of ``array`` does."""
        self._finalizer()
        try:
            self._mm.close()
        except BufferError:              # views still exported (the pool's arena): GC unmaps
            pass

    def __repr__(self) -> str:
        return f"ShmSegment({self.name}, {self.nbytes} B{', closed' if self.closed else ''})"


def segment_of(arr) -> tuple[ShmSegment, int] | None:
    """(segment, offset of ``arr`` in it) if ``arr`` lies in a live segment of this process."""
    try:
        addr, nbytes = arr.__array_interface__["data"][0], arr.nbytes
    except (AttributeError, KeyError, TypeError):
        return None
    for base, ref in list(_LIVE.items()):
        seg = ref()
        if seg is not None and not seg.closed and base <= addr and addr + nbytes <= base + seg.nbytes:
            return seg, addr - base
    return None


# --------------------------------------------------------------------------- gateway side

def open_segment(path: str, nbytes: int) -> tuple[np.ndarray, int]:
    """Map another process's segment at ``path`` read-write: (its bytes, an open fd on it).

    The checks of the module doc (a plain file with one link, our uid, exactly ``nbytes``).
    The caller owns the fd (the page transport keeps it for its fence locks; the gateway
    closes it at once). InvalidArgument: not a plain segment of that size; ShmUnavailable:
    not reachable from here.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ShmUnavailable(f"{path} does not exist here (other host or container?)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:                    # a symlink under that name
            raise InvalidArgument(f"{path} is a symbolic link, not a segment") from None
        raise ShmUnavailable(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise InvalidArgument(f"{path} is not a plain shared-memory segment")
        if st.st_uid != os.geteuid():
            raise ShmUnavailable(f"{path} belongs to uid {st.st_uid}, this process runs as "
                                 f"{os.geteuid()}")
        if st.st_size != nbytes:
            raise InvalidArgument(f"{path} holds {st.st_size} B, the peer says {nbytes} B")
        mm = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return np.frombuffer(mm, dtype=np.uint8), fd


@dataclass
class _Mapping:
    dev: int
    ino: int
    nbytes: int
    array: np.ndarray


class ShmMappings:
    """A gateway's bounded LRU of requester segments it mapped (``get`` checks each use)."""

    def __init__(self, max_mappings: int = 16, directory: str = SHM_DIR) -> None:
        self.max_mappings = max(1, max_mappings)
        self.directory = directory
        self._maps: collections.OrderedDict[str, _Mapping] = collections.OrderedDict()
        self.stats = dict.fromkeys(("shm_maps_opened", "shm_maps_dropped", "shm_map_hits"), 0)

    def __len__(self) -> int:
        return len(self._maps)

    def get(self, name: str, nbytes: int) -> np.ndarray:
        """The segment ``name`` as a writable uint8 array of exactly ``nbytes``.

        InvalidArgument: a bad name, or a file there that is not a plain segment of that size.
        ShmUnavailable: not reachable from this process (absent, other uid, permissions).
        """
        if not valid_name(name):
            raise InvalidArgument(f"shared-memory segment name {name!r} does not match "
                                  f"{NAME_RE.pattern}")
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"shared-memory segment size must be positive, got {nbytes}")
        path = os.path.join(self.directory, name)
        cached = self._maps.get(name)
        if cached is not None:
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                st = None
            if st is not None and (st.st_dev, st.st_ino, st.st_size) == (cached.dev, cached.ino, nbytes):
                self._maps.move_to_end(name)
                self.stats["shm_map_hits"] += 1
                return cached.array
            self._drop(name)
        self._prune()
        m = self._open(path, nbytes)
        self._maps[name] = m
        self.stats["shm_maps_opened"] += 1
        while len(self._maps) > self.max_mappings:
            self._drop(next(iter(self._maps)))
        return m.array

    def _open(self, path: str, nbytes: int) -> _Mapping:
        array, fd = open_segment(path, nbytes)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return _Mapping(st.st_dev, st.st_ino, nbytes, array)

    def _prune(self) -> None:
        """Drop mappings whose segment was unlinked or replaced (a requester that left)."""
        for name, m in list(self._maps.items()):
            try:
                st = os.stat(os.path.join(self.directory, name), follow_symlinks=False)
                if (st.st_dev, st.st_ino) == (m.dev, m.ino):
                    continue
            except OSError:
                pass
            self._drop(name)

    def _drop(self, name: str) -> None:
        # No explicit munmap: a read still using the mapping holds views; the last one unmaps.
        if self._maps.pop(name, None) is not None:
            self.stats["shm_maps_dropped"] += 1

    def clear(self) -> None:
        for name in list(self._maps):
            self._drop(name)


if __name__ == "__main__":                    # operator: python -m common.shm sweep
    import sys

    if sys.argv[1:] != ["sweep"]:
        raise SystemExit("usage: python -m common.shm sweep   (unlink segments of dead owners)")
    print("\n".join(sweep_stale()) or "no stale segments")
