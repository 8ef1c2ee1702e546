"""Replay of multi-turn sessions: against stub nodes, and through the real data path per mode.

The data-path runs start every service of a 1P2D cluster in this process
(``tools.cluster.inprocess.start_cluster``) and check what the issue asks: every request
finishes, every prompt byte is verified by the emulated engines, the hit each turn reports is
what the previous turn wrote back (the client's prediction), storage bytes read equal the
hits' blocks, and no buffer page is left behind.
"""

from __future__ import annotations


import pytest

from tools.cluster.config import MODES, load_cluster
from tools.cluster.inprocess import start_cluster
from tools.replay.run import ClusterTarget, replay
from tools.replay.workloads import AgenticSpec



pytestmark = pytest.mark.usefixtures("keep_logging")
MiB = 1 << 20


def cluster():
    # hit_lookup_timeout_s: these tests check that every turn hits what the one before wrote,
    # not how fast the lookup answers. The whole cluster shares this process's event loop;
    # in ci71 (beside the real-engine tests) its timers fired up to 0.4 s late and a 1-s
    # lookup gave up — hit 0, recomputed, correct, but not the predicted hit
    # (docs/contributing.md, flake table).
    c = load_cluster(None, environ={})
    return c.with_overrides(cluster={"storage_link_bytes_per_s": 200e6,
                                     "compute_link_bytes_per_s": 800e6},
                            pe_receiver={"buffer_bytes": 16 * MiB},
                            de_loader={"buffer_bytes": 16 * MiB},
                            scheduler_service={"hit_lookup_timeout_s": 5.0})


SPEC = AgenticSpec("32k", agents=3, seed=2, scale=0.0625, max_turns=3)


async def test_replay_against_stub_nodes_finishes_every_turn(tmp_path):
    async with start_cluster(cluster(), storage_root=tmp_path, stub=True) as c:
        res = await replay(ClusterTarget(c.scheduler_address), SPEC, progress=False)
        assert c.stub.completed == 12
    s = res["summary"]
    assert (s["requests"], s["finished"], s["checks"]["all_finished"]) == (12, 12, True)
    recs = res["records"]
    for sess in {r["session_id"] for r in recs}:
        turns = sorted((r for r in recs if r["session_id"] == sess), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2, 3]
        sizes = [r["prompt_tokens"] for r in turns]
        assert sizes == sorted(sizes)                   # context grows turn by turn
        assert all(r["hit_tokens"] > 0 for r in turns[2:])  # the session index remembers
    assert s["latency"]["ttft"]["p50"] is not None and s["slo"]["held"]


@pytest.mark.parametrize("mode", list(m for m in MODES if m != "dualpath-rr"))
async def test_every_mode_hits_what_the_previous_turn_wrote(tmp_path, mode):
    async with start_cluster(cluster().with_mode(mode), storage_root=tmp_path) as c:
        res = await replay(ClusterTarget.from_inprocess(c), SPEC, progress=False,
                           sample_s=0.1)
        assert c.leaks() == {n: 0 for n in c.nodes}
        # what each prefill engine computed: (hit it attended over, new tokens it prefilled)
        prefilled = [(t.hit_tokens, t.new_tokens) for h in c.engines.values()
                     for e in h.engines if hasattr(e, "timings") for t in e.timings]
    s, checks = res["summary"], res["summary"]["checks"]
    assert checks["all_finished"] and s["finished"] == 12
    hits = {(r["hit_tokens"], r["prompt_tokens"] - r["hit_tokens"]) for r in res["records"]}
    if mode == "oracle":          # only the new tokens were prefilled, the hit was resident
        assert set(prefilled) == hits and any(h for h, _ in prefilled)
    assert checks["hit_predicted"] == 12 and checks["hit_mismatches"] == 0, \
        checks["hit_mismatch_examples"]
    assert checks["turns_hitting_previous_write"] == 9     # turns 1..3 of 3 agents
    assert checks["every_prompt_verified"] and checks["engine_byte_mismatches"] == 0
    assert checks["storage_read_matches_hits"], (checks["storage_read_bytes"],
                                                 checks["storage_read_bytes_expected"])
    assert checks["output_length_wrong"] == 0
    assert checks["pe_to_de_matches_new_tokens"] in (True, None), \
        (s["bytes"]["pe_to_de"], checks["pe_to_de_bytes_expected"])
    sides = s["read_sides"]
    b = s["bytes"]
    if mode in ("basic", "+layer", "pe-only"):     # pe-only: dualpath without the DE read path
        assert "de" not in sides and b["storage_read_de_path"] == 0
        assert b["storage_read_pe_path"] > 0
    elif mode == "oracle":
        # the paper's bound: the hit costs no I/O (nothing read, nothing of it sent PE -> DE,
        # nothing of it written back) and no compute (the PE prefilled only the new tokens)
        assert set(sides) == {"none"} and b["storage_read_pe_path"] == 0
        assert b["storage_read_de_path"] == 0 and b["de_to_pe"] == 0
        assert checks["pe_to_de_matches_new_tokens"] is True
        assert s["tokens"]["hit"] > 0 and checks["turns_hitting_previous_write"] == 9
    elif mode == "+dpl":
        assert sides.get("pe") and sides.get("de") and b["de_to_pe"] > 0
    assert s["links"]["nodes"] == ["d0", "d1", "p0"]


