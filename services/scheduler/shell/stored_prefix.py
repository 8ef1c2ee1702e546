"""What each session's finished turns left in storage, to see when the next turn finds less.

A turn that finishes has written its prompt's and generated Full Blocks back (the DE loader's
write-back, docs/datapath.md); the next turn of the session should find them all. It finds
fewer when write-backs were still in flight as a DE died (``de_loader.finish_after_writeback
= false``: "finished" before the blocks were durable), or when storage lost or evicted them.
That is never wrong — the missing blocks are recomputed — but it costs prefill, so the
scheduler counts it (``hit_shortfalls``, ``hit_shortfall_tokens``), logs
``hit_shorter_than_stored`` and puts ``hit_shortfall_tokens`` in the request's records
(issue 16, item 4). Sans-I/O; bounded by session count (oldest out first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PromisedPrefixes:
    """Per session: the block keys its last finished turn stored."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    def finished(self, session_id: str, keys: Sequence[str]) -> None:
        self._keys.pop(session_id, None)
        self._keys[session_id] = tuple(keys)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def shortfall(self, session_id: str, keys: Sequence[str], found_blocks: int,
                  usable_blocks: int) -> int:
        """Blocks of ``keys`` an earlier turn stored (within the usable hit) that the lookup
        did not find: 0 when it found everything promised, or nothing was."""
        promised = self._keys.get(session_id)
        if not promised:
            return 0
        expected = 0
        for mine, stored in zip(keys, promised):
            if mine != stored:
                break
            expected += 1
        return max(0, min(expected, usable_blocks) - found_blocks)
