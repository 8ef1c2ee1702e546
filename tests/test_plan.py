"""The capacity planner (sim/plan.py, dualpath plan): monotone in the SLO, honest when nothing
meets it, clear errors on bad input."""

from __future__ import annotations

import json

import pytest

from sim.recorded import load_workload
from sim.config import load
from sim.plan import SLO, PlanWorkload, band, plan, shapes
from sim.plan_cli import main as plan_main
from tests.trace_files import write_agentic

RATIOS = ((1, 2), (1, 1))


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    d = write_agentic(tmp_path_factory.mktemp("plan") / "c", n_files=3, n_turns=6, first=24_000,
                      append=3_000, gen=40)
    return PlanWorkload(trace=load_workload(d), repeat=30, aps=4.0, think_scale=0.0)


def test_candidates_are_ordered_by_gpus():
    c = shapes(RATIOS, 8, 96)
    gpus = [(p + d) * 8 for p, d in c]
    assert gpus == sorted(gpus) and (1, 1) in c and (1, 2) in c and max(gpus) <= 96


def test_a_looser_slo_never_needs_more_gpus(workload):
    cfg = load(None)
    needed = {"basic": [], "pe-only": [], "dualpath": []}
    for ttft in (2.0, 3.0, 5.0, 8.0, 60.0):
        p = plan(cfg, workload, SLO(online=True, ttft_s=ttft, tpot_s=0.2), ratios=RATIOS, max_gpus=192)
        for mode, m in p["modes"].items():
            needed[mode].append(m["chosen"]["gpus"] if m["met"] else float("inf"))
    for mode, g in needed.items():
        assert g == sorted(g, reverse=True), (mode, g)
        assert g[-1] < g[0] or g[0] == g[-1] == 16           # the search saw a difference
    assert any(x < float("inf") for x in needed["dualpath"])


def test_no_shape_meets_the_slo_says_so_and_shows_the_closest(workload, tmp_path, capsys):
    p = plan(load(None), workload, SLO(online=True, ttft_s=1e-4, tpot_s=1e-4), ratios=((1, 2),), max_gpus=48)
    m = p["modes"]["dualpath"]
    assert not m["met"] and m["chosen"]["worst_ratio"] == min(r["worst_ratio"] for r in m["evaluated"])
    assert len(m["evaluated"]) == 2 and p["saving"]["ratio"] is None
    d = write_agentic(tmp_path / "c", n_files=1)
    rc = plan_main(["--trace", str(d), "--online", "--aps", "1", "--ttft", "0.0001", "--ratios", "1:2",
                    "--max-gpus", "24", "--no-png", "--no-progress", "--out", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 1 and "no shape up to 24 GPUs meets the SLO; closest is 1P2D" in out
    assert json.loads((tmp_path / "p.json").read_text())["modes"]["dualpath"]["met"] is False


def test_offline_plan_meets_a_jct_target(workload):
    off = PlanWorkload(trace=workload.trace, repeat=10)
    p = plan(load(None), off, SLO(online=False, jct_s=1e9), ratios=((1, 2),), max_gpus=48)
    for m in p["modes"].values():
        assert m["met"] and m["chosen"]["shape"] == "1P2D" and m["eq9"]["inside"]
    assert p["saving"] == {"ratio": 1.0, "lower_bound": False, "baseline_mode": "pe-only"}
    assert p["saving_vs_basic"] == {"ratio": 1.0, "lower_bound": False, "baseline_mode": "basic"}
    assert p["grid"]["step_at_dualpath"] == {"gpus": 24, "relative": 1.0}      # 1P2D -> 2P4D


def test_the_headline_saving_is_against_pe_only_on_a_grid_of_every_k(workload):
    """The saving names its baseline (pe-only: dualpath without the DE read path; basic beside
    it); every k is a coarse candidate and the refine pass steps one node between the last miss
    and the first meet, so a saving between 1 and 2 is not rounded to 2."""
    assert [p + d for p, d in shapes(((1, 1),), 8, 96)] == [2, 4, 6, 8, 10, 12]
    assert band(RATIOS, 8, 48, 80) == [(3, 4), (3, 5), (4, 4), (3, 6), (4, 5)]    # 56, 64, 72 GPUs
    assert band(RATIOS, 8, 24, 48) == [(2, 2), (2, 3)] and band(((1, 2),), 8, 24, 72) == [(2, 4)]
    p = plan(load(None), workload, SLO(online=True, ttft_s=3.0, tpot_s=0.2), ratios=RATIOS, max_gpus=192)
    assert list(p["modes"]) == ["basic", "pe-only", "dualpath"]
    gpus = {m: v["chosen"]["gpus"] for m, v in p["modes"].items() if v["met"]}
    assert "dualpath" in gpus
    for base, s in (("pe-only", p["saving"]), ("basic", p["saving_vs_basic"])):
        assert s["baseline_mode"] == base
        if base in gpus:
            assert s["ratio"] == gpus[base] / gpus["dualpath"] and not s["lower_bound"]
    for row in p["modes"]["pe-only"]["evaluated"]:
        assert row["binding"]["snic_read_p95_util"] >= 0.0
    for m in p["modes"].values():            # shapes simulated: coarse, then refined below the met one
        met = [r for r in m["evaluated"] if r["met"]]
        assert met == [m["chosen"]] and m["evaluated"][-1] is m["chosen"]
    step = p["grid"]["step_at_dualpath"]
    assert step["gpus"] == 8 and p["grid"]["k"] == "every integer 1..48"


def test_bad_input_exits_2_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"requests": [{"t": 0, "in": 100, "out": 1}]}')
    assert plan_main(["--trace", str(bad), "--jct", "100", "--no-png"]) == 2
    err = capsys.readouterr().err
    assert "x.json: request 0: missing 'hash_ids'" in err
    assert plan_main(["--trace", str(bad), "--no-png"]) == 2       # offline needs --jct
    assert "needs --jct" in capsys.readouterr().err


def test_plan_reads_the_table2_generator_and_trace_arrivals_as_traces(tmp_path, capsys):
    """``--trace table2:…`` plans the generator's sessions; ``--arrivals trace`` plans online on
    a trace's own times without --aps."""
    out = tmp_path / "t2.json"
    rc = plan_main(["--trace", "table2:32k:8", "--turns-scale", "0.1", "--jct", "1e9", "--ratios", "1:2",
                    "--max-gpus", "24", "--no-png", "--no-progress", "--out", str(out)])
    assert rc == 0 and "trace table2-32k-8a" in json.loads(out.read_text())["workload"]
    d = write_agentic(tmp_path / "c", n_files=1)
    rc = plan_main(["--trace", str(d), "--arrivals", "trace", "--speed", "2", "--ttft", "100", "--tpot", "1",
                    "--ratios", "1:2", "--max-gpus", "24", "--no-png", "--no-progress", "--out", str(out)])
    p = json.loads(out.read_text())
    assert rc == 0 and p["slo"]["online"] and "trace's own times (speed 2)" in p["workload"]
    assert p["modes"]["dualpath"]["chosen"]["trace"]["arrivals"] == "trace"
    assert plan_main(["--table2", "--arrivals", "trace", "--no-png"]) == 2
    capsys.readouterr()
