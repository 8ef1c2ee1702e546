"""Trace sessions in the simulator (sim/session_workload.py): the analytic check, sub-agents,
think times, the maximum-context policy."""

from __future__ import annotations

import math

import pytest

from sim.recorded import load_workload, scope_hits
from sim.cluster import Cluster
from sim.config import load, replace
from sim.run import simulate_trace
from sim.session_workload import SessionWorkload
from tests.trace_files import write_agentic


def _cfg():
    # one PE node and one DE node: nothing else competes, every turn is alone on the cluster
    return replace(load(None), hardware={"prefill_nodes": 1, "decode_nodes": 1})


def _turn_cost(cfg, hit: int, new: int, gen: int) -> float:
    """One turn alone on the cluster (oracle: no KV moves): the prefill step, then the decode."""
    cost = cfg.cost
    per_gpu = new / cfg.hardware.gpus_per_node            # a node's PEs step together (EP)
    lin = 2.0 * cost.linear_params / cost.linear_flops_per_s * per_gpu
    lin /= -math.expm1(-per_gpu / cfg.model.batch_eff_tokens)
    prefill = cost.attention_s(hit, new) + lin
    step = cost.decode_base_s + cost.decode_s_per_seq + (hit + new) * cost.decode_s_per_ctx_token
    return prefill + (gen - 1) * step


def _expected_jct(cfg, w, think_scale: float) -> float:
    """Σ over the session's turns (sub-agents where they start) of the wait for the next fetch
    tick, the turn's cost and the think time before the next one."""
    iv, bt = cfg.engine.fetch_interval_s, cfg.kv.block_tokens
    top = w.sessions[0]
    hits = scope_hits(top.walk(), w.block_tokens)

    def run(s, t: float) -> float:
        for k, turn in enumerate(s.turns):
            if k:
                t += turn.think_s * think_scale
            for sub in s.subagents:
                if sub.before == k:
                    t = run(sub.session, t)
            t = math.ceil(t / iv - 1e-9) * iv
            hit = min(hits[(s.sid, k)], turn.prompt_tokens - 1) // bt * bt
            t += _turn_cost(cfg, hit, turn.prompt_tokens - hit, turn.gen_tokens)
        return t

    return run(top, 0.0)


@pytest.mark.parametrize("online", [False, True])
def test_one_conversation_costs_the_sum_of_its_turns(tmp_path, online):
    w = load_workload(write_agentic(tmp_path / "c", n_files=1))
    cfg = _cfg()
    r = simulate_trace(cfg, "oracle", w, online=online, aps=1.0 if online else None)
    think = 1.0 if online else 0.0
    assert r["requests"] == 6 and r["agents_done"] == 2          # the parent and its sub-agent
    assert r["jct_s"] == pytest.approx(_expected_jct(cfg, w, think), rel=1e-9, abs=1e-9)
    assert r["trace"]["compacted_turns"] == r["trace"]["dropped_turns"] == 0


def test_the_parent_waits_for_its_subagent(tmp_path):
    w = load_workload(write_agentic(tmp_path / "c", n_files=1))
    sw = SessionWorkload(w, 64, 1 << 20)
    parent = sw.make_agent(0)
    seen = [sw.next_turn(parent), sw.next_turn(parent)]
    assert sw.spawn(parent) and not sw.spawn(parent)          # started once, before turn 2
    kid = sw._agent(99, sw.plans[0].spawns[2][0], 0)
    assert [sw.next_turn(kid), sw.next_turn(kid), sw.next_turn(kid)][2] is None
    seen += [sw.next_turn(parent), sw.next_turn(parent)]
    assert sw.next_turn(parent) is None
    # hits straight from the hash ids: turn 1 re-sends turn 0's 4 blocks, turn 3 turn 2's 8
    assert [s[0] for s in seen] == [0, 256, 384, 512]
    assert all(h + n == p for (h, n, _), p in zip(seen, (300, 430, 560, 690)))


