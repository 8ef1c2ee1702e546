"""The simulated cluster: hand-computed timelines, the real scheduler inside, determinism, the
§3 link accounting under a steady load, the ablation's direction, and the CLI."""

from __future__ import annotations

import gc
import json

import pytest

import services.compute_model.batching
import services.scheduler.core.scheduler
from common.config import build_config
from common.kv import PRESETS as KV
from services.compute_model.cost_model import cost_model
from sim import bandwidth as bw
from sim import cluster as sim_cluster
from sim import engines as sim_engines
from sim.cli import main as simulate_main
from sim.cluster import Cluster
from sim.config import SimConfig, load
from sim.run import predict_speedups, simulate
from sim.workload import FixedWorkload

BPT = KV["test-small"].bytes_per_token          # 1024 B per token


def tiny(**hw) -> SimConfig:
    """1P1D, one GPU per node, test-small model; slow links so every hop is visible."""
    hardware = {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1, "snic_bytes_per_s": 1e6,
                "cnic_bytes_per_s": 4e6, "dram_bytes_per_s": 1e9, "pe_hbm_kv_bytes": 1e9,
                "de_hbm_kv_bytes": 1e9} | hw
    return build_config({"name": "tiny", "hardware": hardware,
                         "model": {"preset": "test-small", "ep_sync": False, "batch_eff_tokens": 0},
                         "engine": {"fetch_interval_s": 0.1}}, SimConfig, environ={})


def run_fixed(cfg, mode, hit, new, gen, agents=1, turns=1, **kw):
    cl = Cluster(cfg, mode, FixedWorkload(agents, turns, hit, new, gen), **kw)
    return cl, cl.run()


def test_one_request_whole_prompt_by_hand():
    """basic: read on the PE's SNIC, load into HBM, compute, send hit+new to the DE, H2D, decode."""
    cfg = tiny()
    hit, new, gen = 6400, 100, 5
    cost = cost_model("test-small")
    compute = cost.attention_s(hit, new) + 2 * cost.linear_params * new / cost.linear_flops_per_s
    expect = (hit * BPT / 1e6                      # storage read at the SNIC rate
              + hit * BPT / 4e6                    # PE buffer -> HBM over the PE CNIC
              + compute
              + (hit + new) * BPT / 4e6            # PE HBM -> DE buffer (hit + new)
              + (hit + new) * BPT / 4e6            # DE H2D
              + (gen - 1) * cost.decode_step_s(1, hit + new))
    cl, r = run_fixed(cfg, "basic", hit, new, gen)
    assert r["jct_s"] == pytest.approx(expect, rel=1e-9)
    assert r["requests"] == 1 and r["read_bytes"]["pe_path"] == hit * BPT
    assert r["latency"]["tpot"]["mean"] == pytest.approx(cost.decode_step_s(1, hit + new), rel=0.01)
    links = cl.links_by_class()
    assert links["snic_read"][0].bytes_at(r["jct_s"]) == pytest.approx(hit * BPT)
    wb = (hit + new + gen) // 64 * 64 - hit        # new full blocks written back after decode
    assert links["de_cnic_read"][0].bytes_at(r["jct_s"]) == pytest.approx((hit + new + wb) * BPT)
    assert links["snic_write"][1].bytes_at(r["jct_s"]) == pytest.approx(wb * BPT)


def test_one_request_oracle_by_hand():
    cfg = tiny()
    cost = cost_model("test-small")
    hit, new, gen = 6400, 100, 3
    compute = cost.attention_s(hit, new) + 2 * cost.linear_params * new / cost.linear_flops_per_s
    _, r = run_fixed(cfg, "oracle", hit, new, gen)
    assert r["jct_s"] == pytest.approx(compute + (gen - 1) * cost.decode_step_s(1, hit + new), rel=1e-9)
    assert r["read_bytes"] == {"pe_path": 0.0, "de_path": 0.0}


def test_second_turn_waits_for_the_fetch_tick():
    """Turn 2 is submitted when turn 1 completes and placed on the next 0.1 s fetch tick."""
    cfg = tiny()
    cl1, r1 = run_fixed(cfg, "oracle", 640, 64, 1, turns=1)
    cl2, r2 = run_fixed(cfg, "oracle", 640, 64, 1, turns=2)
    import math
    tick = math.ceil(r1["jct_s"] / 0.1 - 1e-9) * 0.1
    assert r2["jct_s"] == pytest.approx(tick + r1["jct_s"], rel=1e-9)


