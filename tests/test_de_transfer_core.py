"""The DE loader's transfer core without UCX or asyncio: every ordering and failure point."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest

from common.errors import (AlreadyExists, Cancelled, DeadlineExceeded, EngineDetached, ErrorCode,
                           InternalError, InvalidArgument, PeerFailed)
from common.kv import PRESETS, block_keys_from_tokens
from common.protocol import LayerSlots
from services.de_loader.transfer import (AwaitEngine, DecodeTransfer, FreeBlock, FreeRegion,
                                         HandToEngine, PostReceive, ReadHit, Release,
                                         SendLayers, WriteGenerated, WritePrompt)
from services.engine_api.prompt import PromptInfo, next_block_key
from services.node.actions import Log, Report

SPEC = PRESETS["test-small"]        # 4 layers x 256 B, 64-token blocks
B, BT, L = SPEC.kv_bytes_per_token_per_layer, SPEC.block_tokens, SPEC.num_layers


def info(prompt: int = 200, hit: int = 128, side: str = "de", *, n_keys: int | None = None,
         tail_ids: bool = True) -> PromptInfo:
    n_full = prompt // BT
    ks = tuple(block_keys_from_tokens(np.arange(n_full * BT), BT))[:n_keys]
    tail = tuple(range(prompt % BT)) if tail_ids else None
    return PromptInfo("r", 0, "s", prompt, hit, 4, ks, tail, BT, side, ks, None)


def core(writeback: bool = True) -> DecodeTransfer:
    return DecodeTransfer("r", 0, "d0.e0", SPEC, writeback=writeback,
                          counters=collections.Counter())


def prepared(i: PromptInfo, writeback: bool = True) -> tuple[DecodeTransfer, list]:
    t = core(writeback)
    t.prepare(i)
    return t, t.region_allocated()


def slots(layer: int, tid: int, tokens: int = 128) -> LayerSlots:
    return LayerSlots(layer, tid, [(layer * 1000, tokens * B)])


def de_ready(i: PromptInfo | None = None, found: int = 2) -> DecodeTransfer:
    """DE path: hit read, every layer pulled and returned; PrefillDone validated."""
    t, _ = prepared(i or info())
    t.hit_blocks_read(found)
    plan = t.pull([slots(layer, 10 + layer) for layer in range(L)])
    t.pull_ready(plan)
    t.layers_sent(plan)
    for _ in range(L):
        t.layer_received()
    t.prefill_done(t.hit_tokens, 7)
    return t


def frees(actions: list) -> list:
    return [a for a in actions if isinstance(a, FreeRegion | FreeBlock)]


# ---------------------------------------------------------------- import hygiene

def test_importing_the_core_loads_no_io_service_or_tools_module():
    code = ("import services.de_loader.transfer, sys; "
            "bad = ('ucxx', 'asyncio', 'common.transport', 'common.transport.ucx', 'common.rpc', "
            "'common.rpc_server', 'common.rpc_client', 'common.service', 'services.node.base'); "
            "print(sorted(m for m in sys.modules if m in bad or m.startswith(('tools.', 'ucxx.')) "
            "or m == 'tools'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------- prepare

@pytest.mark.parametrize("side,hit", [("pe", 128), ("none", 0)])
def test_pe_and_none_path_post_one_receive_of_the_whole_prompt_per_layer(side, hit):
    t, acts = prepared(info(hit=hit, side=side))
    assert acts == [PostReceive(layer, 0) for layer in range(L)]
    assert t.read_done and t.state == "preparing" and t.expected_receives == L


def test_de_path_reads_the_hit_and_replies_no_slots():
    t, acts = prepared(info())
    assert acts == [ReadHit(2)] and not t.read_done


def test_prepare_sizes_and_the_binding():
    t = core()
    t.prepare(info())
    assert (t.tokens, t.hbm_bytes) == (204, 204 * SPEC.bytes_per_token)
    b = core()
    b.bind(99, 7)
    b.prepare(info())
    assert (b.tokens, b.hbm_bytes) == (7, 99)


def test_prepare_twice_and_after_a_failure_are_rejected():
    t, _ = prepared(info())
    with pytest.raises(AlreadyExists):
        t.prepare(info())
    f = core()
    f.drop("revoked")
    with pytest.raises(Cancelled):
        f.prepare(info())


def test_calls_before_the_region_is_allocated_are_not_prepared():
    t = core()
    t.prepare(info())
    with pytest.raises(InvalidArgument, match="not prepared"):
        t.pull([slots(0, 1)])
    with pytest.raises(InvalidArgument, match="not prepared"):
        t.prefill_done(128, 1)


# ---------------------------------------------------------------- PE / none path

def test_pe_path_hands_off_after_every_layer_arrived_and_writes_the_new_blocks():
    t, _ = prepared(info(side="pe"))
    with pytest.raises(InvalidArgument, match="outside"):
        t.prefill_done(192, 1)
    with pytest.raises(InvalidArgument, match="outside"):
        t.prefill_done(100, 1)
    t.prefill_done(64, 5)                       # the PE's read shortened the hit
    for _ in range(L - 1):
        t.layer_received()
    with pytest.raises(InternalError):
        t.assembled()
    t.layer_received()
    acts = t.assembled()
    assert acts == [HandToEngine(64, 5), WritePrompt(1, info().keys[1:])]
    assert t.state == "ready" and t.engine_holds_kv and t.counters["handed_off"] == 1
    with pytest.raises(InternalError):
        t.layer_received()                      # more completions than posts


def test_none_path_writes_every_full_block():
    t, _ = prepared(info(hit=0, side="none"))
    t.prefill_done(0, None)
    for _ in range(L):
        t.layer_received()
    assert t.assembled() == [HandToEngine(0, None), WritePrompt(0, info().keys)]


def test_oracle_receives_only_the_new_tokens_and_writes_back_none_of_the_hit():
    """Oracle ("none" with a hit, paper §9): the hit is resident, nothing of it comes or goes."""
    t, acts = prepared(info(hit=128, side="none"))
    assert acts == [PostReceive(layer, 128) for layer in range(L)] and t.read_done
    with pytest.raises(InvalidArgument, match="resident"):
        t.prefill_done(0, 1)                    # a PE that recomputed the hit is refused
    t.prefill_done(128, 3)
    for _ in range(L):
        t.layer_received()
    assert t.assembled() == [HandToEngine(128, 3), WritePrompt(2, info().keys[2:])]


def test_prefill_done_twice_is_rejected():
    t, _ = prepared(info(side="pe"))
    t.prefill_done(128, 1)
    with pytest.raises(AlreadyExists):
        t.prefill_done(128, 1)


# ---------------------------------------------------------------- DE path

def test_de_path_pull_before_the_read_completes_then_merged_return():
    t, _ = prepared(info())
    plan = t.pull([slots(0, 1), slots(1, 1), slots(2, 2)])     # accepted before the read
    assert t.pulled == {0, 1, 2} and plan.layers == (0, 1, 2)
    assert t.hit_blocks_read(2) == [] and t.read_done and t.hit_tokens == 128
    acts = t.pull_ready(plan)
    assert acts == [PostReceive(0, 128), PostReceive(1, 128), PostReceive(2, 128),
                    SendLayers(1, (0, 1), ((0, 128 * B), (1000, 128 * B)), 128),
                    SendLayers(2, (2,), ((2000, 128 * B),), 128)]
    assert t.layers_sent(plan) == 128 and t.counters["layers_pulled"] == 3
    with pytest.raises(InvalidArgument, match="pulling 3 of 4"):
        t.prefill_done(128, 1)
    rest = t.pull([slots(3, 3)])
    t.pull_ready(rest)
    t.layers_sent(rest)
    with pytest.raises(InvalidArgument, match="the DE read"):
        t.prefill_done(64, 1)
    t.prefill_done(128, 9)
    for _ in range(L):
        t.layer_received()
    assert t.assembled() == [HandToEngine(128, 9), WritePrompt(2, info().keys[2:])]


def test_hit_shortening_reports_counts_and_shortens_the_returns():
    t, _ = prepared(info())
    plan = t.pull([slots(0, 1)])
    acts = t.hit_blocks_read(1)                 # the gateway held one of two blocks
    assert acts == [Log("info", "hit_shortened",
                        {"request_id": "r", "planned": 128, "hit": 64, "side": "de"})]
    assert t.counters["hit_shortened"] == 1 and t.hit_tokens == 64
    send = t.pull_ready(plan)
    assert send[0] == PostReceive(0, 64)                        # returns from the short hit
    assert isinstance(send[1], SendLayers) and send[1].tokens == 128     # slots' size
    assert t.layers_sent(plan) == 64                            # the reply's usable hit
    with pytest.raises(InternalError, match="twice"):
        t.hit_read(0)


def test_hit_source_read_is_taken_as_is():
    t, _ = prepared(info())
    assert t.hit_read(128) == [] and t.counters["hit_shortened"] == 0


def test_de_path_writes_from_the_shortened_hit_on():
    t = de_ready(found=1)
    assert t.assembled() == [HandToEngine(64, 7), WritePrompt(1, info().keys[1:])]


@pytest.mark.parametrize("layers,match", [
    ([slots(4, 1)], "out of range"),
    ([slots(-1, 1)], "out of range"),
    ([LayerSlots(0, 1, [(0, 10)])], "the hit is"),
    ([LayerSlots(0, 1, [(-1, 128 * B)])], "the hit is"),
    ([LayerSlots(0, 1, [(0, 129 * B), (0, -B)])], "the hit is"),
    ([slots(0, 1), slots(0, 2)], "twice"),
    ([slots(0, 1), slots(1, 2), slots(2, 1)], "not consecutive"),
])
def test_bad_pulls_are_rejected_and_pull_nothing(layers, match):
    t, _ = prepared(info())
    with pytest.raises(InvalidArgument, match=match):
        t.pull(layers)
    assert t.pulled == set()


def test_a_layer_pulled_again_and_pulls_on_other_paths_are_rejected():
    t, _ = prepared(info())
    t.pull([slots(0, 1)])
    with pytest.raises(InvalidArgument, match="twice"):
        t.pull([slots(0, 2)])
    p, _ = prepared(info(side="pe"))
    with pytest.raises(InvalidArgument, match="not 'de'"):
        p.pull([slots(0, 1)])


def test_pull_ready_after_a_failure_raises_it():
    t, _ = prepared(info())
    plan = t.pull([slots(0, 1)])
    t.read_failed(PeerFailed("gateway went away"))
    with pytest.raises(PeerFailed):
        t.pull_ready(plan)


# ---------------------------------------------------------------- write-back

def test_prompt_write_batches():
    w = WritePrompt(2, ("a", "b", "c", "d", "e"))
    assert w.batches(2) == [(2, ("a", "b")), (4, ("c", "d")), (6, ("e",))]
    assert w.batches(8) == [(2, ("a", "b", "c", "d", "e"))]


def test_no_writeback_hands_off_without_writing_and_frees_on_took_kv():
    t = de_ready()
    t.writeback = False                          # as a DE loader with writeback off
    assert t.assembled() == [HandToEngine(128, 7)] and t.prompt_written
    assert t.took_kv() == [FreeRegion()]
    assert t.free_all() == []


def test_generated_blocks_chain_on_the_prompt_and_are_written_then_freed():
    i = info(prompt=200)
    t = de_ready(i)
    t.assembled()
    assert t.persist and t.took_kv() == []        # the prompt's write-back still reads it
    assert t.prompt_write_done() == [FreeRegion()]
    ids = list(range(64))
    k1 = t.block_key(ids)
    assert k1 == next_block_key(i.keys[-1], ids, BT) and t.next_block_index == 3
    a = object()
    t.block_opened(a, k1)
    k2 = t.block_key(ids)
    assert k2 == next_block_key(k1, ids, BT) and t.next_block_index == 4
    b = object()
    t.block_opened(b, k2)
    assert t.put_block(a, 3) == [WriteGenerated(a, k1)]
    assert t.next_block_index == 5
    with pytest.raises(InvalidArgument, match="does not belong"):
        t.put_block(a, 3)
    with pytest.raises(InvalidArgument, match="does not belong"):
        t.put_block(object(), 9)
    assert t.block_written(a) == [FreeBlock(a)]
    with pytest.raises(InternalError):
        t.block_written(a)
    assert t.put_block(b, 4) == [WriteGenerated(b, k2)]
    assert t.block_written(b) == [FreeBlock(b)]
    t.finish()
    assert t.finished([1, 2]) == [Report("finished", {"tokens": 2, "output_token_ids": [1, 2]})]
    assert t.state == "done" and t.counters["finished"] == 1
    assert t.deadline() == [] and t.free_all() == []


@pytest.mark.parametrize("i,writeback", [(info(tail_ids=False), True),      # tail ids unknown
                                         (info(n_keys=1), True),            # not fully keyed
                                         (info(), False)])
def test_generated_blocks_not_persisted_are_freed_on_put(i, writeback):
    t, _ = prepared(i, writeback)
    assert not t.persist
    blk = object()
    t.block_opened(blk, "k")
    assert t.put_block(blk, 3) == [FreeBlock(blk)]


def test_block_key_checks_the_block_size():
    t, _ = prepared(info())
    with pytest.raises(InvalidArgument, match="64 tokens"):
        t.block_key([1, 2, 3])


# ---------------------------------------------------------------- failures: pages freed once

def _fail(t: DecodeTransfer, how: str) -> list:
    if how == "peer":
        return t.peer_failed(Cancelled("link aborted"))
    if how == "gateway":
        return t.read_failed(PeerFailed("gateway died"))
    if how == "engine":
        return t.engine_failed(RuntimeError("boom"))
    if how == "deadline":
        return t.deadline()
    return t.drop("revoked")


def _stage(stage: str) -> tuple[DecodeTransfer, list]:
    """An attempt brought to ``stage``; returns it and the frees its actions so far asked."""
    if stage == "prepared":
        t = core()
        t.prepare(info())
        return t, []
    t, _ = prepared(info())
    if stage == "allocated":
        return t, []
    t = de_ready()
    acts = t.assembled()
    if stage == "handed_off":
        return t, []
    acts = t.took_kv()
    if stage == "decoding":                   # prompt write-back still in flight
        return t, acts
    acts += t.prompt_write_done()
    t.block_opened("open", "k1")
    t.block_opened("put", "k2")
    acts += t.put_block("put", 3)             # being written
    return t, acts


STAGES = ["prepared", "allocated", "handed_off", "decoding", "blocks"]
FAILURES = ["peer", "gateway", "engine", "deadline", "revoked"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("how", FAILURES)
def test_a_failure_at_any_stage_frees_every_page_exactly_once(stage, how):
    t, acts = _stage(stage)
    acts += _fail(t, how)
    assert Release() in acts and t.error is not None
    assert _fail(t, how) == []                            # the first error wins
    assert t.begin_release() and not t.begin_release()
    wait = t.unwound(taken_back=False)
    if stage == "handed_off" and how != "engine":
        assert wait == [AwaitEngine()]                    # the engine may still read the KV
    if stage == "blocks" and how != "engine":
        assert wait == [AwaitEngine()]                    # it holds a page it writes
    acts += t.free_all()
    if stage == "blocks":
        acts += t.block_written("put")                    # the cancelled write-back ends
    acts += t.free_all() + t.prompt_write_done()
    freed = frees(acts)
    expected = {"prepared": [], "allocated": [FreeRegion()], "handed_off": [FreeRegion()],
                "decoding": [FreeRegion()],
                "blocks": [FreeRegion(), FreeBlock("open"), FreeBlock("put")]}[stage]
    assert sorted(map(repr, freed)) == sorted(map(repr, expected))
    assert t.end() == t.error.code.value and t.done


def test_engine_that_never_saw_the_request_is_not_waited_for():
    t = de_ready()
    t.assembled()
    t.drop("revoked")
    t.begin_release()
    assert t.unwound(taken_back=True) == [] and not t.engine_holds_kv


def test_peer_failure_is_the_pes_retryable_fault_and_reported():
    t, _ = prepared(info(side="pe"))
    acts = t.peer_failed(Cancelled("the PE's side cancelled"))
    err = t.error
    assert isinstance(err, PeerFailed) and err.hop == "pe_receiver" and err.retryable
    assert acts[1] == Report("failed", {"code": "PEER_FAILED", "message": err.message,
                                        "retryable": True, "hop": "pe_receiver", "read_bytes": 0,
                                        "de_read_bytes": 0})
    assert acts[0].event == "decode_attempt_failed" and acts[-1] == Release()
    assert t.counters["attempts_failed"] == 1
    with pytest.raises(PeerFailed):
        t.check()


def test_a_peer_deadline_is_not_reported():
    t, _ = prepared(info(side="pe"))
    assert t.peer_failed(DeadlineExceeded("late")) == [Release()]
    assert t.error.hop == "pe_receiver" and t.counters["attempts_failed"] == 0


def test_gateway_read_failure_is_reported_with_its_hop():
    t, _ = prepared(info())
    acts = t.read_failed(PeerFailed("gateway went away"))
    assert acts[1].fields["hop"] == "gateway" and t.error.hop == "gateway"


def test_drop_and_deadline_are_not_reported():
    t, _ = prepared(info())
    assert t.drop("re-planned") == [Release()]
    assert t.dropped_reason == "re-planned" and t.counters["attempts_dropped"] == 1
    assert t.error.code is ErrorCode.CANCELLED and t.error.hop == "scheduler"
    assert t.drop("again") == [] and t.counters["attempts_dropped"] == 1
    d, _ = prepared(info())
    assert d.deadline() == [Release()]
    assert "(preparing)" in d.error.message and d.error.hop == "de_loader"
    s, _ = prepared(info())
    s.stale("allocated")
    assert "after allocated" in s.dropped_reason


@pytest.mark.parametrize("end", ["revoked", "stale", "deadline", "failed"])
def test_an_attempt_that_read_its_hit_tells_what_it_read_however_it_ends(end):
    """The PE's own report carries the DE's read only once this side answered; a DE dropped
    before that (the PE gave up first, a revocation, its deadline) reports the bytes itself
    — as ``dropped``, never as a failure of its own — so a retry's re-read is accounted."""
    t, _ = prepared(info(prompt=300, hit=256))
    t.hit_blocks_read(3, nbytes=3 * BT * B * L + 5)         # the gateway's own count
    read = {"read_bytes": 3 * BT * B * L + 5, "de_read_bytes": 3 * BT * B * L + 5}
    acts = {"revoked": lambda: t.drop("revoked"), "stale": lambda: t.stale("allocated"),
            "deadline": t.deadline,
            "failed": lambda: t.peer_failed(Cancelled("the PE's side cancelled"))}[end]()
    reports = [a for a in acts if isinstance(a, Report)]
    if end == "failed":
        assert reports == [Report("failed", {"code": "PEER_FAILED", "message": t.error.message,
                                             "retryable": True, "hop": "pe_receiver",
                                             **read})]
    else:
        assert reports == [Report("dropped", read)] and acts[-1] == Release()
    assert t.drop("again") == [] and t.deadline() == []           # told once
    unread, _ = prepared(info())
    assert unread.drop("revoked") == [Release()]                  # nothing read: nothing said


