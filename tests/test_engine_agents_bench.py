"""``bench engine_agents``'s workload: recorded agentic conversations made token ids.

The bench itself runs real vLLM for minutes (``dualpath bench engine_agents``); what it sends is
checked here on small synthetic conversations in the trace's format: one token per 64-token
trace block, derived from the block's hash id and its conversation, so a later turn repeats an
earlier one's tokens exactly where the trace says the prefix is shared, and conversations share
nothing; the selection keeps the first conversations whose turns fit the instances' context
and says so when too few do. (The shared 71-conversation trace: the last test, skipped loudly
without it.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine_agents_bench import (GEN, MAX_CONTEXT, MIN_FIRST, SESSIONS, TOKEN_HI,
                                       TOKEN_LO, Session, figures, main, profile_pe,
                                       sessions_from_trace, token_of, variant_figures,
                                       versus_oracle)
from bench.engine_agents_settings import (NODE_BUFFER, cluster_settings, run_defaults,
                                          scheduler_settings, storage_links, variant_settings)
from services.scheduler.core.config import SchedulerConfig
from storage_gateway.config import GatewayConfig
from tests.helpers import skip_or_fail


def conversation(path: Path, sid: str, blocks: list[list[int]]) -> None:
    """A conversation file whose request k has the hash ids ``blocks[k]`` (64 tokens each)."""
    reqs = [{"t": float(k), "type": "n", "in": 64 * len(ids), "out": 100, "hash_ids": ids}
            for k, ids in enumerate(blocks)]
    path.write_text(json.dumps({"id": sid, "block_size": 64, "hash_id_scope": "local",
                                "requests": reqs}))


def test_turns_share_exactly_the_traces_prefixes_and_conversations_share_nothing(tmp_path):
    first = list(range(1, 301))
    conversation(tmp_path / "a.json", "a", [first, first + [301, 302], first[:250] + [400]])
    conversation(tmp_path / "b.json", "b", [first, first + [301, 302], first + [303]])
    a, b = sessions_from_trace(tmp_path, 2, 3)
    assert (a.sid, b.sid) == ("a", "b")
    assert [len(p) for p in a.prompts] == [300, 302, 251]      # one token per trace block
    assert a.prompts[1][:300] == a.prompts[0]                  # the recorded shared prefix
    assert a.prompts[2][:250] == a.prompts[0][:250] and a.prompts[2][250] != a.prompts[0][250]
    # the same hash ids in another conversation are other blocks: next to no common token
    assert sum(x == y for x, y in zip(a.prompts[0], b.prompts[0])) < 5
    assert all(TOKEN_LO <= t < TOKEN_HI for p in a.prompts + b.prompts for t in p)
    assert token_of("a", 7) == token_of("a", 7) == a.prompts[0][6]    # deterministic


def test_the_selection_skips_what_does_not_fit_and_names_a_shortfall(tmp_path):
    fits = list(range(1, MIN_FIRST + 1))
    conversation(tmp_path / "1-short.json", "short", [fits[:MIN_FIRST - 1], fits])
    conversation(tmp_path / "2-long.json", "long",
                 [fits, list(range(1, MAX_CONTEXT - GEN + 2))])       # one token too many
    conversation(tmp_path / "3-few.json", "few", [fits])               # one turn only
    conversation(tmp_path / "4-ok.json", "ok", [fits, fits + [9999]])
    assert [s.sid for s in sessions_from_trace(tmp_path, 1, 2)] == ["ok"]
    with pytest.raises(ValueError, match="only 1 conversations have 2 turns"):
        sessions_from_trace(tmp_path, 2, 2)


def test_the_shared_agentic_trace_gives_the_default_sessions_of_five_turns():
    from sim.recorded import shared_agentic_dir

    trace = shared_agentic_dir()
    if not trace.is_dir():
        skip_or_fail(f"the shared agentic trace is absent ({trace}); the synthetic tests above "
                     "cover the derivation")
    sessions = sessions_from_trace(trace, SESSIONS, 5)
    assert len(sessions) == SESSIONS and all(len(s.prompts) == 5 for s in sessions)
    later = [(p, q) for s in sessions for p, q in zip(s.prompts, s.prompts[1:])]
    shared = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                 for p, q in later)
    assert shared >= 0.8 * sum(len(q) for _, q in later)   # the trace's prefix reuse survives


def test_scheduler_settings_are_toml_values_checked_before_anything_starts(capsys):
    assert scheduler_settings(["beta_s=20", "split_reads=true", "policy=dualpath"]) == {
        "beta_s": 20, "split_reads": True, "policy": "dualpath"}
    for bad, why in [("nope=1", "unknown field"), ("beta_s=-1", "beta_s"), ("x", "KEY=VALUE")]:
        with pytest.raises(ValueError, match=why):
            scheduler_settings([bad])
    with pytest.raises(SystemExit) as exc:                 # refused before the trace is read
        main(["--scheduler-set", "beta_s=nope", "--trace", "/nonexistent"])
    assert exc.value.code == 2 and "--scheduler-set" in capsys.readouterr().err


def test_run_defaults_wave_buffers_and_half_duplex_links_with_their_settings():
    settings, scheduler = cluster_settings(["de_loader.buffer_bytes=1048576"]), {}
    run_defaults(settings, scheduler)
    assert settings == {"pe_receiver": {"buffer_bytes": NODE_BUFFER},
                        "de_loader": {"buffer_bytes": 1048576}}
    assert scheduler == {}           # full duplex, write_weight 0, arrival: the services' own
    assert (GatewayConfig().link_duplex, GatewayConfig().read_order) == ("full", "arrival")
    assert SchedulerConfig().write_weight == 0
    settings, scheduler = cluster_settings(['gateway.link_duplex="half"']), {}
    run_defaults(settings, scheduler)          # the old emulation: writes counted, reads shared
    assert settings["gateway"] == {"link_duplex": "half", "read_order": "shared"}
    assert scheduler == {"write_weight": 1}
    settings = cluster_settings(['gateway.link_duplex="half"', 'gateway.read_order="arrival"'])
    scheduler = scheduler_settings(["write_weight=0.5"])
    run_defaults(settings, scheduler)          # what was given stays
    assert settings["gateway"]["read_order"] == "arrival" and scheduler == {"write_weight": 0.5}


def test_the_results_name_how_the_storage_links_ran(tmp_path):
    """The services' defaults decide the links unless a setting did: the JSON says which."""
    from bench.engine_agents_bench import CONFIG
    from tools.cluster.real_engines import on_loopback

    def links(sections):
        return storage_links(on_loopback(CONFIG, tmp_path, mode="dualpath", sections=sections,
                                         storage_link_bytes_per_s=1e6,
                                         vllm_prefix_caching=False).cfg)

    assert links(None) == {"link_duplex": "full", "read_order": "arrival", "write_weight": 0}
    settings, scheduler = cluster_settings(['gateway.link_duplex="half"']), {}
    run_defaults(settings, scheduler)
    assert links(settings | {"scheduler": scheduler}) == {
        "link_duplex": "half", "read_order": "shared", "write_weight": 1}


