"""On-media format of one Full Block: a fixed-size header, then the payload.

File ``<root>/<k[0:2]>/<k[2:4]>/<key>.kvb``. The header occupies ``HEADER_SIZE`` bytes so the
payload starts at a known, 4 KiB-aligned offset: positioned reads (and ``O_DIRECT`` reads) go
straight to it. Header fields (little endian)::

    magic "DPKV" | version u16 | flags u16 | header_size u32 | kv fingerprint 8 B | key 16 B
    | payload_len u64 | payload xxh3_64 u64 | header xxh3_64 u64 (over the bytes before it)

The rest of the header is zero. Writers create ``.tmp-<key>-<host>-<pid>-<n>`` in the block's
directory, fsync, rename, fsync the directory: a ``.kvb`` name only ever holds a complete block.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

from common.errors import InvalidArgument
from common.kv import KEY_BYTES, validate_key

MAGIC = b"DPKV"
FORMAT_VERSION = 1
HEADER_SIZE = 4096          # a page: payload offset aligned for O_DIRECT
BLOCK_SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"
QUARANTINE_DIR = "quarantine"

_FIELDS = struct.Struct("<4sHHI8s16sQQ")
_HCHECK = struct.Struct("<Q")
HEADER_USED = _FIELDS.size + _HCHECK.size
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_HOST_RE = re.compile(r"[^A-Za-z0-9_.]")


class BadHeader(ValueError):
    """A block file whose header cannot be trusted (torn, foreign format, bit rot)."""


class BlockHeader(NamedTuple):
    version: int
    fingerprint: str
    key: str
    payload_len: int
    payload_checksum: int


def block_relpath(key: str) -> str:
    """Path of ``key``'s file relative to the root; the key is validated (never a path)."""
    validate_key(key)
    return f"{key[0:2]}/{key[2:4]}/{key}{BLOCK_SUFFIX}"


def is_shard_name(name: str) -> bool:
    return len(name) == 2 and _SHARD_RE.fullmatch(name) is not None


def key_of_block_name(name: str) -> str | None:
    """The key of a ``<key>.kvb`` file name, or None if the name is not a block file."""
    if not name.endswith(BLOCK_SUFFIX):
        return None
    key = name[:-len(BLOCK_SUFFIX)]
    try:
        return validate_key(key)
    except InvalidArgument:
        return None


def payload_hasher() -> xxhash.xxh3_64:
    """A streaming payload checksum: ``update`` piece by piece, then ``intdigest()``."""
    return xxhash.xxh3_64()


def payload_checksum(views: Sequence) -> int:
    """xxh3_64 over the concatenation of ``views`` (scattered payloads hash like one buffer)."""
    h = payload_hasher()
    for v in views:
        h.update(v)
    return h.intdigest()


def encode_header(key: str, fingerprint: str, payload_len: int, checksum: int) -> bytearray:
    """A full ``HEADER_SIZE`` header for one block."""
    out = bytearray(HEADER_SIZE)
    _FIELDS.pack_into(out, 0, MAGIC, FORMAT_VERSION, 0, HEADER_SIZE, bytes.fromhex(fingerprint),
                      bytes.fromhex(key), payload_len, checksum)
    _HCHECK.pack_into(out, _FIELDS.size, xxhash.xxh3_64_intdigest(bytes(out[:_FIELDS.size])))
    return out


def decode_header(buf) -> BlockHeader:
    """Parse and check a header (magic, version, size, header checksum); raise BadHeader."""
    mv = memoryview(buf)
    if len(mv) < HEADER_USED:
        raise BadHeader(f"header truncated: {len(mv)} B")
    magic, version, _flags, hsize, fp, key, plen, csum = _FIELDS.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadHeader(f"bad magic {magic!r}")
    (hcheck,) = _HCHECK.unpack_from(mv, _FIELDS.size)
    if hcheck != xxhash.xxh3_64_intdigest(mv[:_FIELDS.size]):
        raise BadHeader("header checksum mismatch")
    if version != FORMAT_VERSION or hsize != HEADER_SIZE:
        raise BadHeader(f"unsupported format version {version} / header size {hsize}")
    return BlockHeader(version, fp.hex(), key.hex(), plen, csum)


def host_tag(hostname: str) -> str:
    """Host name as it appears in temp file names (no '-' so names split unambiguously)."""
    return _HOST_RE.sub("_", hostname) or "host"


def temp_name(key: str, host: str, pid: int, n: int) -> str:
    return f"{TEMP_PREFIX}{key}-{host}-{pid}-{n}"


def parse_temp_name(name: str) -> tuple[str, str, int] | None:
    """``(key, host, pid)`` of a temp file name, or None when it is not one of ours."""
    if not name.startswith(TEMP_PREFIX):
        return None
    rest = name[len(TEMP_PREFIX):]
    key, sep, tail = rest[:2 * KEY_BYTES], rest[2 * KEY_BYTES:2 * KEY_BYTES + 1], rest[2 * KEY_BYTES + 1:]
    parts = tail.rsplit("-", 2)
    if sep != "-" or len(parts) != 3 or not parts[1].isdigit():
        return None
    return key, parts[0], int(parts[1])
