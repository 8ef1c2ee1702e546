"""The scheduler core on hand-built states: one test per placement rule of paper §6,
and the builders the other core tests share (``test_scheduler_read_side.py``,
``test_scheduler_replans.py``, ``test_scheduler_properties.py``, ``test_scheduler_share.py``)."""

from __future__ import annotations

import pytest

from common.config import build_config
from common.errors import ConfigError, InvalidArgument
from common.kv import PRESETS as KV_PRESETS
from services.scheduler.core.config import SchedulerConfig
from services.scheduler.core.records import (EngineReport, EngineSpec, Phase, Request, Role, Telemetry)
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core import policy
from services.compute_model.cost_model import PrefillLoad, cost_model

ALPHA, BETA = 1_000, 1_000
BIG = 10**12


def cfg(**kw) -> SchedulerConfig:
    """The rule tests count in raw prompt tokens (hand-checkable) and run Algorithm 1 with β
    alone; the cost-weighted PE load and the PE fair share (both on by default) have their own
    tests below (``test_pe_load_*``, ``test_pe_share_*``) and run in the property tests."""
    kw.setdefault("alpha_tokens", ALPHA)
    kw.setdefault("beta_tokens", BETA)
    kw.setdefault("pe_load", "tokens")
    kw.setdefault("pe_share", 0.0)
    return SchedulerConfig(**kw)


def pe(eid: str, node: str, group: str | None = None) -> EngineSpec:
    return EngineSpec(eid, Role.PREFILL, node, group)


def de(eid: str, node: str, group: str | None = None, hbm: int = BIG) -> EngineSpec:
    return EngineSpec(eid, Role.DECODE, node, group, hbm_capacity_bytes=hbm)


def req(i: int | str, hit: int = 100, new: int = 10, gen: int = 0, hbm: int = 1) -> Request:
    return Request(f"r{i}", "s", hit, new, gen, hbm)


def load(s: Scheduler, *reports: tuple, read_q: dict[str, int] | None = None) -> None:
    """Hand-set engine figures: (engine, seq, tok[, free_hbm])."""
    s.apply_telemetry(Telemetry(tuple(EngineReport(*r) for r in reports), read_q or {}))


def bind_all(s: Scheduler) -> None:
    for g in s.group_ids(Role.DECODE):
        s.on_de_group_fetch(g)


def one_de(s_specs: list[EngineSpec]) -> list[EngineSpec]:
    """A decode node far away with one roomy DE (its read queue kept huge where it matters)."""
    return s_specs + [de("d0", "D")]


def _pair(**kw) -> Scheduler:
    return Scheduler(cfg(**kw), [pe("p0", "P"), pe("p1", "P"), de("d0", "D"), de("d1", "D")])


# ============================================================================ PE: Algorithm 1

def test_c1_engine_never_gets_work():
    s = Scheduler(cfg(), one_de([pe("p0", "P"), pe("p1", "P"), pe("p2", "P")]))
    load(s, ("p0", 0, BETA + 1), ("p1", 0, 500), ("p2", 0, 600))
    for i in range(6):
        s.submit(req(i, hit=0, new=100))
    bind_all(s)
    out = s.on_pe_group_fetch("P")
    assert out and all(a.pe_engine != "p0" for a in out)


def test_c2_preferred_over_c3_even_with_larger_tok():
    # One group spanning two nodes: A's read queue is long (C3), B's short (C2).
    s = Scheduler(cfg(), one_de([pe("pa", "A", "G"), pe("pb", "B", "G")]))
    load(s, ("pa", 0, 0), ("pb", 0, 900), read_q={"A": ALPHA + 1, "B": ALPHA, "D": BIG})
    s.submit(req(0, hit=0, new=50))
    bind_all(s)
    [a] = s.on_pe_group_fetch("G")
    assert a.pe_engine == "pb"


def test_c3_used_when_c2_empty():
    s = Scheduler(cfg(), one_de([pe("pa", "A", "G"), pe("pb", "B", "G")]))
    load(s, ("pa", 0, 300), ("pb", 0, BETA + 5), read_q={"A": ALPHA + 1, "B": 0})
    s.submit(req(0, hit=0))
    bind_all(s)
    assert [a.pe_engine for a in s.on_pe_group_fetch("G")] == ["pa"]