def test_the_policy_is_the_scheduler_services_code():
    cl, _ = run_fixed(tiny(), "dualpath", 640, 64, 2)
    assert type(cl.sched) is services.scheduler.core.scheduler.Scheduler
    assert sim_cluster.Scheduler is services.scheduler.core.scheduler.Scheduler
    assert sim_engines.PrefillBatcher is services.compute_model.batching.PrefillBatcher
    assert all(type(g.batcher) is services.compute_model.batching.PrefillBatcher
               for g in cl.pe_by_id.values())
    assert cl.sched.config.policy == "dualpath" and cl.sched.config.model == "test-small"
    # nothing is left behind once every agent is done
    assert cl.reqs == {} and cl.sched.queue_lengths()["total"] == 0


def test_same_seed_same_run():
    cfg = load("configs/sim-local-1p2d.toml")
    a = simulate(cfg, "dualpath", "32k", 6, turns_scale=0.1)
    b = simulate(cfg, "dualpath", "32k", 6, turns_scale=0.1)
    c = simulate(cfg, "dualpath", "32k", 6, turns_scale=0.1, seed=99)
    assert a["jct_s"] == b["jct_s"] and a["sim"]["events"] == b["sim"]["events"]
    assert a["latency"] == b["latency"]
    assert c["jct_s"] != a["jct_s"]


def test_a_run_drops_no_reference_cycles_so_the_collector_can_be_off():
    # Cluster.run switches the cyclic collector off while it runs: sound only if what a run
    # drops is freed by reference counting. Unreachable cycles found while the cluster is still
    # referenced must not grow with the number of requests.
    cfg = load("configs/sim-local-1p2d.toml")
    found, requests = [], []
    for ts in (0.05, 0.3):
        out: list = []
        gc.collect()                        # the previous run's cluster, dropped just now
        gc.disable()
        try:
            r = simulate(cfg, "dualpath", "32k", 6, turns_scale=ts, cluster_out=out)
            found.append(gc.collect())
        finally:
            gc.enable()
        requests.append(r["requests"])
    assert requests[1] > 4 * requests[0]
    assert found == [0, 0]
    simulate(cfg, "dualpath", "32k", 2, turns_scale=0.05)
    assert gc.isenabled()                   # Cluster.run restores the collector


def test_dualpath_beats_basic_on_a_storage_bound_cluster():
    speed = predict_speedups("configs/sim-local-1p2d.toml", "64k", 12, turns_scale=0.15,
                             modes=("basic", "+dpl", "dualpath", "oracle"))
    assert speed["dualpath"]["speedup_vs_basic"] > 1.5       # 3 SNICs instead of 1
    assert speed["oracle"]["jct_s"] <= speed["dualpath"]["jct_s"]
    assert speed["basic"]["read_bytes"]["de_path"] == 0.0
    assert speed["dualpath"]["read_bytes"]["de_path"] > 0.0


def test_pe_only_is_dualpath_without_the_de_read_path():
    """pe-only: dualpath's every knob but the read side; its core never plans a DE read, so on a
    storage-bound cluster it reads through the PE node's link alone and loses what dualpath
    gains from the DE nodes' links."""
    import msgspec

    from sim.config import mode_spec, scheduler_config
    cfg = load("configs/sim-local-1p2d.toml")
    pe, dp = scheduler_config(cfg, "pe-only"), scheduler_config(cfg, "dualpath")
    assert pe.read_side == "pe" and pe.read_side_mode() == "pe"
    assert msgspec.structs.replace(pe, read_side="auto") == dp
    assert msgspec.structs.replace(mode_spec("pe-only"), read_side="auto") == mode_spec("dualpath")
    assert not mode_spec("pe-only").de_reads and mode_spec("dualpath").de_reads
    runs, clusters = {}, []
    for mode in ("pe-only", "dualpath"):
        runs[mode] = simulate(cfg, mode, "64k", 12, turns_scale=0.15, cluster_out=clusters)
    pe_core, dp_core = (c.sched for c in clusters)
    assert pe_core.read_side_tokens["de"] == 0 and pe_core.read_side_tokens["pe"] > 0
    assert dp_core.read_side_tokens["de"] > 0
    assert runs["pe-only"]["read_bytes"]["de_path"] == 0.0
    assert runs["pe-only"]["read_bytes"]["pe_path"] > 0.0
    assert runs["dualpath"]["jct_s"] * 1.5 < runs["pe-only"]["jct_s"]     # 3 SNICs instead of 1


