"""The torch-free parts of integrations/vllm, in the main venv (no vLLM needed): the local
Full Block store, the KV-spec check, the plan checks of the engine source."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import InvalidArgument, KVSpecMismatch
from common.kv import PRESETS, KVSpec, block_keys_from_tokens
from integrations.vllm.engine_source import EngineSource
from integrations.vllm.kv_spec import check_same_layout
from integrations.vllm.local_store import LocalKVStore
from services.engine_api.prompt import make_prompt

SPEC = KVSpec("t", 3, 16)
BT = SPEC.block_tokens


def run_prompt(store: LocalKVStore, ids: list[int], fill: int) -> int:
    """One prompt through a session: load the hit, write the new KV, finish; the hit."""
    s = store.open_prefill("r", ids, store.planned_hit({}, ids), 1.0)
    for layer in range(SPEC.num_layers):
        s.layer(layer, 1.0)
        s.output(layer)[:] = fill + layer
        s.put_layer(layer)
    s.finish(0)
    return s.hit_tokens


def test_local_store_hits_the_stored_prefix_and_keeps_one_token_to_compute(tmp_path):
    store = LocalKVStore(tmp_path, SPEC)
    ids = list(range(3 * BT + 10))
    assert run_prompt(store, ids, 1) == 0
    assert len(list(tmp_path.glob("*.kv"))) == 3
    # the same prompt: every stored block is a hit; a prompt of exactly 3 blocks leaves one
    # block to compute (vLLM needs the last token's logits)
    assert store.planned_hit({}, ids) == 3 * BT
    assert store.planned_hit({}, ids[:3 * BT]) == 2 * BT
    s = store.open_prefill("r2", ids + [7] * 60, 3 * BT, 1.0)
    assert s.hit_tokens == 3 * BT
    want = np.fromfile(tmp_path / f"{block_keys_from_tokens(ids, BT)[1]}.kv", np.uint8)
    assert np.array_equal(s.layer(2, 1.0)[BT:2 * BT], want.reshape(3, BT, 16)[2])
    assert (s.layer(0, 1.0) == 1).all() and (s.layer(2, 1.0) == 3).all()


def test_local_store_refuses_finish_before_every_layer_is_put(tmp_path):
    store = LocalKVStore(tmp_path, SPEC)
    s = store.open_prefill("r", list(range(2 * BT)), 0, 1.0)
    s.put_layer(0)
    with pytest.raises(InvalidArgument, match="not put"):
        s.finish(1)
    assert not list(tmp_path.glob("*.kv"))


def test_a_store_written_by_another_model_is_refused_naming_both_specs(tmp_path):
    LocalKVStore(tmp_path, SPEC)
    with pytest.raises(KVSpecMismatch, match="4 layers x 256 B/token.*3 layers x 16"):
        LocalKVStore(tmp_path, PRESETS["test-small"])


def test_kv_spec_mismatch_names_both():
    model = KVSpec("vllm:m", 30, 768, dtype="bfloat16")
    check_same_layout(model, PRESETS["smollm2-135m"], "cluster")
    with pytest.raises(KVSpecMismatch, match="30 layers x 768.*64 layers x 4096"):
        check_same_layout(model, PRESETS["qwen2.5-32b"], "cluster")


@pytest.mark.parametrize("hit,want", [(128, 128), (100, 0), (-64, 0), ("64", 0), (640, 0)])
def test_engine_source_takes_only_whole_block_hits_below_the_prompt(hit, want):
    src = EngineSource("/nonexistent", "p0.e0", "prefill", SPEC, 1.0)
    assert src.planned_hit({"hit_tokens": hit}, list(range(600))) == want
    dec = EngineSource("/nonexistent", "d0.e0", "decode", SPEC, 1.0)
    assert dec.planned_hit({}, list(range(600))) == 599


def test_engine_source_refuses_a_plan_for_other_tokens():
    ids = list(range(3 * BT + 5))
    info = make_prompt(SPEC, request_id="r", attempt=0, session_id="s", prompt_tokens=len(ids),
                       hit_tokens=BT, gen_tokens=2, hit_keys=block_keys_from_tokens(ids, BT)[:1],
                       new_keys=block_keys_from_tokens(ids, BT)[1:], tail_token_ids=ids[-5:],
                       read_side="pe", max_prompt_tokens=10_000)
    src = EngineSource("/nonexistent", "p0.e0", "prefill", SPEC, 1.0)
    src._check_prompt(info, ids)
    other = list(ids)
    other[70] += 1
    with pytest.raises(InvalidArgument, match="keys"):
        src._check_prompt(info, other)
    with pytest.raises(InvalidArgument, match="prompt tokens"):
        src._check_prompt(info, ids[:-1])


def _vllm_config(tp=1, pp=1, prefix=False, **model):
    from types import SimpleNamespace as NS
    return NS(parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp),
              model_config=NS(**model), cache_config=NS(enable_prefix_caching=prefix))


def test_unsupported_vllm_instances_are_refused_at_start_naming_the_reason():
    from integrations.vllm.kv_spec import check_supported

    check_supported(_vllm_config())                                     # TP=PP=1, plain KV
    for cfg, why in ((_vllm_config(tp=2), "tensor_parallel_size=2"),
                     (_vllm_config(pp=2), "pipeline_parallel_size=2"),
                     (_vllm_config(use_mla=True), "MLA"),
                     (_vllm_config(is_hybrid=True), "hybrid"),
                     (_vllm_config(prefix=True), "--no-enable-prefix-caching")):
        with pytest.raises(ValueError, match=why):
            check_supported(cfg)