def test_smallest_tok_within_category_ties_to_first_registered():
    s = Scheduler(cfg(), one_de([pe("p0", "P"), pe("p1", "P"), pe("p2", "P")]))
    load(s, ("p0", 0, 300), ("p1", 0, 100), ("p2", 0, 100))
    s.submit(req(0, hit=0, new=1))
    bind_all(s)
    assert s.on_pe_group_fetch("P")[0].pe_engine == "p1"


def test_tok_updated_within_one_fetch_engine_crosses_beta():
    s = Scheduler(cfg(), one_de([pe("p0", "P"), pe("p1", "P")]))
    load(s, ("p1", 0, 500))
    for i in range(5):
        s.submit(req(i, hit=0, new=600))
    bind_all(s)
    out = s.on_pe_group_fetch("P")
    # p0: 0 -> 600; p1: 500 -> 1100 (> β, now C1); p0: 600 -> 1200; then both C1: stop.
    assert [a.pe_engine for a in out] == ["p0", "p1", "p0"]
    assert s.engine_report("p0").tok == 1200 and s.engine_report("p1").tok == 1100
    assert s.pe_queue() == ["r3", "r4"]


def test_stop_when_no_engine_eligible():
    s = Scheduler(cfg(), one_de([pe("p0", "P")]))
    load(s, ("p0", 3, BETA + 1))
    s.submit(req(0))
    bind_all(s)
    assert s.on_pe_group_fetch("P") == []
    assert s.phase("r0") is Phase.BOUND and s.pe_queue() == ["r0"]


def test_category_reevaluated_when_read_queue_grows_inside_fetch():
    # pa's node is 10 tokens under α; the first request's read lands there (DE node busier),
    # so A moves to C3 and the second request goes to pb on B despite its larger tok_e.
    s = Scheduler(cfg(), one_de([pe("pa", "A", "G"), pe("pb", "B", "G")]))
    load(s, ("pa", 0, 0), ("pb", 0, 400), read_q={"A": ALPHA - 10, "B": 0, "D": BIG})
    s.submit(req(0, hit=100, new=1))
    s.submit(req(1, hit=100, new=1))
    bind_all(s)
    out = s.on_pe_group_fetch("G")
    assert [(a.pe_engine, a.read_node) for a in out] == [("pa", "A"), ("pb", "B")]
    assert s.read_queue("A") == ALPHA + 90


def test_pe_fetch_only_uses_fetching_groups_engines():
    s = Scheduler(cfg(), one_de([pe("p0", "P0"), pe("p1", "P1")]))
    load(s, ("p0", 0, 900))
    s.submit(req(0, hit=0))
    bind_all(s)
    assert s.on_pe_group_fetch("P0")[0].pe_engine == "p0"


def test_pe_queue_is_fifo_by_arrival_across_de_groups():
    s = Scheduler(cfg(), [pe("p0", "P"), de("d0", "D0"), de("d1", "D1")])
    for i in range(6):
        s.submit(req(i, hit=0, new=1))
    s.on_de_group_fetch("D1")   # binds D1's share first
    s.on_de_group_fetch("D0")
    assert [a.request_id for a in s.on_pe_group_fetch("P")] == [f"r{i}" for i in range(6)]