def test_nothing_aborts_an_attempt_already_releasing():
    t, _ = prepared(info())
    t.begin_release()
    assert t.deadline() == [] and t.drop("x") == [] and t.abort(Cancelled("x"), True) == []
    assert t.error is None and t.ending


def test_engine_failure_frees_its_open_blocks_and_is_reported():
    t = de_ready()
    t.assembled()
    t.took_kv()
    t.block_opened("b", "k")
    acts = t.engine_failed(RuntimeError("oom"))
    assert acts[0] == FreeBlock("b") and t.open_blocks == {}
    assert isinstance(t.error, InternalError) and t.error.hop == "engine"
    assert "d0.e0 gave up" in t.error.message and Release() in acts
    d = de_ready()
    d.assembled()
    d.engine_failed(DeadlineExceeded("out of HBM time"))
    assert d.error.code is ErrorCode.DEADLINE_EXCEEDED and d.error.hop == "engine"
    c = de_ready()
    c.drop("revoked")
    assert c.engine_failed(None) == []            # acknowledging the cancellation
    assert c.engine_let_go and c.error.code is ErrorCode.CANCELLED


def test_an_engine_that_may_still_run_keeps_its_blocks_until_the_release_wait():
    """Detached while its process may still run: the attempt fails (reported), but neither
    the prompt pages it may still read nor the blocks it may still write are freed before
    the release has waited for it."""
    t = de_ready()
    t.assembled()
    t.block_opened("b", "k")
    acts = t.engine_failed(EngineDetached("d0.e0 stuck", engine_id="d0.e0", attach_no=1,
                                          alive=True))
    assert FreeBlock("b") not in acts and t.open_blocks == {"b": "k"}
    assert not t.engine_let_go and t.error.hop == "engine" and Release() in acts
    t.begin_release()
    assert t.unwound(False) == [AwaitEngine()]
    assert t.free_all()[0] == FreeBlock("b")


