"""Workloads: Table 2-shaped trajectories, prompt building / expected hits, Mooncake mapping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import InvalidArgument
from common.kv import block_keys_from_mooncake
from tests.helpers import skip_or_fail
from tools.replay.results import percentiles
from tools.replay.workloads import (AgenticSpec, AgenticWorkload, PromptBuilder, TraceSpec,
                                       load_mooncake)

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


def test_trajectories_are_deterministic_and_shaped_like_table_2():
    w = AgenticWorkload(AgenticSpec("64k", agents=200, seed=3))
    trajs = w.trajectories()
    assert [t.turns[3].append.tolist() for t in trajs[:3]] == \
        [t.turns[3].append.tolist() for t in AgenticWorkload(w.spec).trajectories()[:3]]
    real = [t for tr in trajs for t in tr.turns[1:]]
    turns = sum(len(t.turns) - 1 for t in trajs) / len(trajs)
    assert 0.85 * 157 < turns < 1.15 * 157
    gen = sum(t.gen for t in real) / len(real)
    assert 0.85 * 176 < gen < 1.15 * 176
    app = sum(len(t.append) for t in real) / len(real)
    assert 0.7 * 429 < app < 1.3 * 429          # heavy-tailed: a loose band
    assert all(tr.turns[0].gen == 1 and 64 <= len(tr.turns[0].append) <= 512 for tr in trajs)
    # synthetic first rounds: no two agents share a prefix
    assert len({tuple(tr.turns[0].append[:16]) for tr in trajs}) == len(trajs)


def test_scale_and_turn_cap():
    w = AgenticWorkload(AgenticSpec("32k", agents=4, scale=0.125, max_turns=5))
    assert w.max_len == 4096
    assert all(len(t.turns) == 6 for t in w.trajectories())   # synthetic + 5
    with pytest.raises(InvalidArgument):
        AgenticSpec("16k")


def test_prompts_grow_by_output_and_append_and_predict_hits():
    traj = AgenticWorkload(AgenticSpec("32k", agents=1, scale=0.125, max_turns=4)).trajectory(0)
    pb = PromptBuilder(traj, 64)
    p0, h0 = pb.prompt(0)
    assert h0 == 0 and p0 == traj.turns[0].append.tolist()
    out0 = [7]                                        # g_1 = 1
    pb.finished(0, p0, out0)
    p1, h1 = pb.prompt(1)
    assert p1 == p0 + out0 + traj.turns[1].append.tolist()
    assert h1 == min(len(p0) // 64 * 64, (len(p1) - 1) // 64 * 64)   # P + O[:-1] stored
    out1 = list(range(traj.turns[1].gen))
    pb.finished(1, p1, out1)
    p2, h2 = pb.prompt(2)
    assert p2[:len(p1) + len(out1)] == p1 + out1
    assert h2 == (len(p1) + len(out1) - 1) // 64 * 64


def test_compaction_goes_back_to_the_task_prompt():
    traj = AgenticWorkload(AgenticSpec("32k", agents=1, scale=0.0625)).trajectory(0)
    pb = PromptBuilder(traj, 64)
    out = None
    for k in range(len(traj.turns)):
        prompt, hit = pb.prompt(k)
        assert len(prompt) <= traj.max_len
        if k == 1:
            task = prompt
        if k > 1 and len(prompt) < len(task) + len(traj.turns[k].append) + 1:
            assert prompt[:len(task)] == task and hit == len(task) // 64 * 64
            return
        out = list(range(traj.turns[k].gen))
        pb.finished(k, prompt, out)
    pytest.fail("the trajectory never compacted")


def test_mooncake_requests_map_hash_ids_onto_our_keys(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1100, "output_length": 80, "hash_ids": [0, 1, 2]},
             {"timestamp": 3000, "input_length": 1600, "output_length": 8,
              "hash_ids": [0, 1, 5, 6]}]
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    full = load_mooncake(TraceSpec(str(f), scale=1.0, speed=2.0))
    assert [r.t_s for r in full] == [0.0, 1.5] and [r.index for r in full] == [0, 1]
    [later] = load_mooncake(TraceSpec(str(f), scale=1.0, speed=2.0, start_s=3.0))  # keeps its line
    assert (later.index, later.t_s, later.keys) == (1, 0.0, full[1].keys)
    assert full[0].keys == block_keys_from_mooncake([0, 1, 2], 1100)     # 17 x 64 tokens
    assert full[1].keys[:16] == full[0].keys[:16]                         # shared 2 trace blocks
    small = load_mooncake(TraceSpec(str(f), scale=0.125))
    assert small[0].prompt_tokens == 138 and len(small[0].keys) == 2 and small[0].gen_tokens == 10
    assert small[1].keys[:2] == small[0].keys[:2] and len(small[1].keys) == 3
    with pytest.raises(InvalidArgument, match="scale"):
        load_mooncake(TraceSpec(str(f), scale=0.3))


def test_the_conversation_trace_loads():
    if not TRACE.exists():
        skip_or_fail(f"the shared Mooncake trace is not present at {TRACE}")
    reqs = load_mooncake(TraceSpec(str(TRACE), limit=300, speed=10.0))
    assert len(reqs) == 300 and reqs == sorted(reqs, key=lambda r: r.t_s)
    assert all(len(r.keys) <= r.prompt_tokens // 64 for r in reqs)
    firsts = {r.keys[0] for r in reqs if r.keys}
    assert len(firsts) == 1                       # every trace request starts with hash id 0


def test_percentiles():
    p = percentiles([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (50.0, 90.0, 99.0, 50.5)
    assert percentiles([])["p50"] is None
