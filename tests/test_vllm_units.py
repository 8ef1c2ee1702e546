"""The torch-free parts of integrations/vllm, in the main venv (no vLLM needed): the local
Full Block store, the KV-spec check, the plan checks of the engine source, a decode session's
notices to its node."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from common.errors import InvalidArgument, KVSpecMismatch
from common.kv import PRESETS, KVSpec, block_keys_from_tokens
from integrations.vllm.decode_session import DecodeSession
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
    check_supported(_vllm_config(prefix=True))          # vLLM's default: served (rows.py)
    for cfg, why in ((_vllm_config(tp=2), "tensor_parallel_size=2"),
                     (_vllm_config(pp=2), "pipeline_parallel_size=2"),
                     (_vllm_config(use_mla=True), "MLA"),
                     (_vllm_config(is_hybrid=True), "hybrid")):
        with pytest.raises(ValueError, match=why):
            check_supported(cfg)


# vLLM's local hit (prefix caching) against the dualpath hit, prefill side: hit 768 of a
# 1,000-token prompt, one step (docs/vllm.md "Prefix caching")
@pytest.mark.parametrize("local, load, save", [
    (0, (0, 768), (768, 1000)),          # no local hit: the whole dualpath hit loads
    (512, (512, 768), (768, 1000)),      # local < hit: only the rows vLLM lacks load
    (768, (768, 768), (768, 1000)),      # local == hit: nothing to load
    (896, (896, 896), (768, 1000)),      # local > hit (the reported 896 vs 768): nothing
])                                       # loads, rows [768, 896) are gathered from the cache
def test_step_rows_never_load_over_a_local_hit_and_gather_every_forwarded_row(local, load,
                                                                               save):
    from integrations.vllm.rows import step_rows

    external = max(0, 768 - local)          # what the scheduler half tells vLLM to expect
    computed = local + external
    got = step_rows(hit=768, saved=0, computed=computed, scheduled=1000 - computed,
                    external=external, prompt=1000)
    assert got == (load, save)


def test_step_rows_over_chunks_gather_each_row_once_and_load_in_the_first_chunk_only():
    from integrations.vllm.rows import step_rows

    hit, prompt, saved, rows = 256, 1000, 0, []
    computed, external = 256, 128         # local 128 < hit: vLLM counts 128 + 128 computed
    loads = []
    for scheduled in (300, 300, 144, 1):  # chunks of a 300-token budget, then a decode step
        load, save = step_rows(hit=hit, saved=saved, computed=computed, scheduled=scheduled,
                               external=external, prompt=prompt)
        loads.append(load)
        rows.append(save)
        saved, computed, external = max(saved, save[1]), computed + scheduled, 0
    assert loads[0] == (128, 256) and all(b <= a for a, b in loads[1:])
    assert rows == [(256, 556), (556, 856), (856, 1000), (1000, 1000)]   # decode: no rows
    # local > hit, chunked: the first chunk gathers the held rows [hit, local) too
    load, save = step_rows(hit=256, saved=0, computed=512, scheduled=300, external=0,
                           prompt=1000)
    assert (load, save) == ((512, 512), (256, 812))
    # a resumed (preempted) request recomputing rows gathered before: gathered once only
    assert step_rows(hit=256, saved=812, computed=256, scheduled=744, external=0,
                     prompt=1000)[1] == (812, 1000)
    with pytest.raises(ValueError, match="external"):
        step_rows(hit=256, saved=0, computed=100, scheduled=10, external=200, prompt=1000)


class NoticeRecorder:
    """A decode request whose ``second_token`` answers only once ``answer`` is set (a node
    busy with another request's KV)."""

    request_id = "r"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.answer = threading.Event()
        self.info = SimpleNamespace(block_tokens=BT)

    def took_kv(self) -> None:
        self.calls.append("took_kv")

    def second_token(self) -> None:
        assert self.answer.wait(10.0)
        self.calls.append("second_token")

    def finish(self, output_ids: list[int]) -> None:
        self.calls.append("finish")


def test_decode_steps_never_wait_for_the_nodes_answer_and_finish_follows_the_notices():
    """What a decode request tells its node inside vLLM's step (pages back, second token)
    is posted, not waited for: a slow node answer never holds the instance's batch (issue
    #24 item 3: up to 100 ms per step with four agents at once); finish waits for them."""
    req = NoticeRecorder()
    with ThreadPoolExecutor(max_workers=1) as notices:
        session = DecodeSession(req, list(range(10)), notices.submit)
        t0 = time.monotonic()
        session.after_step()          # first forward: vLLM held the whole prompt, pages back
        session.after_step()          # second forward: the second token, not answered yet
        session.after_step()
        assert time.monotonic() - t0 < 1.0 and "second_token" not in req.calls
        finished = notices.submit(lambda: None)      # queued behind the unanswered notice
        closing = threading.Thread(target=session.finish, args=([5, 6, 7], None))
        closing.start()
        closing.join(0.2)
        assert closing.is_alive() and "finish" not in req.calls   # finish waits for them
        req.answer.set()
        closing.join(10.0)
        finished.result(10.0)
    assert req.calls == ["took_kv", "second_token", "finish"]


def test_a_load_failure_policy_that_could_serve_wrong_kv_is_refused_at_start():
    """Prefill with prefix caching: "fail" (a failed load's blocks evicted at once); decode:
    "recompute" (docs/vllm.md "A failed load")."""
    from integrations.vllm.kv_spec import check_failure_policy

    check_failure_policy(False, "fail", True)
    check_failure_policy(False, "recompute", False)     # no prefix cache: nothing reused
    check_failure_policy(True, "recompute", True)
    with pytest.raises(ValueError, match="prefill instance with prefix caching needs "
                                         "kv_load_failure_policy='fail'"):
        check_failure_policy(False, "recompute", True)
    with pytest.raises(ValueError, match="kv_consumer .* needs kv_load_failure_policy="
                                         "'recompute'"):
        check_failure_policy(True, "fail", False)


class _Attachment:
    """A stand-in ``SyncEngineClient`` whose claims raise ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error, self.closed = error, False

    def claim_decode(self, request_id, timeout_s, attempt):
        raise self.error

    def close(self) -> None:
        self.closed = True


def test_a_claim_without_an_answer_keeps_the_attachment_a_broken_one_drops_it():
    """The attachment is shared by every request of the instance: a claim that timed out
    (the node slow) fails that request only — once its own deadline has passed too — and
    the sessions already claimed through the attachment keep it; a broken connection
    (PeerFailed) drops it, to re-attach."""
    from common.errors import DeadlineExceeded, PeerFailed, Unavailable

    src = EngineSource("/nonexistent", "d0.e0", "decode", SPEC, 1.0)
    slow = src._client = _Attachment(DeadlineExceeded("ClaimRequest got no reply within 40s"))
    with pytest.raises(DeadlineExceeded):
        src.open_decode("r1", list(range(10)), 0.5)
    assert src._client is slow and not slow.closed
    broken = src._client = _Attachment(PeerFailed("peer closed"))
    with pytest.raises((PeerFailed, Unavailable)):     # (re-attaching to no node: Unavailable)
        src.open_decode("r2", list(range(10)), 1.0)
    assert broken.closed and src._client is not broken


class _FailsThenBack(_Attachment):
    """Its first ``times`` claim rounds raise ``error()``; later ones return ``claimed``."""

    def __init__(self, error, times: int, claimed: object):
        super().__init__(None)
        self.error_of, self.times, self.calls, self.claimed = error, times, 0, claimed

    def claim_decode(self, request_id, timeout_s, attempt):
        self.calls += 1
        if self.calls <= self.times:
            raise self.error_of()
        return self.claimed


def _silent():
    """A round the node never answered (its process stood still)."""
    from common.errors import DeadlineExceeded
    return DeadlineExceeded("ClaimRequest got no reply within 40s")


def _out_of_service():
    """The node judged the engine's step stuck and has not heard its beat since."""
    from common.errors import OutOfService
    return OutOfService("engine d0.e0 is out of service on d0", retry_after_s=0.01)


@pytest.mark.parametrize("refusal", [_out_of_service, _silent])
def test_a_claim_round_that_ends_without_the_request_is_asked_again_on_the_same_attachment(
        refusal, monkeypatch):
    """Two ways a claim round ends without the request, neither a lost attachment:
    OUT_OF_SERVICE (the node judged the step stuck, the beat showing its end not heard yet),
    and no answer at all (CI: the node's process stood still 51 s, a decode claim's round got
    no reply within its 40 s, and the request went to a recompute though its claim had
    300 s). The claim asks again — after ``retry_after_s``, or a short pause: never a tight
    loop — on the same attachment, and succeeds once the node answers; past the claim's
    deadline it fails that request only."""
    from integrations.vllm import engine_source

    monkeypatch.setattr(engine_source, "UNANSWERED_PAUSE_S", 0.01)
    src = EngineSource("/nonexistent", "d0.e0", "decode", SPEC, 1.0)
    claimed = object()
    back = src._client = _FailsThenBack(refusal, 2, claimed)
    assert src._claim_or_detach("claim_decode", "r1", 5.0, lambda: False) is claimed
    assert back.calls == 3 and src._client is back and not back.closed
    stuck = src._client = _FailsThenBack(refusal, 10**9, claimed)
    with pytest.raises(type(refusal())):
        src._claim_or_detach("claim_decode", "r2", 0.05, lambda: False)
    assert src._client is stuck and not stuck.closed and stuck.calls >= 2


def test_a_claim_asked_again_stops_once_vllm_gave_the_request_up(monkeypatch):
    from integrations.vllm import engine_source

    monkeypatch.setattr(engine_source, "UNANSWERED_PAUSE_S", 0.01)
    src = EngineSource("/nonexistent", "d0.e0", "decode", SPEC, 1.0)
    silent = src._client = _FailsThenBack(_silent, 10**9, object())
    with pytest.raises(engine_source.ClaimStopped):
        src._claim_or_detach("claim_decode", "r2", 5.0, lambda: silent.calls >= 2)
    assert silent.calls == 2
