"""Trace arrivals (``--arrivals trace``): a trace's own start times and turn times drive the
online simulation (sim/session_workload.py) — seen in the simulator's request log."""

from __future__ import annotations

import json

import pytest

from common.errors import InvalidArgument
from sim.recorded import load_workload
from sim.cli import main as simulate_main
from sim.config import load, replace
from sim.run import simulate_trace
from sim.table2_trace import table2_workload
from tests.trace_files import write_agentic

STARTS_MS = (0, 2500, 7000)


def _three_sessions(path):
    rows = [{"timestamp": ts + 40_000, "input_length": 900 + 512 * i, "output_length": 4,
             "hash_ids": [10 * i + k for k in range(2 + i)]} for i, ts in enumerate(STARTS_MS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg():
    return replace(load(None), hardware={"prefill_nodes": 1, "decode_nodes": 1})


@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_sessions_start_at_their_recorded_offsets(tmp_path, speed):
    w = load_workload(_three_sessions(tmp_path / "m.jsonl"))
    log: list = []
    r = simulate_trace(_cfg(), "dualpath", w, arrivals="trace", speed=speed, request_log=log)
    assert r["online"] and r["requests"] == 3
    assert [t for _, _, t in log] == pytest.approx([s / 1000 / speed for s in STARTS_MS])
    assert r["aps"] == pytest.approx(3 / (7.0 / speed))          # the rate the trace works out to
    assert r["trace"]["arrivals"] == "trace"


def test_poisson_stays_the_default(tmp_path):
    w = load_workload(_three_sessions(tmp_path / "m.jsonl"))
    log: list = []
    simulate_trace(_cfg(), "dualpath", w, online=True, aps=1.0, request_log=log)
    assert [t for _, _, t in log] != pytest.approx([s / 1000 for s in STARTS_MS])


def test_copies_of_a_session_arrive_together(tmp_path):
    w = load_workload(_three_sessions(tmp_path / "m.jsonl"))
    log: list = []
    simulate_trace(_cfg(), "dualpath", w, arrivals="trace", repeat=2, request_log=log)
    assert sorted(t for _, _, t in log) == pytest.approx([0, 0, 2.5, 2.5, 7.0, 7.0])


def test_turns_keep_their_recorded_times(tmp_path):
    """Parent turns at t = 0, 10, 20, 30 s and a two-turn sub-agent before turn 2 (its own
    t = 0, 1): each turn goes at its recorded time unless the previous one is still running."""
    w = load_workload(write_agentic(tmp_path / "c", n_files=1))
    log: list = []
    simulate_trace(_cfg(), "oracle", w, arrivals="trace", request_log=log)
    by = {(s.split("#")[0], rid.split(".")[1]): t for rid, s, t in log}
    assert by[("trace_0000", "1")] == pytest.approx(0.0) and by[("trace_0000", "2")] == pytest.approx(10.0)
    assert by[("trace_0000/sub0", "1")] == pytest.approx(20.0)         # spawned at the parent's t = 20
    assert by[("trace_0000/sub0", "2")] == pytest.approx(21.0)
    assert by[("trace_0000", "3")] > 21.0                              # after its sub-agent is done
    assert by[("trace_0000", "4")] == pytest.approx(30.0)


def test_a_trace_without_times_is_refused():
    with pytest.raises(InvalidArgument, match="arrivals trace needs recorded times"):
        simulate_trace(_cfg(), "dualpath", table2_workload("table2:32k:2", turns_scale=0.05),
                       arrivals="trace")


def test_simulate_command_writes_the_request_log(tmp_path):
    log = tmp_path / "requests.jsonl"
    rc = simulate_main(["--trace", str(_three_sessions(tmp_path / "m.jsonl")), "--arrivals", "trace",
                        "--speed", "0.5", "--request-log", str(log), "--out", str(tmp_path / "r.json"),
                        "--no-png", "--quiet"])
    assert rc == 0
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["submit_s"] for x in rows] == pytest.approx([0.0, 5.0, 14.0])
    assert simulate_main(["--arrivals", "trace", "--no-png"]) == 2      # needs --trace
