# Types of the compiled module storage_gateway/native/blockread.c (built by setup.py).
import os
from collections.abc import Sequence

from typing_extensions import Buffer

def read_block(path: str | bytes | os.PathLike[str], flags: int, head: Buffer,
               views: Sequence[Buffer], chunk: int) -> tuple[int, int, int]:
    """Read a block file into ``head`` + ``views`` without the GIL, hashing the payload (xxh3_64,
    ``chunk`` bytes per step); (head bytes read, payload bytes read, digest). OSError on failure."""

def read_block_runs(path: str | bytes | os.PathLike[str], flags: int, head: Buffer, arena: Buffer,
                    offsets: Sequence[int], lengths: Sequence[int],
                    chunk: int) -> tuple[int, int, int]:
    """``read_block`` into ``(offset, length)`` runs of one ``arena`` (each checked to lie in
    it; ValueError otherwise)."""