def test_think_times_stretch_online_sessions_only(tmp_path):
    w = load_workload(write_agentic(tmp_path / "c", n_files=1))
    cfg = _cfg()
    off = simulate_trace(cfg, "oracle", w)["jct_s"]
    on = simulate_trace(cfg, "oracle", w, online=True, aps=1.0, think_scale=2.0)["jct_s"]
    assert on == pytest.approx(off + 2.0 * (3 * 2.0 + 1.0), abs=0.2)   # ticks may shift by ≤ 0.1 s


@pytest.mark.parametrize("policy", ["compact", "drop"])
def test_turns_above_the_maximum_context_follow_the_policy(tmp_path, policy):
    w = load_workload(write_agentic(tmp_path / "c", n_files=2, n_turns=8))
    sw = SessionWorkload(w, 64, 640, policy=policy, repeat=3)
    st = sw.stats()
    assert sw.n_roots == 6 and sw.n_agents == 12
    over = [t for s in w.all_sessions() for t in s.turns if t.prompt_tokens + t.gen_tokens > 640]
    if policy == "drop":
        assert st["dropped_turns"] == len(over) and st["compacted_turns"] == 0
    else:
        assert st["compacted_turns"] >= 1 and st["dropped_turns"] == 0
        shapes = [x for p in sw.plans for x in p.shapes]
        assert all(h + n + g <= 640 for h, n, g in shapes) and len(shapes) == st["turns_per_copy"]
    r = Cluster(_cfg(), "dualpath", sw).run()
    assert r["requests"] == 3 * (st["turns_per_copy"] - st["dropped_turns"])
    assert r["trace"] == st


def test_simulate_command_on_a_trace_and_on_a_bad_one(tmp_path, capsys):
    from sim.cli import main
    d = write_agentic(tmp_path / "c", n_files=2)
    out = tmp_path / "r.json"
    assert main(["--trace", str(d), "--mode", "basic,dualpath", "--repeat", "2", "--no-png",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "trace: 2 sessions x2 (8 agents with sub-agents), 12 turns per copy" in text and "speedup" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n')
    assert main(["--trace", str(bad), "--no-png"]) == 2
    assert "bad.jsonl: request 0: missing 'hash_ids'" in capsys.readouterr().err


def test_the_shared_agentic_traces_simulate():
    from sim.recorded import shared_agentic_dir
    from tests.trace_files import need_shared
    need_shared(shared_agentic_dir())
    w = load_workload(shared_agentic_dir()).subset(6)
    r = simulate_trace(None, "dualpath", w)
    assert r["requests"] == sum(len(s.turns) for s in w.sessions) and r["agents_done"] == 6
    assert r["trace"]["hit_share"] > 0.85 and r["read_bytes"]["de_path"] > 0


def test_mooncake_requests_hit_what_earlier_requests_sent(tmp_path):
    from tests.trace_files import write_mooncake
    w = load_workload(write_mooncake(tmp_path / "m.jsonl"))
    sw = SessionWorkload(w, 64, 1 << 20, repeat=2)
    shapes = [sw.next_turn(sw.make_agent(i)) for i in range(3)]
    assert [s[0] for s in shapes] == [0, 1024, 0]     # request 1 re-sends request 0's 2 blocks
    assert sw.n_roots == 6 and sw.make_agent(4).session == "req1#1"
    r = simulate_trace(_cfg(), "dualpath", w, online=True, aps=2.0)
    assert r["requests"] == 3 and r["read_bytes"]["pe_path"] + r["read_bytes"]["de_path"] > 0


def test_regenerating_the_reproduction_doc_keeps_every_marked_block(tmp_path):
    """``sim.reproduce`` rewrites docs/reproduction.md; the agentic-traces section and the
    hand-run pe-only ablation (``sim.trace_repro.KEPT``) survive it."""
    from sim.trace_repro import KEPT, keep_section
    doc = tmp_path / "reproduction.md"
    blocks = [f"{b}\nblock {i}\n{e}" for i, (b, e) in enumerate(KEPT)]
    doc.write_text("# old\n\nold text\n\n" + "\n\n".join(blocks) + "\n")
    new = keep_section(doc, "# regenerated\n")
    assert new.startswith("# regenerated\n") and "old text" not in new
    assert all(b in new for b in blocks)
