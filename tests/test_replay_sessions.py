"""Live replay of recorded agentic sessions (tools/replay/sessions.py) through a local cluster:
every turn finishes, hits equal what the hash ids predict, storage bytes equal the hits, every
prompt byte verified; sub-agents block their parent; bad traces fail before anything is sent."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import InvalidArgument
from sim.recorded import TraceError
from tests.test_replay_e2e import cluster
from tests.trace_files import write_agentic
from tools.cluster.inprocess import start_cluster
from tools.replay.driver import Replayer
from tools.replay.run import ClusterTarget, replay
from tools.replay.sessions import SessionTrace, SessionTraceSpec

pytestmark = pytest.mark.usefixtures("keep_logging")


def _spec(d, **kw) -> SessionTraceSpec:
    base = dict(conversations=None, max_turns=None, repeat=2, scale=0.5, think_scale=0.01)
    return SessionTraceSpec(str(d), **(base | kw))


def test_plans_map_blocks_and_keep_subagents(tmp_path):
    d = write_agentic(tmp_path / "c", n_files=1, first=1024, append=256, gen=8)
    t = SessionTrace(_spec(d), 64)
    assert len(t.plans) == 2 and t.requests() == 12          # 4 turns + a 2-turn sub-agent, x2
    p = t.plans[0]
    assert [x[1] for x in p.turns] == [512, 640, 768, 896]    # tokens x0.5
    assert all(len(keys) == prompt // 64 for _, prompt, _, keys in p.turns)
    assert list(p.subs) == [2] and len(p.subs[2][0].turns) == 2
    assert p.turns[1][3][:8] == p.turns[0][3][:8]              # a 32-token trace block, 2 per key
    assert t.plans[1].turns[0][3][0] != p.turns[0][3][0]       # the copy has its own key space
    dropped = SessionTrace(_spec(d, max_prompt=700), 64)
    assert dropped.dropped == 2 * 2 and dropped.requests() == 8


async def test_agentic_sessions_replay_through_the_data_path(tmp_path):
    d = write_agentic(tmp_path / "c", n_files=1, first=1024, append=256, gen=8)
    async with start_cluster(cluster().with_mode("dualpath"), storage_root=tmp_path / "s") as c:
        res = await replay(ClusterTarget.from_inprocess(c), _spec(d), progress=False, sample_s=0.1)
        assert c.leaks() == {n: 0 for n in c.nodes}
    s, checks = res["summary"], res["summary"]["checks"]
    assert s["finished"] == 12 and checks["all_finished"]
    assert checks["hit_predicted"] == 12 and checks["hit_mismatches"] == 0, checks["hit_mismatch_examples"]
    assert checks["storage_read_matches_hits"] and checks["every_prompt_verified"]
    recs = {r["request_id"]: r for r in res["records"]}
    sid = "trace_0000#0"
    assert [recs[f"{sid}-t{k}"]["hit_tokens"] for k in range(4)] == [0, 512, 640, 768]
    sub_end = max(recs[f"trace_0000/sub0#0-t{k}"]["end_s"] for k in range(2))
    assert recs[f"{sid}-t2"]["submit_s"] >= sub_end             # the parent waited for it
    assert res["workload"]["kind"] == "sessions"


def test_bad_traces_fail_before_anything_is_sent(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": [{"t": 0, "in": 100, "out": 1, "hash_ids": [1]}, '
                   '{"t": 1, "in": 100, "out": 1, "hash_ids": [2, 1]}]}')
    with pytest.raises(TraceError, match="bad.json: request 1"):
        SessionTrace(_spec(bad), 64)
    with pytest.raises(InvalidArgument, match="whole number"):
        SessionTrace(_spec(write_agentic(tmp_path / "c", n_files=1), scale=0.3), 64)


def test_trace_arrivals_plan_the_recorded_times(tmp_path):
    d = write_agentic(tmp_path / "c", n_files=1)
    t = SessionTrace(_spec(d, arrivals="trace", speed=5.0, repeat=1), 64)
    p = t.plans[0]
    assert p.offsets == [0.0, 2.0, 4.0, 6.0] and p.subs[2][0].offsets == [0.0, 0.2]
    with pytest.raises(InvalidArgument, match="arrivals"):
        _spec(d, arrivals="uniform")
    with pytest.raises(InvalidArgument, match="needs recorded times"):
        SessionTrace(SessionTraceSpec("table2:32k", agents=2, max_turns=2, arrivals="trace"), 64)


async def test_trace_arrivals_and_table2_sessions_replay_live(tmp_path, monkeypatch):
    """Turns wait for their recorded time (t = 0, 10, 20, 30 s at speed 10: ≥ 1 s apart, where
    back to back they take a fraction of that), counted from the session's first submission —
    here each first turn reaches its submission 50 ms late, as on a loaded host (CI once saw
    4 ms, and turn 1 went 0.9965 s after turn 0); the Table 2 generator's sessions replay with
    every hit as its hash ids predict."""
    submit = Replayer.request

    async def first_turns_late(self, rec, *args, **kw):
        if rec.turn == 0:
            await asyncio.sleep(0.05)
        return await submit(self, rec, *args, **kw)

    monkeypatch.setattr(Replayer, "request", first_turns_late)
    d = write_agentic(tmp_path / "c", n_files=1, first=1024, append=256, gen=8)
    timed = _spec(d, arrivals="trace", speed=10.0, repeat=1)
    table2 = SessionTraceSpec("table2:32k", conversations=None, max_turns=3, agents=2, scale=0.125)
    async with start_cluster(cluster().with_mode("dualpath"), storage_root=tmp_path / "s") as c:
        target = ClusterTarget.from_inprocess(c)
        res = await replay(target, timed, progress=False, sample_s=0.1)
        res2 = await replay(target, table2, progress=False, sample_s=0.1)
        assert c.leaks() == {n: 0 for n in c.nodes}
    recs = {r["request_id"]: r for r in res["records"]}
    t0 = recs["trace_0000-t0"]["submit_s"]
    for k in (1, 3):
        assert recs[f"trace_0000-t{k}"]["submit_s"] - t0 >= k * 1.0 - 1e-3
    sub0 = recs["trace_0000/sub0-t0"]["submit_s"]
    assert sub0 - t0 >= 2.0 - 1e-3 and recs["trace_0000/sub0-t1"]["submit_s"] - sub0 >= 0.1 - 1e-3
    assert res["workload"]["online"] and res["summary"]["checks"]["all_finished"]
    checks = res2["summary"]["checks"]
    assert res2["summary"]["finished"] == 2 * 3 and checks["all_finished"]
    assert checks["hit_mismatches"] == 0 and checks["storage_read_matches_hits"]
    assert sum(r["hit_tokens"] for r in res2["records"]) > 0