def test_link_accounting_matches_section3_closed_form():
    """Steady storage-bound load (tiny compute, all hit): per-class link loads = §3's formulas."""
    P, D, g, snic = 1, 2, 4, 1e8
    cfg = build_config({"name": "steady", "hardware": {
        "prefill_nodes": P, "decode_nodes": D, "gpus_per_node": g, "snic_bytes_per_s": snic,
        "cnic_bytes_per_s": snic, "dram_bytes_per_s": 10 * snic, "pe_hbm_kv_bytes": 1e12,
        "de_hbm_kv_bytes": 1e12}, "model": {"preset": "test-small", "ep_sync": False},
        "engine": {"fetch_interval_s": 0.01}}, SimConfig, environ={})
    hit = 64 * 400
    cl = Cluster(cfg, "dualpath", FixedWorkload(48, 60, hit, 1, 1))
    cl.start()
    t1, t2 = 4.0, 12.0
    cl.loop.run(until=t1)
    groups = cl.links_by_class()
    snap = {k: [lk.bytes_at(t1) for lk in v] for k, v in groups.items()}
    cl.loop.run(until=t2)
    util = {k: sum(lk.bytes_at(t2) - b for lk, b in zip(v, snap[k])) / (len(v) * v[0].cap * (t2 - t1))
            for k, v in groups.items()}
    assert util["snic_read"] > 0.9                             # storage-bound: all SNICs busy
    u = util["snic_read"]
    expect = bw.link_loads(P, D, g, 1, 1, 10)
    for ours, theirs in (("pe_cnic_read", "PE_CNIC_read"), ("pe_cnic_write", "PE_CNIC_write"),
                         ("de_cnic_read", "DE_CNIC_read"), ("de_cnic_write", "DE_CNIC_write"),
                         ("pe_dram", "PE_DRAM"), ("de_dram", "DE_DRAM")):
        assert util[ours] / u == pytest.approx(float(expect[theirs]), rel=0.08), ours


def test_exact_layers_agree_with_the_aggregated_model():
    """Per-layer flows and events (and write-back as gating flows) vs the aggregated step model."""
    cfg = load("configs/sim-local-1p2d.toml")
    for mode in ("dualpath", "+layer", "+dpl"):
        agg = simulate(cfg, mode, "64k", 12, turns_scale=0.15)
        exact = simulate(cfg, mode, "64k", 12, turns_scale=0.15, exact=True)
        # 4 %: in 12-agent runs the two timing models' small differences change later read-side
        # choices (the dualpath read side remembers what each link was sent): 3.1 % apart
        assert agg["jct_s"] == pytest.approx(exact["jct_s"], rel=0.04), mode
        assert agg["latency"]["ttft"]["mean"] == pytest.approx(exact["latency"]["ttft"]["mean"], rel=0.05)
        assert exact["sim"]["events"] > agg["sim"]["events"]


def test_online_mode_reports_latency_and_slo():
    r = simulate("configs/sim-local-1p2d.toml", "dualpath", "32k", 6, online=True, aps=0.5,
                 turns_scale=0.1)
    assert r["online"] and r["agents_done"] == 6
    assert r["latency"]["ttft"]["n"] == r["requests"] > 0
    assert set(r["slo"]) == {"ttft_s", "tpot_s", "met"}
    assert r["latency"]["ttft"]["p50"] <= r["latency"]["ttft"]["p99"]


def test_simulate_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = simulate_main(["-c", "configs/sim-local-1p2d.toml", "--dataset", "32k", "--agents", "3",
                        "--turns-scale", "0.05", "--mode", "basic,dualpath", "--out", str(out),
                        "--no-png", "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"basic", "dualpath"}
    assert "speedup" in capsys.readouterr().out
    assert simulate_main(["--mode", "warp-speed"]) == 2


def test_split_reads_read_each_hit_once_on_both_links():
    """[scheduler] split_reads in the simulator: both parts of a split read go over their own
    node's link (read bytes by side add up to the same hits as one-link reads), the core split
    reads, and the run is not slower than one link per hit on this storage-bound shape."""
    from sim.config import replace
    cfg = load("configs/sim-local-1p2d.toml")
    split_cfg = replace(cfg, scheduler={"split_reads": True})
    runs, clusters = {}, []
    for name, c in (("one", cfg), ("split", split_cfg)):
        runs[name] = simulate(c, "dualpath", "64k", 12, turns_scale=0.15, cluster_out=clusters)
    one, split = (c.sched for c in clusters)
    assert one.reads.split_reads == 0 and split.reads.split_reads > 0
    total = {k: sum(r["read_bytes"].values()) for k, r in runs.items()}
    assert total["split"] == pytest.approx(total["one"], rel=1e-9)
    assert runs["split"]["read_bytes"]["pe_path"] > 0 and runs["split"]["read_bytes"]["de_path"] > 0
    assert runs["split"]["jct_s"] <= runs["one"]["jct_s"] * 1.02