@pytest.mark.parametrize("mode", ["dualpath", "basic"])
def test_a_pe_node_gets_no_more_prompts_than_its_buffer_holds(mode):
    """Two PEs on one node sharing its buffer, which holds four 110-token prompts' KV (10 B a
    token), and a β that would take them all: of six requests four are placed, two wait in
    the PE queue; a prefill done frees its room and the next fetch places the next in line."""
    per_token, cap = 10, 4 * 110 * 10 + 5
    specs = [EngineSpec("p0", Role.PREFILL, "P", hbm_capacity_bytes=cap),
             EngineSpec("p1", Role.PREFILL, "P", hbm_capacity_bytes=cap)]
    s = Scheduler(cfg(policy=mode, beta_tokens=10**6, pe_buffer_admission=True), one_de(specs))
    for i in range(6):
        s.submit(Request.sized(f"r{i}", "s", 100, 10, 5, per_token))
    bind_all(s)
    first = s.on_pe_group_fetch("P")
    assert [a.request_id for a in first] == ["r0", "r1", "r2", "r3"]
    assert sorted(a.pe_engine for a in first) == ["p0", "p0", "p1", "p1"]
    assert s.pe_queue() == ["r4", "r5"] and s.on_pe_group_fetch("P") == []
    assert s.engine_report("p0").free_hbm_bytes == 5
    s.prefill_done(first[0].request_id)
    again = s.on_pe_group_fetch("P")
    assert [a.request_id for a in again] == ["r4"]
    # the node's own figure replaces the core's: a full buffer reported blocks the node
    s.prefill_done(again[0].request_id)
    load(s, ("p0", 2, 220, 0), ("p1", 2, 220, 0))
    assert s.on_pe_group_fetch("P") == []
    load(s, ("p0", 2, 220, 1100), ("p1", 2, 220, 1100))
    assert [a.request_id for a in s.on_pe_group_fetch("P")] == ["r5"]


@pytest.mark.parametrize("bypass", [0, 2])
def test_small_prompts_pass_a_head_that_does_not_fit_yet_within_its_bypass_budget(bypass):
    """One PE with room for 100 tokens of KV: a 60-token prompt is placed, a 90-token head
    does not fit beside it; the 20-token prompts behind it are placed past it (first fit) up
    to ``pe_buffer_bypass``, then the head keeps its turn: when room frees it goes next."""
    s = Scheduler(cfg(beta_tokens=10**6, pe_buffer_admission=True, pe_buffer_bypass=bypass),
                  one_de([EngineSpec("p0", Role.PREFILL, "P", hbm_capacity_bytes=1000)]))
    for rid, new in [("a", 60), ("big", 90), ("s1", 10), ("s2", 10), ("s3", 10)]:
        s.submit(Request.sized(rid, "s", 0, new, 0, 10))
    bind_all(s)
    placed = [a.request_id for a in s.on_pe_group_fetch("P")]
    assert placed == ["a", *["s1", "s2"][:bypass]]
    assert s.pe_queue()[0] == "big"
    assert s.on_pe_group_fetch("P") == []                       # budget spent / strict order
    for rid in placed:
        s.prefill_done(rid)
    assert [a.request_id for a in s.on_pe_group_fetch("P")][0] == "big"


def test_past_a_blocked_head_the_smallest_prompts_go_first():
    """Room for 40 tokens beside the first request, the head (90) does not fit: behind it
    35, 10, 10, 10 — the three 10s are placed (arrival order would take the 35 and stop)."""
    s = Scheduler(cfg(beta_tokens=10**6, pe_buffer_admission=True),
                  one_de([EngineSpec("p0", Role.PREFILL, "P", hbm_capacity_bytes=1000)]))
    for rid, new in [("a", 60), ("big", 90), ("m", 35), ("s1", 10), ("s2", 10), ("s3", 10)]:
        s.submit(Request.sized(rid, "s", 0, new, 0, 10))
    bind_all(s)
    assert [a.request_id for a in s.on_pe_group_fetch("P")] == ["a", "s1", "s2", "s3"]
    assert s.pe_queue() == ["big", "m"]


def test_an_idle_pe_node_takes_a_prompt_larger_than_its_buffer():
    """Never waits for ever: a prompt larger than the whole buffer goes to a node holding
    nothing (and fails there, typed), not left in the queue."""
    s = Scheduler(cfg(pe_buffer_admission=True),
                  one_de([EngineSpec("p0", Role.PREFILL, "P", hbm_capacity_bytes=100)]))
    s.submit(Request.sized("big", "s", 0, 50, 0, 10))        # 500 B of prompt KV
    s.submit(Request.sized("next", "s", 0, 5, 0, 10))
    bind_all(s)
    assert [a.request_id for a in s.on_pe_group_fetch("P")] == ["big"]
    assert s.pe_queue() == ["next"]