def test_cluster_settings_are_toml_values_by_section(capsys):
    assert cluster_settings(["pe_receiver.buffer_bytes=536870912", "gateway.io_threads=4",
                             "pe_receiver.device=cpu"]) == {
        "pe_receiver": {"buffer_bytes": 536870912, "device": "cpu"},
        "gateway": {"io_threads": 4}}
    for bad, why in [("buffer_bytes=1", "SECTION.KEY"), ("pe_receiver.x", "SECTION.KEY"),
                     ("scheduler.beta_s=20", "--scheduler-set")]:
        with pytest.raises(ValueError, match=why):
            cluster_settings([bad])
    with pytest.raises(SystemExit) as exc:                 # refused before the trace is read
        main(["--set", "nodot=1", "--trace", "/nonexistent"])
    assert exc.value.code == 2 and "--set" in capsys.readouterr().err


def test_a_variant_takes_gateway_and_scheduler_settings_checked_before_the_run(capsys):
    """``--variant``: only the services restarted between modes, each value checked against
    its section now (a typo found minutes into the run would lose the run)."""
    assert variant_settings(['gateway.read_order="arrival"', "scheduler.beta_s=12"]) == {
        "gateway": {"read_order": "arrival"}, "scheduler": {"beta_s": 12}}
    for bad, why in [("pe_receiver.buffer_bytes=1", "restarted between modes"),
                     ('gateway.read_order="lifo"', r"\[gateway\] Invalid enum"),
                     ("scheduler.no_such_key=1", r"\[scheduler\].*no_such_key"),
                     ("beta_s=1", "SECTION.KEY")]:
        with pytest.raises(ValueError, match=why):
            variant_settings([bad])
    with pytest.raises(SystemExit) as exc:                 # refused before the trace is read
        main(["--variant", "de_loader.buffer_bytes=1", "--trace", "/nonexistent"])
    assert exc.value.code == 2 and "--variant" in capsys.readouterr().err


