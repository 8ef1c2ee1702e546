"""The Table 2 generator as a trace Workload (sim/table2_trace.py): the same turns as the
generator, hits from the hash ids equal to the generator's reuse, prefix-consistent ids, and a
simulation equal to the generator path's."""

from __future__ import annotations

import json

import pytest

from common.errors import InvalidArgument
from sim.recorded import dump_conversation, load_workload, scope_hits
from sim.cli import main as simulate_main
from sim.config import load
from sim.run import simulate, simulate_trace
from sim.table2_trace import parse_spec, table2_workload
from sim.workload import TraceWorkload


def _generator_turns(ds: str, agents: int, seed: int, turns_scale: float = 1.0) -> list[list]:
    g = TraceWorkload(ds, agents, seed, 64, turns_scale=turns_scale)
    out = []
    for aid in range(agents):
        a, turns = g.make_agent(aid), []
        while (t := g.next_turn(a)) is not None:
            turns.append(t)
        out.append(turns)
    return out


@pytest.mark.parametrize("ds", ["32k", "64k"])
def test_turns_and_hits_equal_the_generators(ds):
    w = table2_workload(f"table2:{ds}:24", seed=7)
    gen = _generator_turns(ds, 24, 7)
    hits = scope_hits(w.all_sessions(), w.block_tokens)       # straight from the hash ids
    compactions = 0
    for s, turns in zip(w.sessions, gen, strict=True):
        assert len(s.turns) == len(turns)
        for k, (turn, (hit, new, g)) in enumerate(zip(s.turns, turns)):
            assert (turn.prompt_tokens, turn.gen_tokens) == (hit + new, g)
            assert hits[(s.sid, k)] == hit, (s.sid, k)
            compactions += k > 0 and turn.prompt_tokens < s.turns[k - 1].prompt_tokens
    assert compactions > 0 if ds == "32k" else True            # the saw-tooth is exercised
    assert len({s.scope for s in w.sessions}) == 24             # no two agents share a prefix


def test_seeded_and_deterministic():
    a, b = table2_workload("table2:48k:6", seed=3), table2_workload("table2:48k:6", seed=3)
    c = table2_workload("table2:48k:6", seed=4)
    assert a == b and a != c
    assert [len(s.turns) for s in a.sessions] == [len(t) for t in _generator_turns("48k", 6, 3)]


def test_the_ids_pass_the_trace_checks(tmp_path):
    """Written as agentic files, the sessions load back (prefix-consistent ids, counts that fit
    the prompts); only the generated blocks' ids, which that format has no field for, are gone."""
    w = table2_workload("table2:32k:3", seed=2, turns_scale=0.3)
    d = tmp_path / "t2"
    d.mkdir()
    for s in w.sessions:
        (d / f"{s.sid}.json").write_text(json.dumps(dump_conversation(s)))
    back = load_workload(d)
    for s in w.sessions:
        got = next(x for x in back.sessions if x.sid == s.sid)
        assert [(t.prompt_tokens, t.gen_tokens, t.hash_ids) for t in got.turns] == \
               [(t.prompt_tokens, t.gen_tokens, t.hash_ids) for t in s.turns]


@pytest.mark.parametrize("online", [False, True])
def test_a_simulation_equals_the_generator_path(online):
    cfg = load("configs/sim-2p4d-ds660b.toml")
    kw = dict(online=online, aps=2.0 if online else None, seed=5)
    a = simulate(cfg, "dualpath", "32k", 48, turns_scale=0.1, **kw)
    w = table2_workload("table2:32k:48", seed=5, turns_scale=0.1)
    b = simulate_trace(cfg, "dualpath", w, think_scale=0.0, **kw)
    assert a["requests"] == b["requests"] > 48
    assert b["jct_s"] == a["jct_s"]
    assert b["latency"]["ttft"] == a["latency"]["ttft"]
    assert b["read_bytes"] == a["read_bytes"]


def test_simulate_command_takes_a_table2_spec(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = simulate_main(["--trace", "table2:32k:8", "--turns-scale", "0.1", "--mode", "basic,dualpath",
                        "--out", str(out), "--no-png", "--quiet"])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs["dualpath"]["agents"] == 8 and runs["dualpath"]["workload"].startswith("trace table2-32k-8a")
    assert simulate_main(["--trace", "table2:99k", "--no-png"]) == 2
    assert "table2:DATASET[:AGENTS]" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["table2:", "table2:64k:0", "table2:64k:x", "table2:64k:2:3", "t2:64k"])
def test_bad_specs_name_the_spec(spec):
    with pytest.raises(InvalidArgument, match="table2"):
        parse_spec(spec)
