"""The ``fs`` backend: one file per Full Block in a (local or shared) directory.

Format and write protocol: ``storage_gateway.block_format``. Reads are positioned reads straight
into the caller's views (``os.preadv`` scatters header + per-layer payload, ``READ_CHUNK`` bytes
per call, each step hashed while it is in cache) and are verified (header, then xxh3 over the
payload) before the block is reported read — the open, steps and hashes of one block in one
GIL-free C call where the install built ``storage_gateway._blockread`` (``native_reads``,
docs/storage.md "Native reads"), else in Python; a block that
fails is moved to ``<root>/quarantine/`` and reported CORRUPT. With ``o_direct`` reads bypass
the page cache through a page-aligned per-thread bounce buffer (caller views are rarely
4 KiB-aligned); writes stay buffered — they are fsynced before the rename either way.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import mmap
import os
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

import structlog

from common.errors import StorageError
from common.kv import KVSpec
from common.shm import pid_alive
from storage_gateway.backends import ReadStatus, ScanResult, run_io
from storage_gateway.block_format import (HEADER_SIZE, HEADER_USED, QUARANTINE_DIR, TEMP_PREFIX, BadHeader,
                                          BlockHeader, block_relpath, decode_header, encode_header,
                                          host_tag, is_shard_name, key_of_block_name, parse_temp_name,
                                          payload_checksum, payload_hasher, temp_name)
from storage_gateway.destinations import ArenaRuns, Destination, as_views

try:  # compiled by the install where a C compiler is present (setup.py, storage_gateway/native)
    from storage_gateway import _blockread
except ImportError:
    _blockread = None  # type: ignore[assignment]

log = structlog.get_logger(__name__)

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
ALIGN = 4096
# A buffered read copies and hashes a block this many bytes at a time, so the hash reads each
# piece while the copy has just left it in the core's L2 (2 MiB here) instead of from memory:
# 0.247 → 0.201 CPU-s/GB for 2.56 MB DeepSeek blocks into a 120 MB shared-memory arena
# (pread alone 0.161); 128 KiB measured the same, 1 MiB 0.222 (docs/storage.md).
READ_CHUNK = 256 << 10
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RDONLY = os.O_RDONLY | _CLOEXEC | getattr(os, "O_NOFOLLOW", 0)   # a planted symlink is not followed


def preadv_all(fd: int, bufs: Sequence[memoryview], offset: int) -> int:
    """Fill ``bufs`` from ``offset`` on (short reads resumed, ≤ IOV_MAX per call); bytes read."""
    pending = [b for b in bufs if len(b)]
    i = total = 0
    while i < len(pending):
        n = os.preadv(fd, pending[i:i + IOV_MAX], offset + total)
        if n <= 0:
            break  # end of file: the caller compares the total with what it expected
        total += n
        i = _advance(pending, i, n)
    return total


def writev_all(fd: int, bufs: Sequence[memoryview]) -> None:
    """Write all of ``bufs`` at the file position, resuming short writes."""
    pending = [b for b in bufs if len(b)]
    i = 0
    while i < len(pending):
        n = os.writev(fd, pending[i:i + IOV_MAX])
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        i = _advance(pending, i, n)


def read_chunks(views: Sequence[memoryview], chunk: int = READ_CHUNK) -> list[list[memoryview]]:
    """``views`` regrouped, in order, into runs of about ``chunk`` bytes (long views split).

    Each run is one ``preadv`` followed by hashing what it read. A run may reach up to twice
    ``chunk``; zero-length views are dropped.
    """
    runs: list[list[memoryview]] = []
    run: list[memoryview] = []
    size = 0
    for v in views:
        for off in range(0, len(v), chunk):
            piece = v if len(v) <= chunk else v[off:off + chunk]
            run.append(piece)
            size += len(piece)
            if size >= chunk:
                runs.append(run)
                run, size = [], 0
    if run:
        runs.append(run)
    return runs


def _update_prefix(hasher, bufs: Sequence[memoryview], n: int) -> None:
    """Hash the first ``n`` bytes of the concatenation of ``bufs``."""
    for b in bufs:
        if n <= 0:
            return
        hasher.update(b if len(b) <= n else b[:n])
        n -= len(b)


def _advance(pending: list[memoryview], i: int, n: int) -> int:
    while n > 0:
        if n >= len(pending[i]):
            n -= len(pending[i])
            i += 1
        else:
            pending[i] = pending[i][n:]
            n = 0
    return i


def _pread_direct(fd: int, buf: memoryview) -> int:
    """O_DIRECT read of a whole file into an aligned buffer; offsets stay 4 KiB multiples."""
    total = 0
    while total < len(buf):
        n = os.preadv(fd, [buf[total:]], total)
        if n <= 0:
            break
        total += n
        if n % ALIGN:
            break  # the file ended inside this page
    return total


def _unlink_quiet(path: str) -> bool:
    """Remove ``path``; False if it could not be (gone already: another gateway on the same
    shared root removed it first)."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsBackend:
    """Full Blocks as files under ``root``; every blocking call runs in ``executor``."""

    name = "fs"

    def __init__(self, root: str | os.PathLike[str], spec: KVSpec, executor: Executor, *,
                 o_direct: bool = False, verify_headers_on_scan: bool = True,
                 temp_max_age_s: float = 3600.0, hostname: str | None = None,
                 native_reads: bool = True):
        self.root = os.path.abspath(os.fspath(root))
        self.quarantine_dir = os.path.join(self.root, QUARANTINE_DIR)
        self.spec = spec
        self.fingerprint = spec.fingerprint()
        self.block_bytes = spec.full_block_bytes
        self.stored_bytes = HEADER_SIZE + self.block_bytes
        self.o_direct_requested = o_direct
        self.o_direct = False                      # decided by the probe in open()
        self.verify_headers_on_scan = verify_headers_on_scan
        self.temp_max_age_s = temp_max_age_s
        self.host = host_tag(hostname or socket.gethostname())
        self.pid = os.getpid()
        self._executor = executor
        self.read_chunk = READ_CHUNK               # bytes copied, then hashed, per step of a read
        # buffered reads in one GIL-free call (open, every step's preadv + hash, close), not
        # a GIL hand-off per step: what a core shared with the event loop runs short of
        self.native_reads = native_reads and _blockread is not None
        if native_reads and _blockread is None:
            log.warning("native_reads_unavailable",
                        reason="storage_gateway._blockread was not built (no C compiler at "
                               "install?): reads take the Python path")
        # probes answer LookupPrefix (the scheduler's hit lookup, a 1 s budget): on their own
        # thread, never queued behind the bulk reads and writes of ``executor`` (seen: three
        # lookups timed out behind 50 MB hit reads, their turns planned hit 0 and recomputed)
        self._probe_executor = ThreadPoolExecutor(1, thread_name_prefix="gateway-probe")
        self._seq = itertools.count()
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._stats = {"checksum_failures": 0, "quarantined": 0, "temp_files_cleaned": 0,
                       "foreign_blocks": 0, "read_io_errors": 0, "delete_errors": 0}

    def path_for(self, key: str) -> str:
        """The file of ``key`` (validated here: a key never becomes an arbitrary path)."""
        return os.path.join(self.root, block_relpath(key))

    def _path(self, key: str) -> str:
        # Keys reaching the backend were validated by the store; skip the regex per block.
        return f"{self.root}/{key[0:2]}/{key[2:4]}/{key}.kvb"

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "o_direct": int(self.o_direct),
                    "native_reads": int(self.native_reads)}

    # ------------------------------------------------------------------ open / scan
    async def open(self) -> ScanResult:
        await run_io(self._executor, self._prepare)
        tops = await run_io(self._executor, self._shard_dirs, self.root)
        parts = await asyncio.gather(*(run_io(self._executor, self._scan_top, t) for t in tops))
        result = ScanResult()
        for part in parts:
            result.merge(part)
        self._count("temp_files_cleaned", result.temp_cleaned)
        self._count("quarantined", result.quarantined)
        self._count("foreign_blocks", result.foreign)
        return result

    def _prepare(self) -> None:
        try:
            os.makedirs(self.quarantine_dir, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create storage root {self.root}: {e.strerror} — check "
                               "gateway.root and its permissions") from e
        if self.o_direct_requested:
            self.o_direct = self._probe_direct()

    def _probe_direct(self) -> bool:
        if not _O_DIRECT:
            log.warning("o_direct_unavailable", root=self.root, reason="platform has no O_DIRECT")
            return False
        path = os.path.join(self.root, f".odirect-probe-{self.host}-{self.pid}")
        try:
            with open(path, "wb") as f:
                f.write(b"\0" * ALIGN)
            fd = os.open(path, os.O_RDONLY | _O_DIRECT | _CLOEXEC)
            try:
                os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)
            finally:
                os.close(fd)
            return True
        except OSError as e:
            log.warning("o_direct_unavailable", root=self.root, reason=e.strerror,
                        fallback="buffered reads")
            return False
        finally:
            _unlink_quiet(path)

    @staticmethod
    def _shard_dirs(path: str) -> list[str]:
        with os.scandir(path) as it:
            return [e.path for e in it if is_shard_name(e.name) and e.is_dir(follow_symlinks=False)]

    def _scan_top(self, top: str) -> ScanResult:
        res = ScanResult()
        for sub in self._shard_dirs(top):
            with os.scandir(sub) as it:
                for entry in it:
                    self._scan_entry(entry, res)
        return res

    def _scan_entry(self, entry: os.DirEntry, res: ScanResult) -> None:
        if entry.name.startswith(TEMP_PREFIX):
            # counted only by the gateway whose unlink removed it: gateways sharing a root
            # scan it at once at a cluster start, and both saw the same file (once: 3 counted
            # for 2 torn files, tests/test_durability.py)
            if self._stale_temp(entry) and _unlink_quiet(entry.path):
                res.temp_cleaned += 1
            return
        key = key_of_block_name(entry.name)
        if key is None or not entry.is_file(follow_symlinks=False):
            return
        try:
            status, reason, mtime_ns = self._check_file(entry.path, key)
        except OSError:
            log.exception("block_scan_failed", key=key, path=entry.path)
            return
        if status is ReadStatus.OK:
            res.blocks.append((mtime_ns, key))
        elif status is ReadStatus.FOREIGN:
            res.foreign += 1
        elif status is ReadStatus.CORRUPT and self._quarantine(entry.path, key, reason, count=False):
            res.quarantined += 1

    def _stale_temp(self, entry: os.DirEntry) -> bool:
        """Ours from a dead process, or anyone's older than ``temp_max_age_s`` (shared FS)."""
        parsed = parse_temp_name(entry.name)
        if parsed and parsed[1] == self.host and parsed[2] != self.pid and not pid_alive(parsed[2]):
            return True
        try:
            return time.time() - entry.stat(follow_symlinks=False).st_mtime >= self.temp_max_age_s
        except FileNotFoundError:
            return False

    def _check_file(self, path: str, key: str) -> tuple[ReadStatus, str, int]:
        try:
            fd = os.open(path, _RDONLY)
        except FileNotFoundError:
            return ReadStatus.MISSING, "gone", 0
        try:
            st = os.fstat(fd)
            head = os.pread(fd, HEADER_USED, 0) if self.verify_headers_on_scan else None
        finally:
            os.close(fd)
        if head is None:
            ok = st.st_size == self.stored_bytes
            return (ReadStatus.OK if ok else ReadStatus.FOREIGN), "size", st.st_mtime_ns
        status, reason, _ = self._judge(head, key)
        if status is ReadStatus.OK and st.st_size != self.stored_bytes:
            status, reason = ReadStatus.CORRUPT, f"file is {st.st_size} B, expected {self.stored_bytes}"
        return status, reason, st.st_mtime_ns

    def _judge(self, head, key: str) -> tuple[ReadStatus, str, BlockHeader | None]:
        try:
            h = decode_header(head)
        except BadHeader as e:
            return ReadStatus.CORRUPT, str(e), None
        if h.key != key:
            return ReadStatus.CORRUPT, f"header names block {h.key}", None
        if h.fingerprint != self.fingerprint:
            return ReadStatus.FOREIGN, f"kv fingerprint {h.fingerprint}", None
        if h.payload_len != self.block_bytes:
            return ReadStatus.CORRUPT, f"payload_len {h.payload_len} != {self.block_bytes}", None
        return ReadStatus.OK, "", h

    def _quarantine(self, path: str, key: str, reason: str, count: bool = True) -> bool:
        dest = os.path.join(self.quarantine_dir, f"{key}.{time.time_ns()}.kvb")
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return False  # another reader (or node) moved it first
        except OSError:
            log.exception("block_quarantine_failed", key=key, path=path)
            _unlink_quiet(path)
        if count:
            self._count("quarantined")
        log.warning("block_quarantined", key=key, reason=reason, moved_to=dest)
        return True

    # ------------------------------------------------------------------ reads
    async def read(self, keys: Sequence[str],
                   dests: Sequence[Destination]) -> list[ReadStatus]:
        return await run_io(self._executor, self._read_batch, keys, dests)

    def _read_batch(self, keys, dests) -> list[ReadStatus]:
        return [self._read_one(k, d) for k, d in zip(keys, dests)]

    def _read_one(self, key: str, dest: Destination) -> ReadStatus:
        path = self._path(key)
        direct = self.o_direct
        if self.native_reads and not direct:
            return self._read_native(key, path, dest)
        views = as_views(dest)
        try:
            fd = os.open(path, _RDONLY | (_O_DIRECT if direct else 0))
        except FileNotFoundError:
            return ReadStatus.MISSING
        except OSError:
            return self._io_error(key, path)
        try:
            status, reason = (self._read_direct if direct else self._read_buffered)(fd, key, views)
        except OSError:
            return self._io_error(key, path)
        finally:
            os.close(fd)
        return self._settle(key, path, status, reason)

    def _settle(self, key: str, path: str, status: ReadStatus, reason: str) -> ReadStatus:
        if status is ReadStatus.CORRUPT:
            self._count("checksum_failures")
            self._quarantine(path, key, reason)
        elif status is ReadStatus.FOREIGN:
            self._count("foreign_blocks")
        return status

    def _read_native(self, key: str, path: str, dest: Destination) -> ReadStatus:
        # The whole file in one call without the GIL (storage_gateway/native/blockread.c),
        # then the same judgement as _read_buffered: the header, the payload's size and xxh3.
        # Unlike that path the rest of a block whose header is bad is read too (into slots
        # that are then not reported read): bad blocks are rare, the GIL hand-offs are not.
        # ArenaRuns go in as arena + runs: no view per run (per layer) is made.
        head = self._header_buf()
        try:
            if isinstance(dest, ArenaRuns):
                head_n, got, checksum = _blockread.read_block_runs(
                    path, _RDONLY, head, dest.arena, dest.offsets, dest.lengths, self.read_chunk)
            else:
                head_n, got, checksum = _blockread.read_block(path, _RDONLY, head, dest,
                                                              self.read_chunk)
        except FileNotFoundError:
            return ReadStatus.MISSING
        except OSError:
            return self._io_error(key, path)
        if head_n < HEADER_SIZE:
            return self._settle(key, path, ReadStatus.CORRUPT, "truncated header")
        status, reason, h = self._judge(head, key)
        if h is not None:               # OK so far: _judge gives the header only when it is
            status, reason = self._check_payload(h, got, checksum)
        return self._settle(key, path, status, reason)

    def _read_buffered(self, fd: int, key: str, views: Sequence[memoryview]) -> tuple[ReadStatus, str]:
        # The header comes with the first chunk; each chunk is hashed right after its copy
        # (READ_CHUNK: while it is still in cache). A short read ends the loop: the payload
        # size check then reports it.
        head = self._header_buf()
        chunks = read_chunks(views, self.read_chunk)
        first = chunks[0] if chunks else []
        n = preadv_all(fd, [head, *first], 0)
        if n < HEADER_SIZE:
            return ReadStatus.CORRUPT, "truncated header"
        status, reason, h = self._judge(head, key)
        if h is None:                   # not OK: _judge gives the header only when it is
            return status, reason
        hasher = payload_hasher()
        got = n - HEADER_SIZE
        _update_prefix(hasher, first, got)
        expected = sum(len(b) for b in first)
        for chunk in chunks[1:]:
            if got < expected:
                break
            n = preadv_all(fd, chunk, HEADER_SIZE + got)
            _update_prefix(hasher, chunk, n)
            got += n
            expected += sum(len(b) for b in chunk)
        return self._check_payload(h, got, hasher.intdigest())

    def _read_direct(self, fd: int, key: str, views: Sequence[memoryview]) -> tuple[ReadStatus, str]:
        buf = self._bounce()
        n = _pread_direct(fd, buf)
        if n < HEADER_SIZE:
            return ReadStatus.CORRUPT, "truncated header"
        status, reason, h = self._judge(buf[:HEADER_SIZE], key)
        if h is None:                   # not OK: _judge gives the header only when it is
            return status, reason
        payload = buf[HEADER_SIZE:self.stored_bytes]
        status, reason = self._check_payload(h, n - HEADER_SIZE, payload_checksum([payload]))
        if status is ReadStatus.OK:
            self._scatter(payload, views)
        return status, reason

    def _check_payload(self, h: BlockHeader, n: int, checksum: int) -> tuple[ReadStatus, str]:
        if n != self.block_bytes:
            return ReadStatus.CORRUPT, f"payload is {n} B, expected {self.block_bytes}"
        if checksum != h.payload_checksum:
            return ReadStatus.CORRUPT, "payload checksum mismatch"
        return ReadStatus.OK, ""

    @staticmethod
    def _scatter(src: memoryview, views: Sequence[memoryview]) -> None:
        pos = 0
        for v in views:
            v[:] = src[pos:pos + len(v)]
            pos += len(v)

    def _io_error(self, key: str, path: str) -> ReadStatus:
        self._count("read_io_errors")
        log.exception("block_read_failed", key=key, path=path)
        return ReadStatus.ERROR

    def _header_buf(self) -> memoryview:
        buf = getattr(self._tls, "header", None)
        if buf is None:
            buf = self._tls.header = memoryview(bytearray(HEADER_SIZE))
        return buf

    def _bounce(self) -> memoryview:
        """Page-aligned per-thread buffer for O_DIRECT (mmap memory is page-aligned)."""
        buf = getattr(self._tls, "bounce", None)
        if buf is None:
            size = -(-self.stored_bytes // ALIGN) * ALIGN
            self._tls.bounce_map = mmap.mmap(-1, size)
            buf = self._tls.bounce = memoryview(self._tls.bounce_map)
        return buf

    # ------------------------------------------------------------------ writes
    async def write(self, key: str, payload: Sequence[memoryview]) -> None:
        await run_io(self._executor, self._write_sync, key, payload)

    def _write_sync(self, key: str, payload: Sequence[memoryview]) -> None:
        final = self.path_for(key)
        d = os.path.dirname(final)
        tmp = os.path.join(d, temp_name(key, self.host, self.pid, next(self._seq)))
        try:
            self._ensure_dir(d)
            header = encode_header(key, self.fingerprint, self.block_bytes, payload_checksum(payload))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
            try:
                writev_all(fd, [memoryview(header), *payload])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            _fsync_dir(d)
        except OSError as e:
            _unlink_quiet(tmp)
            raise StorageError(self._write_error(key, final, e)) from e

    def _write_error(self, key: str, path: str, e: OSError) -> str:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"disk full writing block {key} under {self.root} ({e.strerror}): nothing was "
                    "stored — free space, or set gateway.capacity_bytes below the free space so "
                    "eviction keeps room")
        return f"writing block {key} to {path} failed: {e.strerror} (errno {e.errno}); nothing was stored"

    def _ensure_dir(self, d: str) -> None:
        """Create the block's shard directories; a new directory entry is fsynced in its parent."""
        top = os.path.dirname(d)
        for path, parent in ((top, self.root), (d, top)):
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            _fsync_dir(parent)

    # ------------------------------------------------------------------ delete / probe
    async def delete(self, keys: Sequence[str]) -> int:
        return await run_io(self._executor, self._delete_sync, list(keys))

    def _delete_sync(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            try:
                os.unlink(self.path_for(key))
                n += 1
            except FileNotFoundError:
                pass
            except OSError:
                self._count("delete_errors")
                log.exception("block_delete_failed", key=key)
        return n

    async def probe(self, keys: Sequence[str]) -> list[bool]:
        return await run_io(self._probe_executor, self._probe_sync, list(keys))

    def _probe_sync(self, keys: list[str]) -> list[bool]:
        out = []
        for key in keys:
            try:
                status, _, _ = self._check_file(self.path_for(key), key)
            except OSError:
                status = ReadStatus.ERROR
            out.append(status is ReadStatus.OK)
        return out

    async def close(self) -> None:
        """Nothing is held open between calls but the probe thread."""
        self._probe_executor.shutdown(wait=False)