def test_the_oracle_bound_is_the_mean_of_both_oracle_runs_where_both_ran():
    both = {"oracle": {"jct_s": 30.0}, "oracle-repeat": {"jct_s": 34.0},
            "dualpath": {"jct_s": 38.0}}
    vs = versus_oracle(both, "dualpath")
    assert vs["value"] == 38.0 / 32.0 and not vs["met"]        # 1.19 > 1.15
    assert vs["oracle_jct_s"] == [30.0, 34.0] and vs["oracle_spread"] == 4.0 / 32.0
    quick = {"oracle": {"jct_s": 32.0}, "dualpath": {"jct_s": 36.0}}   # --quick: one oracle
    vs = versus_oracle(quick, "dualpath")
    assert vs["value"] == 36.0 / 32.0 and vs["met"] and vs["oracle_jct_s"] == [32.0]
    assert vs["oracle_spread"] == 0.0
    assert versus_oracle({"oracle": {"jct_s": 40.0}, "d": {"jct_s": 44.0}}, "d")["met"]


def test_a_variant_is_compared_over_a_b_b_a_so_a_drift_of_the_host_cancels():
    """A host slowing 2 s per mode: A 40, B 42, B 44, A 46 — the means tie (no effect), where
    the first pair alone would credit A with 5 %."""
    modes = {"oracle": {"jct_s": 38.0}, "dualpath": {"jct_s": 40.0},
             "dualpath-variant": {"jct_s": 42.0}, "dualpath-variant-repeat": {"jct_s": 44.0},
             "dualpath-repeat": {"jct_s": 46.0}}
    fig = variant_figures(modes)
    assert fig["variant_speedup_vs_dualpath"] == 1.0
    assert fig["variant_pairs"] == [40.0 / 42.0, 46.0 / 44.0]
    assert fig["variant_vs_oracle"] == 42.0 / 38.0


def test_beta_is_profiled_from_the_cold_first_turns_in_the_schedulers_load_unit():
    from services.compute_model.cost_model import PrefillLoad, cost_model

    sessions = [Session("a", [[1] * 300, [1] * 310]), Session("b", [[2] * 500, [2] * 520])]
    # raw prompt tokens: 800 tokens in 2 s = 400 tokens/s, β = 5 s of it
    raw = profile_pe(sessions, 2.0, {"pe_load": "tokens"}, "smollm2-135m-f32")
    assert (raw["load_units"], raw["pe_tokens_per_s"], raw["beta"]) == (800, 400.0, 2000)
    # the default unit: each cold prompt at its cost in reference-shape tokens, β over beta_s
    model = "smollm2-135m-f32"
    load = PrefillLoad(cost_model(model), 32_721, 429)
    cost = profile_pe(sessions, 4.0, {"beta_s": 10.0}, model)
    assert cost["load_units"] == load(0, 300) + load(0, 500) != 800
    assert cost["beta"] == int(cost["load_units"] / 4.0 * 10.0)
    assert cost["beta_derived_from_cost_model"] == SchedulerConfig(model=model,
                                                                   beta_s=10.0).resolved_beta()
    # what the scheduler does with it: β = the profiled rate x beta_s
    assert SchedulerConfig(model=model, pe_tokens_per_s=cost["pe_tokens_per_s"],
                           beta_s=10.0).resolved_beta() == int(cost["pe_tokens_per_s"] * 10.0)


def test_a_modes_ttft_split_is_the_mean_of_its_timed_turns_parts():
    """The mean Sch./A./R./PF. over the timed (later) turns that carry the scheduler's split;
    the first turns and a turn served without one are left out, and their count is stated."""
    from tools.stream_client import Streamed

    def turn(session: str, k: int, parts: dict[str, float] | None) -> dict:
        got = Streamed()
        got.arrivals, got.tokens, got.done_at = [got.sent_at + 0.1], [7], got.sent_at + 0.2
        got.dualpath = {"hit_tokens": 64 * k, "read_side": "de", "ttft_s": 0.1,
                        "ttft_parts_s": parts}
        return {"session": session, "turn": k, "prompt": 100 * (k + 1), "got": got}

    def split(sched: float, read: float) -> dict[str, float]:
        return {"sched": sched, "alloc": 0.01, "read": read, "prefill": 0.2,
                "total": sched + 0.01 + read + 0.2}

    run = {"jct_s": 3.0, "first_turns_s": 1.0,
           "turns": [turn("a", 0, split(9.0, 9.0)), turn("a", 1, split(0.5, 1.0)),
                     turn("b", 1, split(1.5, 3.0)), turn("b", 2, None)]}
    ref = {(t["session"], t["turn"]): [7] for t in run["turns"]}
    got = figures("dualpath", run, ref)["ttft_parts_ms"]
    assert got == {"sched": 1000.0, "alloc": 10.0, "read": 2000.0, "prefill": 200.0,
                   "total": 3210.0, "n": 2}, got
    # each timed turn's last token came 0.1 s after its send and its stream ended at 0.2 s
    wait = figures("dualpath", run, ref)["outcome_wait_ms"]
    assert (wait["n"], round(wait["mean"])) == (3, 100), wait
    run["turns"] = [turn("a", 1, None)]
    assert figures("recompute", run, ref)["ttft_parts_ms"] == {"n": 0}