def test_buffer_admission_can_be_turned_off_and_is_unchecked_without_a_stated_buffer():
    assert SchedulerConfig().pe_buffer_admission             # on by default
    tiny = [EngineSpec("p0", Role.PREFILL, "P", hbm_capacity_bytes=100)]
    for admit, specs in ((False, tiny), (True, [pe("p0", "P")])):
        s = Scheduler(cfg(beta_tokens=10**6, pe_buffer_admission=admit), one_de(specs))
        for i in range(5):
            s.submit(Request.sized(f"r{i}", "s", 100, 10, 0, 10**9))
        bind_all(s)
        assert len(s.on_pe_group_fetch("P")) == 5


# ============================================================================ DE phase 1

def _three_de_groups(**kw) -> Scheduler:
    specs = [pe("p0", "P")] + [de(f"d{g}.{i}", f"D{g}") for g in range(3) for i in range(2)]
    return Scheduler(cfg(**kw), specs)


def test_phase1_smallest_group_sum_updated_after_each_assignment():
    s = _three_de_groups()
    # Σ tok_e: D0 = 300, D1 = 100, D2 = 200. D0 fetches but has no free HBM, so phase 2 binds
    # nothing and the private queues show phase 1's choices.
    load(s, ("d0.0", 0, 150, 0), ("d0.1", 0, 150, 0), ("d1.0", 0, 50), ("d1.1", 0, 50),
         ("d2.0", 0, 100), ("d2.1", 0, 100))
    for i in range(5):
        s.submit(req(i, hit=100, new=40, gen=10, hbm=5))     # 150 DE tokens each
    assert s.on_de_group_fetch("D0") == []
    # D1 100→250, D2 200→350, D1 250→400, D0 300→450, D2 350→500
    assert s.private_queue("D1") == ["r0", "r2"]
    assert s.private_queue("D2") == ["r1", "r4"]
    assert s.private_queue("D0") == ["r3"]


def test_phase1_counts_private_queue_across_fetches():
    s = _three_de_groups()
    load(s, *[(f"d{g}.{i}", 0, 0, 0) for g in range(3) for i in range(2)])  # nobody has room
    s.submit(req(0, hit=100, new=50))
    s.on_de_group_fetch("D0")
    s.submit(req(1, hit=100, new=50))
    s.on_de_group_fetch("D0")
    assert s.private_queue("D0") == ["r0"] and s.private_queue("D1") == ["r1"]


# ============================================================================ DE phase 2

def _de_group(n: int, **kw) -> Scheduler:
    return Scheduler(cfg(**kw), [pe("p0", "P")] + [de(f"d{i}", "D") for i in range(n)])


def test_z_threshold_hand_computed_and_smallest_seq_among_rest():
    s = _de_group(4)
    load(s, ("d0", 5, 0), ("d1", 1, 100), ("d2", 3, 200), ("d3", 0, 900))
    s.submit(req(0, hit=60, new=30, gen=10))   # len = 100
    s.submit(req(1, hit=60, new=30, gen=10))
    s._spread()                                # phase 1 only, to look at Z
    g = s._groups[Role.DECODE]["D"]
    # Z = 1.05 · (Σ len_R + Σ tok_e) / |E| = 1.05 · (200 + 1200) / 4 = 367.5
    assert policy.high_token_threshold(g, 1.05) == pytest.approx(367.5)
    out = s.on_de_group_fetch("D")
    # r0: rest = {d0, d1, d2} (d3: 900+100 > Z) → smallest seq = d1 (seq 1 → 2, tok 200)
    # r1: rest = {d0 (5), d1 (2), d2 (3)} → d1 again
    assert [b.de_engine for b in out] == ["d1", "d1"]
    assert s.engine_report("d1") == EngineReport("d1", 3, 300, s.engine_report("d1").free_hbm_bytes)


def test_high_token_fallback_smallest_tok():
    s = _de_group(3)
    load(s, ("d0", 0, 500), ("d1", 9, 300), ("d2", 1, 400))
    s.submit(req(0, hit=900, new=100))                # len 1000
    # Z = 1.05 · (1000 + 1200) / 3 = 770; every DE has tok + 1000 > Z → smallest tok_e: d1
    [b] = s.on_de_group_fetch("D")
    assert b.de_engine == "d1"


