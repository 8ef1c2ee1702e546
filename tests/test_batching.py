"""Intra-engine batching (300 ms quota, binary-searched chunked prefill) and the cost model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import AlreadyExists, InvalidArgument
from common.kv import PRESETS as KV_PRESETS
from services.compute_model.batching import PrefillBatcher, max_chunk, plan_batch
from services.compute_model.cost_model import PRESETS, causal_pairs, cost_model

MODELS = sorted(PRESETS)


def brute_chunk(cost, cached: int, new: int, budget: float) -> int:
    return max((k for k in range(new + 1) if cost(cached, k) <= budget), default=0)


# ============================================================================ cost model

def test_presets_match_kv_presets():
    assert set(PRESETS) == set(KV_PRESETS)
    with pytest.raises(InvalidArgument):
        cost_model("gpt-9")


@given(st.integers(0, 300), st.integers(0, 300), st.one_of(st.none(), st.integers(1, 400)))
def test_causal_pairs_closed_form(cached, new, window):
    brute = sum(min(cached + i, window) if window else cached + i for i in range(1, new + 1))
    assert causal_pairs(cached, new, window) == brute


@pytest.mark.parametrize("model, lo, hi", [("qwen2.5-32b", 117, 267), ("deepseek-v3.2", 13, 36)])
def test_cache_compute_ratio_matches_paper_table1(model, lo, hi):
    m, bpt = cost_model(model), KV_PRESETS[model].bytes_per_token
    r16 = m.cache_compute_ratio(bpt, 16 * 1024, 429)
    r64 = m.cache_compute_ratio(bpt, 64 * 1024, 429)
    assert r16 == pytest.approx(lo, rel=0.08) and r64 == pytest.approx(hi, rel=0.03)
    if model == "deepseek-v3.2":     # "≈22 GB/PFLOP" at the trace's 32.7K context
        assert m.cache_compute_ratio(bpt, 32_721, 429) == pytest.approx(22, rel=0.05)


@pytest.mark.parametrize("model", MODELS)
def test_costs_are_monotone_and_additive_pieces(model):
    m = cost_model(model)
    assert m.attention_s(0, 0) == 0.0 and m.prefill_s(1000, 0) == 0.0
    assert m.attention_s(1000, 200) < m.attention_s(1000, 201) < m.attention_s(5000, 201)
    assert m.prefill_s(1000, 200) > m.attention_s(1000, 200)
    assert m.decode_step_s(0, 0) == 0.0 and m.decode_step_s(8, 10**5) > m.decode_step_s(8, 10)
    assert m.prompt_tokens_per_s(32_721, 429) > 0


# ============================================================================ binary search

@settings(max_examples=150, deadline=None)
@given(st.sampled_from(MODELS), st.integers(0, 70_000), st.integers(0, 600),
       st.floats(0, 0.05, allow_nan=False))
def test_max_chunk_equals_brute_force(model, cached, new, budget):
    cost = cost_model(model).attention_s
    assert max_chunk(cost, cached, new, budget) == brute_chunk(cost, cached, new, budget)


def test_max_chunk_edges():
    cost = lambda c, n: float(n)     # noqa: E731  one second per token
    assert max_chunk(cost, 0, 10, 3.5) == 3
    assert max_chunk(cost, 0, 10, 100) == 10
    assert max_chunk(cost, 0, 10, -1) == 0
    assert max_chunk(cost, 0, 0, 5) == 0


def binary_chunk(cost, cached: int, new: int, budget: float) -> int:
    """The plain binary search ``max_chunk`` must agree with (for large ``new``)."""
    if budget < 0 or new <= 0:
        return 0
    if cost(cached, new) <= budget:
        return new
    lo, hi = 0, new
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(cached, mid) <= budget else (lo, mid)
    return lo


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(MODELS), st.integers(0, 100_000), st.integers(0, 40_000),
       st.floats(0, 2.0, allow_nan=False))
def test_max_chunk_equals_binary_search_on_long_prompts(model, cached, new, budget):
    cost = cost_model(model).attention_s
    assert max_chunk(cost, cached, new, budget) == binary_chunk(cost, cached, new, budget)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=300),
       st.floats(-1, 1500, allow_nan=False), st.floats(0, 5, allow_nan=False))
def test_max_chunk_on_any_monotone_cost(steps, budget, base):
    # Plateaus, jumps and a cost(0) above the budget: interpolation guesses are poor here, the
    # search must still return the largest fitting chunk (what brute force finds).
    table = [base]
    for d in steps:
        table.append(table[-1] + d)
    cost = lambda c, n: table[n]     # noqa: E731
    new = len(table) - 1
    want = binary_chunk(cost, 0, new, budget)
    assert max_chunk(cost, 0, new, budget) == want
    if base <= budget:
        assert want == brute_chunk(cost, 0, new, budget)


@pytest.mark.parametrize("model", MODELS)
def test_cost_closures_equal_methods_bit_for_bit(model):
    m = cost_model(model)
    attn, pre = m.attention_fn(), m.prefill_fn()
    for cached in (0, 1, 63, 1000, 2047, 2048, 2049, 32_721, 100_000):
        for new in (0, 1, 2, 429, 2048, 8192, 65_536):
            assert attn(cached, new) == m.attention_s(cached, new)
            assert pre(cached, new) == m.prefill_s(cached, new)


# ============================================================================ plan_batch

QUEUES = st.lists(st.tuples(st.integers(0, 60_000), st.integers(1, 4_000)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(MODELS), QUEUES, st.sampled_from([0.01, 0.05, 0.3]))
def test_plan_respects_quota_is_fifo_and_cuts_maximally(model, queue, quota):
    cost = cost_model(model).attention_s
    plan = plan_batch(queue, cost, quota)
    assert plan, "the head always advances"
    assert [i for i, _ in plan] == list(range(len(plan)))          # FIFO prefix, no skipping
    used = sum(cost(queue[i][0], k) for i, k in plan)
    forced = plan == [(0, 1)] and cost(queue[0][0], 1) > quota
    assert used <= quota + 1e-12 or forced
    *whole, (last_i, last_k) = plan
    assert all(k == queue[i][1] for i, k in whole)                   # only the last is cut
    if not forced:
        before = sum(cost(queue[i][0], k) for i, k in whole)
        c, n = queue[last_i]
        assert last_k == brute_chunk(cost, c, n, quota - before)    # maximal chunk
        if last_k == n and last_i + 1 < len(queue):                # stopped: the next didn't fit
            c2, _ = queue[last_i + 1]
            assert before + cost(c, n) + cost(c2, 1) > quota


def test_plan_chunks_request_that_crosses_quota():
    cost = lambda c, n: float(n)     # noqa: E731  exact arithmetic: one unit per token
    assert plan_batch([(0, 100), (0, 150), (0, 500)], cost, 300) == [(0, 100), (1, 150), (2, 50)]
    assert plan_batch([(0, 100), (0, 500)], cost, 300, max_tokens=250) == [(0, 100), (1, 150)]


def test_head_too_big_for_quota_still_progresses():
    cost = lambda c, n: 1.0 + n      # noqa: E731  one token alone exceeds the quota
    assert plan_batch([(0, 5), (0, 5)], cost, 0.3) == [(0, 1)]


# ============================================================================ PrefillBatcher

@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MODELS), QUEUES, st.sampled_from([0.02, 0.3]))
def test_batcher_drains_every_token_in_fifo_order(model, queue, quota):
    cost = cost_model(model).attention_s
    b = PrefillBatcher(cost, quota)
    for i, (c, n) in enumerate(queue):
        b.add(f"r{i}", c, n)
    progress = {f"r{i}": c for i, (c, _) in enumerate(queue)}
    finished = []
    while (batch := b.next_batch()) is not None:
        assert batch.predicted_s <= quota + 1e-12 or len(batch.items) == 1
        assert batch.tokens == sum(it.new for it in batch.items)
        for it in batch.items:
            assert it.cached == progress[it.request_id]          # chunks are contiguous
            progress[it.request_id] += it.new
            if it.last:
                finished.append(it.request_id)
    assert finished == [f"r{i}" for i in range(len(queue))]
    assert all(progress[f"r{i}"] == c + n for i, (c, n) in enumerate(queue))
    assert len(b) == 0 and b.pending_tokens == 0


def test_batcher_300ms_default_and_chunk_carries_over():
    m = cost_model("deepseek-v3.2")
    b = PrefillBatcher(m.attention_s)
    assert b.quota_s == 0.3
    b.add("long", 60_000, 30_000)
    b.add("short", 1_000, 100)
    first = b.next_batch()
    assert [it.request_id for it in first.items] == ["long"] and not first.items[0].last
    assert first.predicted_s <= 0.3
    assert m.attention_s(60_000, first.items[0].new + 1) > 0.3       # the chunk is maximal
    second = b.next_batch()
    assert second.items[0].cached == 60_000 + first.items[0].new


def test_batcher_bad_input_and_cancel():
    b = PrefillBatcher(lambda c, n: n * 1e-3)
    b.add("a", 0, 10)
    with pytest.raises(AlreadyExists):
        b.add("a", 0, 10)
    with pytest.raises(InvalidArgument):
        b.add("z", 0, 0)
    with pytest.raises(InvalidArgument):
        PrefillBatcher(lambda c, n: 0.0, quota_s=0)
    b.add("b", 0, 5)
    assert b.cancel("a") and not b.cancel("a")
    assert b.pending_tokens == 5 and [it.request_id for it in b.next_batch().items] == ["b"]
    assert b.next_batch() is None


def test_vllm_budget_is_the_quota_chunk_at_the_reference_context():
    """The token budget handed to vLLM: n tokens over the reference context fit the quota,
    n + 1 do not; a longer quota never gives fewer tokens, a longer context never more."""
    from services.compute_model.batching import vllm_budget
    from services.compute_model.cost_model import cost_model

    cost = cost_model("deepseek-v3.2").attention_s
    b = vllm_budget(cost, 32_721)
    n = b["max_num_batched_tokens"]
    assert b["long_prefill_token_threshold"] == n
    assert cost(32_721, n) <= 0.300 < cost(32_721, n + 1)
    assert vllm_budget(cost, 32_721, quota_s=0.6)["max_num_batched_tokens"] > n
    assert vllm_budget(cost, 65_536)["max_num_batched_tokens"] < n
    assert vllm_budget(cost, 10**9)["max_num_batched_tokens"] == 1     # always progress
    with pytest.raises(InvalidArgument):
        vllm_budget(cost, -1)
