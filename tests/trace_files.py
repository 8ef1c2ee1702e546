"""Small synthetic trace files of each format (agentic with sub-agents, Mooncake) for tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import skip_or_fail


def need_shared(path: Path) -> None:
    """Skip (loudly) when the shared data is absent; under CI=true, where ../shared is always
    mounted beside the clone, fail instead: a green CI means the real traces were read."""
    if path.exists():
        return
    skip_or_fail(f"shared trace data not present at {path} (set DUALPATH_SHARED_DIR)")


def conversation(n_turns: int = 4, *, first: int = 300, append: int = 130, gen: int = 20,
                 think: float = 2.0, sub_at: int | None = 2, diverge_at: int | None = None) -> dict:
    """A prefix-consistent agentic conversation: every turn re-sends the previous prompt's blocks
    and appends ``append`` tokens; a sub-agent (two turns, its own prefix) before turn ``sub_at``;
    turn ``diverge_at`` starts a fresh prefix (as an agent's own compaction would)."""
    reqs: list[dict] = []
    ids: list[int] = []
    nxt = [1]

    def fresh(n: int) -> list[int]:
        out = list(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        return out

    tokens, t = first, 0.0
    for k in range(n_turns):
        if k == sub_at:
            sub_ids = fresh(3)
            reqs.append({"type": "subagent", "requests": [
                {"t": 0.0, "type": "n", "in": 200, "out": 10, "hash_ids": sub_ids},
                {"t": 1.0, "type": "s", "in": 330, "out": 12, "hash_ids": sub_ids + fresh(2),
                 "think_time": 1.0}]})
        if k == diverge_at:
            ids = []
        need = tokens // 64
        ids = ids[:need] + fresh(need - len(ids[:need]))
        reqs.append({"t": t, "type": "n", "in": tokens, "out": gen, "hash_ids": list(ids),
                     "think_time": think if k else 0.0})
        tokens += append
        t += 10.0
    return {"id": "conv", "block_size": 64, "hash_id_scope": "local", "requests": reqs}


def write_agentic(d: Path, n_files: int = 2, **kw) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        doc = conversation(**kw)
        doc["id"] = f"trace_{i:04d}"
        (d / f"trace_{i:04d}.json").write_text(json.dumps(doc))
    return d


def write_mooncake(path: Path) -> Path:
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 3000, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 3, 4]},
            {"timestamp": 3000, "input_length": 600, "output_length": 2, "hash_ids": [5, 6]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
