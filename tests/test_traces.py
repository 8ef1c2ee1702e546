"""The trace layer (sim/recorded.py): loaders, round trips, hits from hash ids, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.recorded import (TraceError, Workload, block_keys, cluster_hit, dump_conversation,
                           dump_mooncake, load_workload, prefix_hit_blocks, scope_hits,
                           shared_agentic_dir)
from tests.trace_files import conversation, need_shared, write_agentic, write_mooncake

SHARED = shared_agentic_dir()


def test_agentic_loader_keeps_turns_times_and_subagents(tmp_path):
    w = load_workload(write_agentic(tmp_path / "conv", n_files=2))
    assert (w.fmt, w.block_tokens, len(w.sessions)) == ("agentic", 64, 2)
    s = w.sessions[0]
    assert [t.prompt_tokens for t in s.turns] == [300, 430, 560, 690]
    assert [t.think_s for t in s.turns] == [0.0, 2.0, 2.0, 2.0]
    assert [t.t_s for t in s.turns] == [0.0, 10.0, 20.0, 30.0]
    assert len(s.subagents) == 1 and s.subagents[0].before == 2
    sub = s.subagents[0].session
    assert sub.scope == s.scope and [t.prompt_tokens for t in sub.turns] == [200, 330]
    assert [t.index for t in s.turns] == [0, 1, 3, 4] and sub.turns[1].index == 1
    assert w.requests() == 12 and len(w.all_sessions()) == 4


def test_round_trips(tmp_path):
    w = load_workload(write_agentic(tmp_path / "a", n_files=1))
    again = tmp_path / "b"
    again.mkdir()
    (again / "trace_0000.json").write_text(json.dumps(dump_conversation(w.sessions[0])))
    w2 = load_workload(again)
    assert [dump_conversation(s) for s in w2.sessions] == [dump_conversation(s) for s in w.sessions]
    assert w2.sessions[0].turns == w.sessions[0].turns
    assert w2.sessions[0].subagents[0].session.turns == w.sessions[0].subagents[0].session.turns
    m = load_workload(write_mooncake(tmp_path / "m.jsonl"))
    assert m.fmt == "mooncake" and [s.start_s for s in m.sessions] == [0.0, 3.0, 3.0]
    (tmp_path / "m2.jsonl").write_text(dump_mooncake(m))
    m2 = load_workload(tmp_path / "m2.jsonl")
    assert [(s.sid, s.start_s, s.turns) for s in m2.sessions] == \
        [(s.sid, s.start_s, s.turns) for s in m.sessions]


def test_hits_come_straight_from_the_hash_ids(tmp_path):
    w = load_workload(write_agentic(tmp_path / "c", n_files=1, diverge_at=3))
    s = w.sessions[0]
    hits = scope_hits(s.walk(), 64)
    # straight from the ids: turn k re-sends turn k-1's blocks (all of them), except turn 3
    prev: set[int] = set()
    for k, t in enumerate(s.turns):
        n = 0
        while n < len(t.hash_ids) and t.hash_ids[n] in prev:
            n += 1
        assert hits[(s.sid, k)] == min(n * 64, t.prompt_tokens)
        prev |= set(t.hash_ids)
        if k == 2:   # the sub-agent ran before turn 2 in file order: its ids are in the scope
            prev |= {h for x in s.subagents for tt in x.session.turns for h in tt.hash_ids}
    assert hits[(s.sid, 1)] == 300 // 64 * 64 and hits[(s.sid, 3)] == 0
    assert prefix_hit_blocks([1, 2, 9, 3], {1, 2, 3}) == 2
    assert cluster_hit(640, 640, 128) == 512 and cluster_hit(700, 900, 256) == 512


def test_mooncake_hits_share_one_scope(tmp_path):
    m = load_workload(write_mooncake(tmp_path / "m.jsonl"))
    hits = scope_hits(m.sessions, m.block_tokens)
    assert [hits[(s.sid, 0)] for s in m.sessions] == [0, 1024, 0]


def test_block_keys_map_block_sizes_and_separate_scopes():
    ids = [7, 8, 9, 10]
    k64 = block_keys(ids, 256, 64, 64, "a")
    assert len(k64) == 4 and block_keys(ids[:2], 128, 64, 64, "a") == k64[:2]
    assert block_keys(ids, 256, 64, 64, "b")[0] != k64[0]          # copies never share keys
    k128 = block_keys(ids, 256, 64, 128, "a")                         # 2 trace blocks per key
    assert len(k128) == 2 and block_keys([7, 8, 99, 98], 256, 64, 128, "a")[0] == k128[0]
    k16 = block_keys(ids, 250, 64, 16, "a")                           # 4 keys per trace block
    assert len(k16) == 250 // 16
    with pytest.raises(Exception, match="cannot map"):
        block_keys(ids, 256, 64, 48, "a")


def test_repeat_and_subset(tmp_path):
    w = load_workload(write_agentic(tmp_path / "c", n_files=2))
    r = w.repeated(3)
    assert len(r.sessions) == 6 and len({s.scope for s in r.sessions}) == 6
    assert r.sessions[0].subagents[0].session.scope == r.sessions[0].scope
    assert len(w.subset(1).sessions) == 1 and "first 1 of 2" in w.subset(1).name


def _bad(tmp_path: Path, doc) -> str:
    p = tmp_path / "bad.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(TraceError) as e:
        load_workload(p)
    assert "bad.json" in e.value.message
    return e.value.message


def test_bad_input_names_the_file_and_the_request(tmp_path):
    doc = conversation()
    del doc["requests"][1]["hash_ids"]
    assert "request 1: missing 'hash_ids'" in _bad(tmp_path, doc)
    doc = conversation()
    doc["requests"][3]["hash_ids"][2] = doc["requests"][0]["hash_ids"][0]   # id at a new position
    assert "request 3:" in (m := _bad(tmp_path, doc)) and "prefix-consistent" in m
    doc = conversation()
    doc["requests"][3]["t"] = 1.0                                             # goes back in time
    assert "request 3:" in (m := _bad(tmp_path, doc)) and "goes back" in m
    doc = conversation()
    doc["requests"][2]["requests"][1]["out"] = -3                             # inside the sub-agent
    assert "request 2 > 1: 'out'" in _bad(tmp_path, doc)
    doc = conversation()
    doc["requests"][0]["t"] = -1
    assert "request 0" in _bad(tmp_path, doc)
    doc = conversation()
    doc["requests"][1]["hash_ids"] = doc["requests"][1]["hash_ids"][:2]
    assert "request 1" in (m := _bad(tmp_path, doc)) and "hash_ids for" in m
    assert "known format" in _bad(tmp_path, "hello\n")
    assert "not an agentic" in _bad(tmp_path, {"x": 1})
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                 '{"timestamp": 2, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(TraceError, match="m.jsonl: request 1: timestamp"):
        load_workload(p)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no \\*.json"):
        load_workload(tmp_path / "empty")


def test_the_shared_agentic_traces_load_with_their_published_numbers():
    need_shared(SHARED)
    w = load_workload(SHARED)
    assert isinstance(w, Workload) and len(w.sessions) == 71 and w.requests() == 3878
    hit = tot = 0
    for s in w.sessions:
        stored: set[int] = set()
        for t in s.turns:
            hit += prefix_hit_blocks(t.hash_ids, stored)
            tot += len(t.hash_ids)
            stored.update(t.hash_ids)
    assert 0.955 < hit / tot < 0.97                 # README: 96.4 % prefix-hit blocks