def test_only_des_with_enough_hbm_are_considered():
    s = _de_group(2)
    load(s, ("d0", 0, 0, 10), ("d1", 7, 500, 100))
    s.submit(req(0, hit=10, new=10, hbm=50))
    assert [b.de_engine for b in s.on_de_group_fetch("D")] == ["d1"]


def test_hbm_stop_at_head_no_skipping_and_r_set():
    s = _de_group(2)
    load(s, ("d0", 0, 0, 100), ("d1", 0, 0, 50))
    for i, h in enumerate((80, 80, 30)):
        s.submit(req(i, hit=10, new=10, hbm=h))
    s._spread()
    g = s._groups[Role.DECODE]["D"]
    # free 150 total: R = {r0} (80 + 80 > 150); Z = 1.05 · 20 / 2
    assert policy.high_token_threshold(g, 1.05) == pytest.approx(1.05 * 20 / 2)
    out = s.on_de_group_fetch("D")
    assert [(b.request_id, b.de_engine) for b in out] == [("r0", "d0")]
    assert s.private_queue("D") == ["r1", "r2"]          # r2 would fit, but FIFO head blocks
    assert s.engine_report("d0").free_hbm_bytes == 20


@pytest.mark.parametrize("mode", ["dualpath", "basic"])
def test_the_decode_engines_of_one_node_share_its_reported_de_buffer(mode):
    """Two DEs on one node, each with HBM for three requests, and the node's DE buffer (v7
    telemetry) for two: one placement pass binds two, not four — a binding to either engine
    takes its bytes off the one buffer figure; a completion gives them back, and a report
    replaces the figure (a full buffer blocks both engines, room reopens them)."""
    s = Scheduler(cfg(policy=mode), [pe("p0", "P"), de("d0", "D", hbm=300), de("d1", "D", hbm=300)])
    load(s, ("d0", 0, 0, 300, 200), ("d1", 0, 0, 300, 200))
    for i in range(5):
        s.submit(req(i, hit=10, new=10, hbm=100))
    first = s.on_de_group_fetch("D")
    assert [b.request_id for b in first] == ["r0", "r1"]
    assert sorted(b.de_engine for b in first) == ["d0", "d1"]
    assert s.private_queue("D") == ["r2", "r3", "r4"] and s.on_de_group_fetch("D") == []
    s.on_pe_group_fetch("P")
    s.complete("r0")
    assert [b.request_id for b in s.on_de_group_fetch("D")] == ["r2"]
    load(s, ("d0", 1, 20, 200, 0), ("d1", 1, 20, 200, 0))     # the node: its buffer is full
    assert s.on_de_group_fetch("D") == []
    load(s, ("d0", 1, 20, 200, 150), ("d1", 1, 20, 200, 150))
    assert [b.request_id for b in s.on_de_group_fetch("D")] == ["r3"]


def test_an_unreported_de_buffer_leaves_each_engines_hbm_the_only_limit():
    """Telemetry without ``buffer_free_bytes`` (a node that states none): as before v7."""
    s = Scheduler(cfg(), [pe("p0", "P"), de("d0", "D", hbm=300), de("d1", "D", hbm=300)])
    load(s, ("d0", 0, 0, 300), ("d1", 0, 0, 300))
    for i in range(7):
        s.submit(req(i, hit=10, new=10, hbm=100))
    assert len(s.on_de_group_fetch("D")) == 6


def test_de_memory_released_on_complete():
    s = _de_group(1)
    load(s, ("d0", 0, 0, 100))
    s.submit(req(0, hbm=100))
    s.submit(req(1, hbm=100))
    assert len(s.on_de_group_fetch("D")) == 1
    s.on_pe_group_fetch("P")
    s.complete("r0")
    assert [b.request_id for b in s.on_de_group_fetch("D")] == ["r1"]


# ============================================================================ PE load unit, config

