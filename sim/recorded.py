"""Recorded workloads read into one shape: a :class:`Workload` of sessions and turns.

Sources (docs/workloads.md has the formats and every mapping rule):

* **Agentic conversations** (``../shared/traces/agentic/``): one JSON object per file with a
  ``requests`` list; ``hash_ids`` are 64-token prefix hashes with file-local scope; ``t`` /
  ``think_time`` are kept; ``"type": "subagent"`` entries nest their own ``requests`` and run as
  concurrent sessions that block their parent (:class:`Subagent`).
* **Mooncake JSONL** (``../shared/traces/conversation_trace.jsonl``): one request per line,
  512-token prefix hashes with one global scope; every request is a one-turn session arriving at
  its ``timestamp``.
* **The paper's Table 2 generator** lives in ``sim.workload`` (pure arithmetic, compiled);
  ``sim.table2_trace`` turns it into a :class:`Workload` (``--trace table2:64k``), and the
  simulator keeps the lazy generator for paper-scale runs.

Why in ``sim``: the simulator, the planner and the live replay (``tools.replay``, one layer up)
read the same sessions, and no service reads a workload, so the floor (``common``) does not hold
it. Importing it runs ``sim``'s package init, which loads the compiled build only when one
matches the sources and no scheduler module was imported before (``sim/accel.py``).

Bad input never becomes a partial trace: every problem raises :class:`TraceError` naming the file
and the request index (``trace_0012.json: request 7: ...``), and nothing is returned.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from common.errors import InvalidArgument
from common.kv import ROOT_KEY, chain_key

AGENTIC_BLOCK_TOKENS = 64          # agentic/README.md: one hash id per 64-token block
MOONCAKE_BLOCK_TOKENS = 512        # traces/README.md: one hash id per 512-token block
FORMATS = ("agentic", "mooncake")


SHARED_ENV = "DUALPATH_SHARED_DIR"


def shared_dir() -> Path:
    """The shared data folder: ``$DUALPATH_SHARED_DIR``, else ``../shared`` beside the repo root
    (where CI puts it, read-only)."""
    env = os.environ.get(SHARED_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared"


def shared_agentic_dir() -> Path:
    """The 71 real agentic conversations (``shared/traces/agentic``); may not exist."""
    return shared_dir() / "traces" / "agentic"


class TraceError(InvalidArgument):
    """A trace that cannot be used as it is: names the file and, where known, the request."""

    def __init__(self, path: str | Path, message: str, index: int | str | None = None) -> None:
        where = f"{path}: request {index}: " if index is not None else f"{path}: "
        super().__init__(where + message)
        self.path = str(path)
        self.index = index


class Turn(msgspec.Struct, frozen=True):
    """One request of a session: its arrival offset, pause, sizes and prefix hashes."""

    index: int                      # position in its requests list (a sub-agent's: in its own)
    t_s: float                      # offset from the session's start in the trace (seconds)
    think_s: float                  # the client's pause before this request (seconds)
    prompt_tokens: int
    gen_tokens: int
    hash_ids: tuple[int, ...]       # one prefix hash per trace block (last one may be partial)
    # blocks the generated tokens complete (stored by the write-back, so a later turn may hit
    # them); only a generated trace knows them (table2:, sim.table2_trace), recorded ones do not
    gen_hash_ids: tuple[int, ...] = ()


class Subagent(msgspec.Struct, frozen=True):
    """A nested conversation started before the parent's turn ``before`` (== len: after its
    last turn); the parent waits until every sub-agent started there is done."""

    before: int
    session: Session


class Session(msgspec.Struct, frozen=True):
    """One conversation. ``scope`` names its hash-id space: sessions with the same scope share
    keys (a file's sub-agents; all of a Mooncake trace), different scopes never do."""

    sid: str
    scope: str
    source: str
    start_s: float                  # arrival in the trace (Mooncake timestamp; 0 for agentic)
    turns: tuple[Turn, ...]
    subagents: tuple[Subagent, ...] = ()

    def walk(self) -> Iterable[Session]:
        """This session and its sub-agents, depth first."""
        yield self
        for s in self.subagents:
            yield from s.session.walk()


class Workload(msgspec.Struct, frozen=True):
    """Top-level sessions of one source; ``block_tokens`` is the trace's hash block."""

    name: str
    fmt: str
    block_tokens: int
    sessions: tuple[Session, ...]

    def all_sessions(self) -> list[Session]:
        return [s for top in self.sessions for s in top.walk()]

    def requests(self) -> int:
        return sum(len(s.turns) for s in self.all_sessions())

    def subset(self, n: int | None) -> Workload:
        """The first ``n`` top-level sessions (an explicit, recorded choice: ``name`` says so)."""
        if n is None or n >= len(self.sessions):
            return self
        if n < 1:
            raise InvalidArgument(f"need at least one session, got {n}")
        return msgspec.structs.replace(self, name=f"{self.name} (first {n} of {len(self.sessions)})",
                                       sessions=self.sessions[:n])

    def repeated(self, n: int) -> Workload:
        """``n`` copies of every session, each copy in its own key space (``scope`` suffixed)."""
        if n < 1:
            raise InvalidArgument(f"--repeat must be >= 1, got {n}")
        if n == 1:
            return self
        out = tuple(_copy(s, k) for k in range(n) for s in self.sessions)
        return msgspec.structs.replace(self, name=f"{self.name} x{n}", sessions=out)


def _copy(s: Session, k: int) -> Session:
    subs = tuple(Subagent(x.before, _copy(x.session, k)) for x in s.subagents)
    return msgspec.structs.replace(s, sid=f"{s.sid}#{k}", scope=f"{s.scope}#{k}", subagents=subs)


# --------------------------------------------------------------------------- loading

def detect_format(path: Path) -> str:
    """``agentic`` (a directory, or a file holding one JSON object) or ``mooncake`` (JSONL)."""
    if path.is_dir():
        return "agentic"
    if not path.is_file():
        raise TraceError(path, "no such file or directory")
    with path.open("rb") as f:
        head = f.read(1 << 16)
    first = head.lstrip().split(b"\n", 1)[0]
    try:
        obj = json.loads(first)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and "timestamp" in obj:
        return "mooncake"
    if head.lstrip().startswith(b"{"):
        return "agentic"
    raise TraceError(path, f"not a trace in a known format ({', '.join(FORMATS)}; docs/workloads.md)")


def load_workload(path: str | Path, fmt: str | None = None) -> Workload:
    """Every session of the trace at ``path`` (a file or a directory of agentic files)."""
    p = Path(path)
    fmt = fmt or detect_format(p)
    if fmt == "mooncake":
        return load_mooncake(p)
    if fmt != "agentic":
        raise TraceError(p, f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise TraceError(p, "no *.json conversation files in this directory")
    sessions = tuple(load_conversation(f) for f in files)
    return Workload(p.name, "agentic", AGENTIC_BLOCK_TOKENS, sessions)


def load_conversation(path: Path) -> Session:
    """One agentic conversation file (its sub-agents nested)."""
    try:
        doc = msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError) as e:
        raise TraceError(path, f"not a JSON document: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceError(path, "not an agentic conversation (a JSON object with a 'requests' list)")
    bt = doc.get("block_size", AGENTIC_BLOCK_TOKENS)
    if bt != AGENTIC_BLOCK_TOKENS:
        raise TraceError(path, f"block_size {bt!r} unsupported (hash ids are per "
                               f"{AGENTIC_BLOCK_TOKENS}-token block)")
    sid = str(doc.get("id") or path.stem)
    checker = PrefixChecker(path)
    return _session(path, sid, sid, doc["requests"], checker, "")


def _session(path: Path, sid: str, scope: str, reqs: list, checker: PrefixChecker,
             where: str) -> Session:
    """``where``: the parent's request index path (``"4 > "`` inside the sub-agent at 4)."""
    turns: list[Turn] = []
    subs: list[Subagent] = []
    last_t = 0.0
    for i, r in enumerate(reqs):
        idx = f"{where}{i}"
        if isinstance(r, dict) and r.get("type") == "subagent":
            inner = r.get("requests")
            if not isinstance(inner, list) or not inner:
                raise TraceError(path, "sub-agent entry without a 'requests' list", idx)
            child = _session(path, f"{sid}/sub{len(subs)}", scope, inner, checker, f"{idx} > ")
            subs.append(Subagent(len(turns), child))
            continue
        turn = agentic_turn(path, i, r, checker, idx)
        if turn.t_s < last_t:
            raise TraceError(path, f"time t={turn.t_s} goes back (previous request at t={last_t})", idx)
        last_t = turn.t_s
        turns.append(turn)
    return Session(sid, scope, str(path), 0.0, tuple(turns), tuple(subs))


def agentic_turn(path: Path, i: int, r: Any, checker: PrefixChecker, idx: str) -> Turn:
    if not isinstance(r, dict):
        raise TraceError(path, "a request must be a JSON object", idx)
    prompt = _count(path, idx, r, "in")
    gen = _count(path, idx, r, "out")
    t = _time(path, idx, r, "t", required=True)
    think = _time(path, idx, r, "think_time", required=False)
    ids = checker.check(idx, r.get("hash_ids"), prompt, AGENTIC_BLOCK_TOKENS)
    return Turn(i, t, think, prompt, gen, ids)


def load_mooncake(path: Path) -> Workload:
    """A Mooncake JSONL trace: one one-turn session per request, all in one key scope."""
    checker = PrefixChecker(path)
    sessions: list[Session] = []
    last = 0.0
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(path, f"cannot read: {e}") from None
    for idx, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError as e:
            raise TraceError(path, f"not JSON: {e}", idx) from None
        if not isinstance(r, dict):
            raise TraceError(path, "a request must be a JSON object", idx)
        ts = _time(path, idx, r, "timestamp", required=True) / 1000.0
        if ts < last:
            raise TraceError(path, f"timestamp {ts * 1000:g} ms goes back (previous {last * 1000:g})", idx)
        last = ts
        prompt = _count(path, idx, r, "input_length")
        gen = _count(path, idx, r, "output_length")
        ids = checker.check(idx, r.get("hash_ids"), prompt, MOONCAKE_BLOCK_TOKENS)
        turn = Turn(idx, 0.0, 0.0, prompt, gen, ids)
        sessions.append(Session(f"req{idx}", path.name, str(path), ts, (turn,)))
    if not sessions:
        raise TraceError(path, "empty trace (no requests)")
    return Workload(path.name, "mooncake", MOONCAKE_BLOCK_TOKENS, tuple(sessions))


def _count(path: Path, idx: int | str, r: dict, key: str) -> int:
    v = r.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(path, f"{key!r} must be a non-negative integer, got {v!r}", idx)
    return v


def _time(path: Path, idx: int | str, r: dict, key: str, *, required: bool) -> float:
    v = r.get(key)
    if v is None and not required:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise TraceError(path, f"{key!r} must be a non-negative number, got {v!r}", idx)
    return float(v)


class PrefixChecker:
    """Checks that hash ids are prefix hashes: an id always sits at the same position behind
    the same parent id (equal id = equal prefix). One per key scope."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: dict[int, tuple[int, int]] = {}
        self.prev: list = []

    def check(self, idx: int | str, ids: Any, prompt: int, block: int) -> tuple[int, ...]:
        if not isinstance(ids, list):
            raise TraceError(self.path, "missing 'hash_ids' (a list of block hashes)", idx)
        lo, hi = prompt // block, -(-prompt // block)
        if not lo <= len(ids) <= hi:
            raise TraceError(self.path, f"{len(ids)} hash_ids for {prompt} tokens (need "
                                        f"{lo}..{hi} of {block} tokens)", idx)
        # positions equal to the previous request's were checked with it (same id, same
        # parent): skip that common prefix, found by slice comparisons (C speed) — agentic
        # turns re-send ~96 % of the previous prompt's blocks
        start = _common_prefix(ids, self.prev)
        self.prev = ids
        parent = ids[start - 1] if start else -1
        seen = self.seen
        for pos in range(start, len(ids)):
            h = ids[pos]
            if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                raise TraceError(self.path, f"hash_ids[{pos}] = {h!r} is not a non-negative integer", idx)
            was = seen.get(h)
            if was is None:
                seen[h] = (pos, parent)
            elif was != (pos, parent):
                raise TraceError(self.path, f"hash_ids[{pos}] = {h} is not prefix-consistent (seen "
                                            f"before at position {was[0]} after id {was[1]})", idx)
            parent = h
        return tuple(ids)


def _common_prefix(a: list, b: list) -> int:
    """Length of the longest common prefix of two lists of ints (numpy, C speed)."""
    m = min(len(a), len(b))
    if not m:
        return 0
    try:
        diff = np.asarray(a[:m], dtype=np.int64) != np.asarray(b[:m], dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return 0                      # not plain ints: the per-id check names the bad one
    return int(diff.argmax()) if diff.any() else m


# --------------------------------------------------------------------------- hits and keys

def prefix_hit_blocks(ids: Sequence[int], stored: set[int]) -> int:
    """Leading trace blocks whose hash was stored by an earlier request of the same scope."""
    n = 0
    for h in ids:
        if h not in stored:
            break
        n += 1
    return n


def session_order(top: Session) -> list[Session]:
    """The order hits are computed in: a parent's turns up to a spawn point, then its sub-agents
    (in file order), then the parent again — the order the file lists them."""
    return list(top.walk())


def scope_hits(sessions: Iterable[Session], block_tokens: int) -> dict[tuple[str, int], int]:
    """Hit tokens (trace-block granularity, capped at the prompt) of every turn, keyed by
    (sid, turn position), with one stored-id set per scope, in the given order."""
    stored: dict[str, set[int]] = {}
    out: dict[tuple[str, int], int] = {}
    for s in sessions:
        st = stored.setdefault(s.scope, set())
        for k, t in enumerate(s.turns):
            out[(s.sid, k)] = min(prefix_hit_blocks(t.hash_ids, st) * block_tokens, t.prompt_tokens)
            st.update(t.hash_ids)
            st.update(t.gen_hash_ids)
    return out


def cluster_hit(trace_hit_tokens: int, prompt_tokens: int, block_tokens: int) -> int:
    """A trace hit mapped to whole cluster blocks, leaving at least one token to prefill."""
    hit = min(trace_hit_tokens, prompt_tokens - 1)
    return max(hit, 0) // block_tokens * block_tokens


def block_mapping(trace_block: int, block_tokens: int) -> tuple[int, int]:
    """(sub-blocks per trace block, trace blocks per cluster block): one of them is 1."""
    if trace_block % block_tokens == 0:
        return trace_block // block_tokens, 1
    if block_tokens % trace_block == 0:
        return 1, block_tokens // trace_block
    raise InvalidArgument(f"a {block_tokens}-token cluster block cannot map onto {trace_block}-token "
                          "trace blocks (one must divide the other)")


def block_keys(ids: Sequence[int], prompt_tokens: int, trace_block: int, block_tokens: int,
               namespace: str) -> list[str]:
    """Chained storage keys of the prompt's full cluster blocks.

    A trace block larger than a cluster block expands into ``trace/block`` sub-blocks keyed by
    ``(id, k)``; a smaller one is grouped, ``block/trace`` ids per key. Keys chain from a root
    that hashes ``namespace``, so two scopes (two files, two ``--repeat`` copies) never share one.
    """
    per, group = block_mapping(trace_block, block_tokens)
    n = min(prompt_tokens // block_tokens, len(ids) * per // group)
    key = chain_key(ROOT_KEY, b"trace-scope:" + namespace.encode())
    keys = []
    for i in range(n):
        if group == 1:
            payload = struct.pack("<QI", ids[i // per], i % per)
        else:
            payload = struct.pack(f"<{group}Q", *ids[i * group:(i + 1) * group])
        key = chain_key(key, payload)
        keys.append(key)
    return keys


# --------------------------------------------------------------------------- writing

def dump_conversation(s: Session) -> dict:
    """The agentic file of one top-level session (inverse of :func:`load_conversation`)."""
    return {"id": s.sid, "block_size": AGENTIC_BLOCK_TOKENS, "hash_id_scope": "local",
            "requests": _dump_requests(s)}


def _dump_requests(s: Session) -> list[dict]:
    out: list[dict] = []
    subs = list(s.subagents)
    for k in range(len(s.turns) + 1):
        out += [{"type": "subagent", "requests": _dump_requests(x.session)} for x in subs
                if x.before == k]
        if k < len(s.turns):
            t = s.turns[k]
            out.append({"t": t.t_s, "type": "n", "in": t.prompt_tokens, "out": t.gen_tokens,
                        "hash_ids": list(t.hash_ids), "think_time": t.think_s})
    return out


def dump_mooncake(w: Workload) -> str:
    """JSONL of a Mooncake workload (inverse of :func:`load_mooncake`)."""
    lines = []
    for s in w.sessions:
        t = s.turns[0]
        lines.append(json.dumps({"timestamp": round(s.start_s * 1000), "input_length": t.prompt_tokens,
                                 "output_length": t.gen_tokens, "hash_ids": list(t.hash_ids)}))
    return "\n".join(lines) + "\n"