def test_replay_command_writes_results_and_plots(tmp_path, capsys):
    from tools.replay import cli
    out = tmp_path / "out"
    rc = cli.main(["--inprocess", "--mode", "dualpath", "--agents", "2", "--max-turns", "2",
                   "--scale", "0.0625", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "6/6 finished" in text and "hit mismatches 0/6" in text
    assert {p.name for p in out.iterdir()} >= {"results.json", "latency.png", "links.png"}


async def test_mooncake_requests_hit_prefixes_other_requests_stored(tmp_path):
    import json

    from tests.helpers import until
    from tools.replay.workloads import TraceSpec, load_mooncake
    lines = [{"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
             {"timestamp": 1500, "input_length": 1600, "output_length": 8,
              "hash_ids": [0, 1, 5, 6]}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    # Two windows of the trace, the second replayed once the first request's blocks are in
    # storage: replayed at its timestamp, request 1 hits them only if request 0 stored them
    # within 1.5 s, which a loaded host does not promise (the CI on be8cb3b saw a twin miss).
    first, second = TraceSpec(str(trace), duration_s=1.0), TraceSpec(str(trace), start_s=1.0)
    [req0] = load_mooncake(first)
    async with start_cluster(cluster(), storage_root=tmp_path / "s") as c:
        target = ClusterTarget.from_inprocess(c)
        res0 = await replay(target, first, progress=False)

        async def stored() -> bool:
            return await c.stored_prefix(req0.keys) == len(req0.keys) == 2

        await until(stored, what="request 0's blocks stored")
        res1 = await replay(target, second, progress=False)
    assert [(r["request_id"], r["outcome"], r["hit_tokens"]) for r in res0["records"]] == \
        [("trace-0", "finished", 0)]
    assert [(r["request_id"], r["outcome"], r["hit_tokens"]) for r in res1["records"]] == \
        [("trace-1", "finished", 128)]     # trace blocks 0 and 1, stored by request 0
    for res in (res0, res1):
        assert res["summary"]["checks"]["storage_read_matches_hits"]
        assert res["summary"]["checks"]["every_prompt_verified"]


async def test_oracle_with_engines_over_their_sockets(tmp_path):
    """The oracle's resident hit travels to engines attached over the engine socket too
    (``[cluster] remote_engines``): only the new tokens prefilled and forwarded, all checked."""
    spec = AgenticSpec("32k", agents=2, seed=3, scale=0.0625, max_turns=3)
    c0 = cluster().with_mode("oracle").with_overrides(cluster={"remote_engines": True})
    async with start_cluster(c0, storage_root=tmp_path) as c:
        res = await replay(ClusterTarget.from_inprocess(c), spec, progress=False,
                           sample_s=0.1)
        assert c.leaks() == {n: 0 for n in c.nodes}
    s, checks = res["summary"], res["summary"]["checks"]
    assert checks["all_finished"] and checks["every_prompt_verified"]
    assert checks["pe_to_de_matches_new_tokens"] is True and s["tokens"]["hit"] > 0
    assert checks["output_length_wrong"] == 0 and s["bytes"]["de_to_pe"] == 0