def test_pe_load_counts_prefill_cost_in_reference_tokens():
    c = SchedulerConfig()                                   # pe_load = "cost" by default
    cost = cost_model(c.model)
    weigh = c.pe_load_fn()
    ref_h, ref_n = c.ref_context_tokens, c.ref_append_tokens
    assert weigh(ref_h, ref_n) == ref_h + ref_n             # β keeps its meaning at the ref shape
    per_s = (ref_h + ref_n) / cost.prefill_s(ref_h, ref_n)
    for hit, new in [(0, 300), (300, 8192), (16_000, 429), (0, 1)]:
        w = weigh(hit, new)
        assert w == round(cost.prefill_s(hit, new) * per_s) and w > hit + new
    assert weigh(0, 300) > 30 * 300                         # a cold token costs ~40 ref tokens
    assert weigh(60_000, 1) == 60_001                       # never below the raw prompt
    assert SchedulerConfig(pe_load="tokens").pe_load_fn() is None
    with pytest.raises(ConfigError, match="pe_load"):
        build_config({"pe_load": "flops"}, SchedulerConfig)
    with pytest.raises(InvalidArgument):
        PrefillLoad(cost, 100, 0)
    # The core books the weighted load on the PE (and drops it at prefill_done); the DE's load
    # stays the raw KV it will hold.
    s = Scheduler(SchedulerConfig(alpha_tokens=ALPHA), [pe("p0", "P"), de("d0", "D")])
    s.submit(req(0, hit=0, new=300, gen=7))
    bind_all(s)
    [a] = s.on_pe_group_fetch("P")
    assert s.engine_report("p0").tok == weigh(0, 300)
    assert s.engine_report("d0").tok == 307
    s.prefill_done("r0")
    assert s.engine_report("p0").tok == 0


def _burst(pe_load: str, n: int) -> tuple[list[int], int]:
    """``n`` cold 300-token turns (every agent's first round) on 4 one-GPU PE groups; the first
    group fetches first; β alone limits a fetch. Returns requests placed per group and β."""
    specs = [pe(f"p{i}", f"P{i}") for i in range(4)] + [de("d0", "D")]
    s = Scheduler(SchedulerConfig(pe_load=pe_load, beta_s=0.5, pe_share=0.0), specs)
    for i in range(n):
        s.submit(req(i, hit=0, new=300))
    bind_all(s)
    return [len(s.on_pe_group_fetch(g)) for g in s.group_ids(Role.PREFILL)], s.beta


def test_pe_load_cold_burst_is_spread_over_pe_groups():
    # Raw tokens: β (0.5 s of prefill at the reference shape) holds ~650 cold 300-token prompts,
    # i.e. ~19 s of their real work: the first group to fetch takes the whole burst.
    raw, beta = _burst("tokens", 60)
    assert raw == [60, 0, 0, 0]
    assert 60 * 300 <= beta
    # Cost-weighted: a group takes ≈ β worth of *work*, the rest goes to the other groups.
    weighted, beta = _burst("cost", 60)
    w = SchedulerConfig().pe_load_fn()(0, 300)
    per_engine = beta // w + 1                              # the last one may cross β
    assert 0 < 60 - 3 * per_engine <= per_engine
    assert weighted == [per_engine] * 3 + [60 - 3 * per_engine]


def test_config_defaults_derive_alpha_beta_and_reject_typos():
    c = SchedulerConfig()
    bpt = KV_PRESETS["deepseek-v3.2"].bytes_per_token
    assert c.resolved_alpha() == int(50e9 / bpt * 3)
    assert c.resolved_beta() == int(cost_model("deepseek-v3.2").prompt_tokens_per_s(32_721, 429) * 5)
    assert SchedulerConfig(pe_tokens_per_s=1000.0).resolved_beta() == 5000
    assert c.z_factor == 1.05
    assert c.pe_share == 1.0
    with pytest.raises(ConfigError, match="pe_share"):
        build_config({"pe_share": 0.5}, SchedulerConfig)
    with pytest.raises(ConfigError, match="betta"):
        build_config({"betta_s": 4}, SchedulerConfig)
    with pytest.raises(ConfigError, match="model"):
        build_config({"model": "gpt-9"}, SchedulerConfig)