def test_engine_calls_after_a_failure_raise_it_but_let_go_and_free():
    t = de_ready()
    t.assembled()
    t.drop("revoked")
    with pytest.raises(Cancelled):
        t.took_kv()
    assert t.engine_let_go and not t.engine_holds_kv
    for call in (t.second_token, t.finish, lambda: t.block_key(list(range(64)))):
        with pytest.raises(Cancelled):
            call()
    t.block_opened("b", "k")
    assert t.put_block("b", 3) == [FreeBlock("b")]     # the shell then raises the error
    with pytest.raises(Cancelled):
        t.finished([1])


def test_finish_frees_nothing_itself_and_release_frees_the_region_once():
    t = de_ready()
    t.assembled()
    t.took_kv()
    assert t.second_token() == [Report("second_token")]
    t.finish()
    assert t.state == "finishing" and not t.prompt_written
    t.finished([1, 2, 3])
    t.begin_release()
    assert t.unwound(False) == []
    assert t.free_all() == [FreeRegion()]
    assert t.prompt_write_done() == [] and t.end() == "ok"


# ---------------------------------------------------------------- split reads

def split_info(prompt: int = 400, hit: int = 256, split: int = 128) -> PromptInfo:
    ks = tuple(block_keys_from_tokens(np.arange(prompt // BT * BT), BT))
    return PromptInfo("r", 0, "s", prompt, hit, 4, ks, tuple(range(prompt % BT)), BT, "split",
                      ks, None, split)


def split_pulled(found: int) -> DecodeTransfer:
    t, acts = prepared(split_info())
    assert acts == [ReadHit(2)]                       # only the DE's part: blocks 0-1
    t.hit_blocks_read(found)
    plan = t.pull([slots(layer, 10 + layer) for layer in range(L)])
    for a in t.pull_ready(plan):
        if isinstance(a, PostReceive):                # the PE returns the rest from here on
            assert a.first == t.hit_tokens == min(found * BT, 128)
        else:
            assert a.tokens == 128                    # the slots are sized for the DE's part
    assert t.layers_sent(plan) == min(found * BT, 128)
    for _ in range(L):
        t.layer_received()
    return t


def test_split_read_reads_its_part_and_writes_back_from_the_whole_hit_on():
    t = split_pulled(2)
    with pytest.raises(InvalidArgument, match="outside the split read"):
        t.prefill_done(320, 5)                        # past the plan's hit
    with pytest.raises(InvalidArgument, match="outside the split read"):
        t.prefill_done(64, 5)                         # below the DE's own part
    t.prefill_done(256, 5)                            # the PE read blocks 2-3
    assert t.assembled() == [HandToEngine(256, 5), WritePrompt(4, split_info().keys[4:])]


def test_split_read_whose_pe_part_fell_short_writes_its_missing_blocks():
    t = split_pulled(2)
    t.prefill_done(192, 5)                            # the PE found block 2, not block 3
    assert t.assembled() == [HandToEngine(192, 5), WritePrompt(3, split_info().keys[3:])]


def test_split_read_with_a_short_de_part_takes_no_pe_part():
    t = split_pulled(1)
    with pytest.raises(InvalidArgument, match="the DE read 64"):
        t.prefill_done(256, 5)
    t.prefill_done(64, 5)
    assert t.assembled() == [HandToEngine(64, 5), WritePrompt(1, split_info().keys[1:])]
