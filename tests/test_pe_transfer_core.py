"""The PE receiver's transfer core without UCX or asyncio: every ordering and failure point."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from common.errors import (Cancelled, DeadlineExceeded, EngineDetached, InternalError, InvalidArgument,
                           PeerFailed, ProtocolError, Unavailable)
from common.protocol import Endpoint, LayerSlots
from services.engine_api.prompt import PromptInfo
from services.node.actions import Count, Log, Report
from services.pe_receiver.transfer import (Abort, AbortDE, AwaitEngineRelease, FreePages, HandOff,
                                           LoadLayer, Lookahead, MarkReady, PostPull,
                                           PrefillTransfer, SendLayer)

L, B, BT = 8, 16, 64
PROMPT, HIT = 5 * BT + 10, 4 * BT
ALL = tuple(range(L))


def info(side: str = "de", hit: int = HIT, prompt: int = PROMPT) -> PromptInfo:
    keys = tuple(f"k{j}" for j in range(prompt // BT))
    return PromptInfo("r", 0, "s", prompt, hit, 4, keys, tuple(range(prompt % BT)), BT, side)


def core(side: str = "de", hit: int = HIT, **limits: int) -> PrefillTransfer:
    return PrefillTransfer(info(side, hit), L, B, Lookahead(**limits), engine_id="p0.e0")


def fwd(layer: int, tokens: int = PROMPT) -> LayerSlots:
    return LayerSlots(layer, 100 + layer, [(0, tokens * B)])


def returns(layers, hit: int = HIT) -> list[LayerSlots]:
    return [LayerSlots(layer, 200 + layer, [(0, (PROMPT - hit) * B)]) for layer in layers]


def setup(t: PrefillTransfer, *, pace: bool = False) -> list:
    """start → allocated → PrepareDecode (+ the PE read) → the prepare reply's actions."""
    t.start()
    assert t.allocated() == [Report("allocated")]
    t.prepare_sent("d0.e0", "p0", ("h", 1), None, 5.0)
    if t.info.read_side == "pe":
        t.pe_read_done(t.info.hit_blocks)
    forward = [] if t.info.read_side == "de" else [fwd(layer) for layer in ALL]
    return t.prepare_replied(forward, pace_loads=pace, now=1.0)


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def reply(t: PrefillTransfer, pull: PostPull, hit: int = HIT) -> list:
    return t.pull_replied(pull.layers, hit, returns(pull.layers, hit))


def pulls(actions) -> list[PostPull]:
    return [a for a in actions if isinstance(a, PostPull)]


def put_and_send(t: PrefillTransfer) -> list[SendLayer]:
    """The engine puts every layer; each send completes before the next put."""
    sent = []
    for layer in ALL:
        for a in t.engine_put(layer):
            sent.append(a)
            t.layer_sent(a.layer)
    return sent


# ---------------------------------------------------------------------------- layering
def test_importing_the_core_loads_no_io_service_or_tools_module():
    code = ("import sys, services.pe_receiver.transfer\n"
            "bad = ('ucxx', 'asyncio', 'common.transport', 'common.transport.ucx', 'common.rpc',"
            " 'common.rpc_server', 'common.rpc_client', 'common.service', 'services.node.base')\n"
            "print([m for m in sys.modules if m in bad or m == 'tools' or "
            "m.startswith(('tools.', 'ucxx.', 'common.transport'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------------------- happy paths
def test_pe_path_loads_hands_off_forwards_whole_layers_and_frees_once():
    t = core("pe")
    assert t.phase == "pe_receiver"
    acts = setup(t)
    assert acts == [MarkReady(ALL), Report("read_done"), HandOff()]
    assert t.hit_final and t.hit_tokens == HIT and t.engine_holds and t.phase == "engine"
    assert t.engine_wants(0) == [] and t.output_range(0) == (HIT, PROMPT)
    sent = put_and_send(t)
    assert sent == [SendLayer(layer, fwd(layer), 0, PROMPT) for layer in ALL]
    assert t.engine_finished(7) == [] and t.all_sent and t.first_token_id == 7
    assert not t.engine_holds and t.phase == "de_loader"
    assert t.prefill_done_acked() == [Report("prefill_done")]
    assert t.finished_ok() == [Count("attempts_ok")]
    assert t.release() == [FreePages()]
    assert t.release() == []                                   # exactly once


def test_none_path_uses_no_hit_and_forwards_whole_layers():
    t = core("none", hit=0)
    assert setup(t) == [MarkReady(ALL), Report("read_done"), HandOff()]
    assert t.hit_tokens == 0 and t.output_range(3) == (0, PROMPT)
    assert [a.first_token for a in put_and_send(t)] == [0] * L


def test_oracle_keeps_the_hit_resident_loads_nothing_and_forwards_only_the_new_tokens():
    """Oracle ("none" with a hit, paper §9): no read, no paced load, no send of the hit."""
    t = core("none")
    t.start()
    t.allocated()
    t.prepare_sent("d0.e0", "p0", ("h", 1), None, 5.0)
    new = [LayerSlots(layer, 100 + layer, [(0, (PROMPT - HIT) * B)]) for layer in ALL]
    with pytest.raises(ProtocolError):          # whole-prompt slots: the DE expects the hit
        PrefillTransfer(info("none"), L, B).prepare_replied([fwd(layer) for layer in ALL])
    assert t.prepare_replied(new, pace_loads=True) == [MarkReady(ALL), Report("read_done"),
                                                        HandOff()]
    assert t.hit_tokens == HIT and t.output_range(0) == (HIT, PROMPT) and t.read_bytes == 0
    sent = put_and_send(t)
    assert [(a.first_token, a.last_token) for a in sent] == [(HIT, PROMPT)] * L


def test_de_path_pulls_layer_zero_alone_then_hands_off_on_its_reply():
    t = core("de")
    acts = setup(t)
    assert acts == [PostPull((0,), HIT)] and t.t_pull_start == 1.0 and t.phase == "de_loader"
    t.pull_posted((0,), 2.0)
    assert t.layer_requested[0] == 2.0
    acts = reply(t, acts[0])
    assert acts == [Report("read_done"), HandOff(), PostPull((1,), HIT)]
    assert t.hit_final and t.engine_holds and t.phase == "engine"
    assert t.layers_received((0,), 3.0) == [MarkReady((0,)), PostPull((2, 3), HIT)]
    assert t.layer_arrival[0] == 3.0 and t.output_range(0) == (HIT, PROMPT)


def test_de_path_forwards_only_the_computed_part_once_returns_are_known():
    t = core("de", lookahead_layers=L, layers_per_pull=L, pulls_in_flight=L)
    first = setup(t)[0]
    assert t.engine_put(0) == []                      # put, but no return slots yet
    acts = reply(t, first)
    assert acts[-1] == SendLayer(0, returns([0])[0], HIT, PROMPT)
    t.layer_sent(0)
    for p in pulls(acts):
        for a in reply(t, p):
            assert not isinstance(a, SendLayer)       # layer 1 not put yet
    sends = [a for layer in range(1, L) for a in t.engine_put(layer)]
    assert sends == [SendLayer(1, returns([1])[0], HIT, PROMPT)]   # one on the wire at a time
    for layer in range(1, L):
        nxt = t.layer_sent(layer)
        assert nxt == ([] if layer == L - 1 else [SendLayer(layer + 1, returns([layer + 1])[0],
                                                            HIT, PROMPT)])
    assert t.all_sent


@pytest.mark.parametrize("side", ["pe", "de", "none"])
def test_prepare_decode_splits_the_keys_at_the_hit_and_names_the_gateway_on_the_de_path(side):
    t = core(side, hit=0 if side == "none" else HIT)
    gw = Endpoint("g0", "gateway", "gw", 1, "gw", 2)
    msg = t.prepare_sent("d0.e0", "p0", ("10.0.0.1", 7), gw, 4.5)
    n = t.info.hit_blocks
    assert (msg.read_side, msg.hit_keys, msg.new_keys) == (side, ["k0", "k1", "k2", "k3"][:n],
                                                           ["k0", "k1", "k2", "k3", "k4"][n:])
    assert (msg.ucx_host, msg.ucx_port, msg.deadline_s) == ("10.0.0.1", 7, 4.5)
    assert msg.read_gateway == (gw if side == "de" else None)
    assert msg.tail_token_ids == list(range(10))
    assert t.phase == ("gateway" if side == "pe" else "pe_receiver")


# ---------------------------------------------------------------------------- look-ahead
def test_pull_ramp_is_1_1_2_4_capped_by_layers_per_pull():
    t = PrefillTransfer(info("de"), 16, B, Lookahead(lookahead_layers=16, layers_per_pull=4,
                                                     pulls_in_flight=16))
    first = setup(t)
    assert [p.layers for p in first] == [(0,)]        # alone until the hit is known
    more = pulls(reply(t, first[0]))
    assert [len(p.layers) for p in more] == [1, 2, 4, 4, 4]
    assert [p.layers[0] for p in more] == [1, 2, 4, 8, 12]


def test_lookahead_one_pulls_one_layer_past_consumption():
    t = core("de", lookahead_layers=1, layers_per_pull=1, pulls_in_flight=1)
    p0 = setup(t)[0]
    assert pulls(reply(t, p0)) == []                 # one in flight
    assert t.layers_received((0,), 0.0) == [MarkReady((0,))]   # 0 consumed + 1 ahead
    assert t.engine_wants(0) == [PostPull((1,), HIT)]
    assert t.engine_wants(0) == []                   # the same layer again moves nothing
    assert t.engine_wants(1) == []                   # layer 1 still in flight
    reply(t, PostPull((1,), HIT))
    assert t.layers_received((1,), 0.0) == [MarkReady((1,)), PostPull((2,), HIT)]


@pytest.mark.parametrize("seed", range(40))
def test_random_orderings_respect_lookahead_and_pulls_in_flight(seed):
    rnd = random.Random(seed)
    lim = Lookahead(lookahead_layers=rnd.randint(1, 4), layers_per_pull=rnd.randint(1, 3),
                    pulls_in_flight=rnd.randint(1, 3), max_unsent_layers=rnd.randint(1, 3))
    t = PrefillTransfer(info("de"), L, B, lim)
    todo: list[PostPull] = []                      # pulls without a reply
    replied: list[PostPull] = []                   # replied, layers not arrived
    requested: set[int] = set()
    sending: list[SendLayer] = []
    next_want = 0

    def run(actions):
        for a in actions:
            if isinstance(a, PostPull):
                assert not requested & set(a.layers)
                requested.update(a.layers)
                todo.append(a)
            elif isinstance(a, SendLayer):
                sending.append(a)
        assert max(requested) < t.consumed + lim.lookahead_layers
        assert t.pulls <= lim.pulls_in_flight and len(sending) <= 1

    run(setup(t))
    while not t.all_sent:
        moves = [m for m, ok in (("reply", todo), ("arrive", replied), ("send", sending),
                                 ("want", next_want < L and t.hit_final),
                                 ("put", t.put < next_want and t.ready[t.put]
                                  and not t.put_blocked)) if ok]
        assert moves, "stuck"
        move = rnd.choice(moves)
        if move == "reply":
            p = todo.pop(rnd.randrange(len(todo)))
            run(reply(t, p))
            replied.append(p)
        elif move == "arrive":
            p = replied.pop(rnd.randrange(len(replied)))
            run(t.layers_received(p.layers, 0.0))
        elif move == "send":
            run(t.layer_sent(sending.pop().layer))
        elif move == "want":
            run(t.engine_wants(next_want))
            next_want += 1
        else:
            run(t.engine_put(t.put))
        assert t.put - t.sent <= lim.max_unsent_layers + 1
    assert requested == set(ALL) and all(t.ready) and t.pulls == 0


def test_paced_pe_loads_stay_within_the_lookahead():
    t = core("pe", lookahead_layers=2)
    acts = setup(t, pace=True)
    assert acts == [LoadLayer(0, HIT * B), Report("read_done"), HandOff()]
    assert t.layer_loaded(0) == [MarkReady((0,)), LoadLayer(1, HIT * B)]
    assert t.layer_loaded(1) == [MarkReady((1,))]           # 0 consumed + 2 ahead
    assert t.engine_wants(0) == [LoadLayer(2, HIT * B)]
    assert t.engine_wants(1) == []                          # one load at a time
    assert t.layer_loaded(2) == [MarkReady((2,)), LoadLayer(3, HIT * B)]


def test_pacing_without_hit_bytes_marks_everything_ready():
    t = core("none", hit=0)
    assert setup(t, pace=True)[0] == MarkReady(ALL)


def test_put_layer_waits_beyond_max_unsent_layers():
    t = core("pe", max_unsent_layers=2)
    setup(t)
    assert kinds(t.engine_put(0)) == ["SendLayer"]
    t.engine_put(1)
    assert not t.put_blocked
    t.engine_put(2)
    assert t.put_blocked                                     # 3 put, none sent
    assert t.layer_sent(0) == [SendLayer(1, fwd(1), 0, PROMPT)]
    assert not t.put_blocked


# ---------------------------------------------------------------------------- hit shortening
def test_pe_read_of_fewer_blocks_shortens_the_hit_and_counts_it():
    t = core("pe")
    t.start()
    t.allocated()
    acts = t.pe_read_done(2)
    assert acts == [Count("hit_shortened"), Log("info", "hit_shortened", {
        "request_id": "r", "planned_blocks": 4, "found_blocks": 2, "side": "pe"})]
    assert t.hit_tokens == HIT                               # until PrepareDecode answers
    t.prepare_replied([fwd(layer) for layer in ALL])
    assert t.hit_tokens == 2 * BT and t.output_range(0) == (2 * BT, PROMPT)


@pytest.mark.parametrize("prefix, hit", [(4, HIT), (5, HIT), (None, 0)])
def test_pe_read_of_every_block_or_no_read_counts_nothing(prefix, hit):
    t = core("pe")
    t.start()
    t.allocated()
    assert t.pe_read_done(prefix) == []              # None: no gateway to read from
    t.prepare_replied([fwd(layer) for layer in ALL])
    assert t.hit_tokens == hit


def test_de_reply_with_a_shorter_hit_counts_it_and_forwards_from_there():
    t = core("de")
    p0 = setup(t)[0]
    t.engine_put(0)
    acts = reply(t, p0, hit=BT)
    assert acts[:2] == [Count("hit_shortened"), Log("info", "hit_shortened", {
        "request_id": "r", "planned": HIT, "hit": BT, "side": "de"})]
    assert acts[-1] == SendLayer(0, returns([0], BT)[0], BT, PROMPT)
    assert t.hit_tokens == BT
    assert all(p.hit_tokens == HIT for p in pulls(acts))     # receives sized for the plan


@pytest.mark.parametrize("hit, layers, slot_tokens, what", [
    (HIT - 10, [0], None, "reported hit"),
    (HIT + BT, [0], None, "reported hit"),
    (-BT, [0], None, "reported hit"),
    (HIT, [1], None, "return slots"),
    (HIT, [0, 1], None, "return slots"),
    (HIT, [0], PROMPT, "return slots"),
])
def test_bad_pull_replies_are_protocol_errors_and_change_nothing(hit, layers, slot_tokens, what):
    t = core("de")
    setup(t)
    rows = [LayerSlots(layer, 1, [(0, (slot_tokens or PROMPT - hit) * B)]) for layer in layers]
    with pytest.raises(ProtocolError, match=what):
        t.pull_replied([0], hit, rows)
    assert not t.hit_final and not t.engine_holds and t.fwd == [None] * L


def test_a_hit_changed_between_replies_is_a_protocol_error():
    t = core("de")
    p0 = setup(t)[0]
    p1 = pulls(reply(t, p0))[0]
    with pytest.raises(ProtocolError, match="changed the hit"):
        reply(t, p1, hit=BT)


@pytest.mark.parametrize("forward", [
    [], [fwd(layer) for layer in range(L - 1)], [fwd(layer, PROMPT - 1) for layer in ALL]])
def test_bad_forward_slots_in_the_prepare_reply(forward):
    t = core("pe")
    t.start()
    t.allocated()
    with pytest.raises(ProtocolError) as e:
        t.prepare_replied(forward)
    assert e.value.hop == "de_loader" and not t.engine_holds
    with pytest.raises(ProtocolError):
        core("de").prepare_replied([fwd(0)])                 # DE path: none expected


# ---------------------------------------------------------------------------- engine misuse
def test_engine_calls_out_of_order_raise_invalid_argument_without_failing():
    t = core("de")
    setup(t)
    with pytest.raises(InvalidArgument, match="before its hit KV"):
        t.output_range(0)
    with pytest.raises(InvalidArgument, match="out of range"):
        t.engine_wants(L)
    with pytest.raises(InvalidArgument, match="out of range"):
        t.check_layer(-1)
    t.engine_put(0)
    with pytest.raises(InvalidArgument, match="next is 1"):
        t.engine_put(2)
    assert t.error is None and t.put == 1


def test_engine_finishing_early_fails_the_attempt_at_the_engine():
    t = core("pe")
    setup(t)
    t.engine_put(0)
    acts = t.engine_finished(None)
    assert kinds(acts) == ["Abort"] and isinstance(t.error, InvalidArgument)
    assert t.error.hop == "engine" and "1 of 8" in t.error.message
    assert t.release() == [AbortDE(t.error.message[:300]), FreePages()]


def test_engine_failure_is_an_internal_error_of_the_engine_hop():
    t = core("pe")
    setup(t)
    acts = t.engine_failed(RuntimeError("oom"))
    assert acts == [Abort(t.error)] and isinstance(t.error, InternalError)
    assert t.error.hop == "engine" and "p0.e0" in t.error.message
    assert not t.engine_holds and t.engine_failed(None) == []
    assert t.release() == [AbortDE(t.error.message[:300]), FreePages()]


def test_an_engine_that_may_still_run_keeps_its_pages_until_the_release_wait():
    """Detached while its process may still run (silent, stuck, replaced): the attempt fails
    at once (reported, retryable), but the release waits for the engine like for one that
    holds the request: its pages are not freed under a process that could still write."""
    t = core("pe")
    setup(t)
    acts = t.engine_failed(EngineDetached("p0.e0 silent for 15.0 s", engine_id="p0.e0",
                                          attach_no=1, alive=True))
    assert acts == [Abort(t.error)] and t.error.hop == "engine" and t.engine_holds
    assert t.release() == [AwaitEngineRelease(), AbortDE(t.error.message[:300]), FreePages()]
    dead = core("pe")
    setup(dead)
    dead.engine_failed(EngineDetached("p0.e0 disconnected", engine_id="p0.e0", attach_no=1))
    assert not dead.engine_holds
    assert dead.release() == [AbortDE(dead.error.message[:300]), FreePages()]


def test_engine_failure_with_a_typed_error_keeps_it():
    t = core("pe")
    setup(t)
    t.engine_failed(Unavailable("gone"))
    assert isinstance(t.error, Unavailable) and t.error.hop == "engine"


# ---------------------------------------------------------------------------- failures
def test_dropped_before_the_task_started_frees_nothing_and_reports_nothing():
    t = core("de")
    acts = t.dropped("revoked")
    assert kinds(acts) == ["Abort"] and t.error.hop == "scheduler"
    with pytest.raises(Cancelled):
        t.start()
    assert t.dropped("again") == [] and t.dropped_reason == "revoked"
    assert t.finished_failed() == [Count("attempts_dropped")]
    assert t.release() == []


def test_deadline_while_allocating_names_the_pe_buffer():
    t = core("pe")
    t.start()
    acts = t.deadline()
    err = t.error
    assert acts == [Abort(err)] and isinstance(err, DeadlineExceeded) and err.hop == "pe_buffer"
    assert t.finished_failed() == [
        Count("attempts_failed"),
        Log("warning", "prefill_attempt_failed", {"request_id": "r", "attempt": 0,
                                                  "hop": "pe_buffer",
                                                  "code": "DEADLINE_EXCEEDED",
                                                  "error": err.message}),
        Report("failed", {"code": "DEADLINE_EXCEEDED", "message": err.message,
                          "retryable": True, "hop": "pe_buffer",
                          "read_bytes": 0, "pe_read_bytes": 0})]
    assert t.release() == []                                 # nothing allocated


@pytest.mark.parametrize("err, aborts_de", [
    (Unavailable("down"), False), (PeerFailed("died"), False), (ProtocolError("bad"), True)])
def test_prepare_failure_frees_the_region_and_aborts_a_de_that_may_hold(err, aborts_de):
    t = core("de")
    t.start()
    t.allocated()
    t.prepare_sent("d0.e0", "p0", ("h", 1), None, 5.0)
    t.failed(err, "de_loader")
    abort = [AbortDE(err.message)] if aborts_de else []
    assert t.release() == abort + [FreePages()]


def test_gateway_failure_on_the_pe_path_aborts_the_de():
    t = core("pe")
    t.start()
    t.allocated()
    t.prepare_sent("d0.e0", "p0", ("h", 1), None, 5.0)
    assert t.phase == "gateway"
    t.failed(Unavailable("gw down"), t.phase)
    assert t.error.hop == "gateway"
    assert t.release() == [AbortDE("gw down"), FreePages()]


def test_failure_mid_pull_stops_pulling_and_waits_for_the_engine():
    t = core("de")
    p0 = setup(t)[0]
    p1 = pulls(reply(t, p0))[0]
    t.layers_received(p0.layers, 0.0)
    assert t.failed(PeerFailed("link aborted"), "de_loader") == [Abort(t.error)]
    assert t.failed(Unavailable("later"), "de_loader") == []      # the first error wins
    assert t.engine_wants(0) == [] and t.engine_wants(5) == []     # no more pulls
    with pytest.raises(PeerFailed):
        t.engine_put(0)
    with pytest.raises(PeerFailed):
        t.output_range(0)
    assert reply(t, p1) == []                                      # a late reply sends nothing
    assert t.release() == [AwaitEngineRelease(), FreePages()]      # the DE failed: no abort
    assert FreePages() not in t.release()


def test_failure_mid_send_aborts_the_de_after_the_engine_lets_go():
    t = core("pe")
    setup(t)
    assert kinds(t.engine_put(0)) == ["SendLayer"]
    t.failed(Unavailable("ucx send"), "de_loader")                  # the DE is unreachable
    assert t.release() == [AwaitEngineRelease(), FreePages()]
    t2 = core("pe")
    setup(t2)
    t2.engine_put(0)
    t2.failed(DeadlineExceeded("send too slow"), "de_loader")
    assert t2.layer_sent(0) == []                                   # nothing more goes out
    assert t2.release() == [AwaitEngineRelease(), AbortDE("send too slow"), FreePages()]


def test_deadline_while_the_engine_computes():
    t = core("pe")
    setup(t)
    t.deadline()
    assert t.error.hop == "engine" and t.error.retryable and "during engine" in t.error.message
    t.engine_failed(t.error)                                        # the engine acknowledges
    assert t.release() == [AbortDE(t.error.message[:300]), FreePages()]


def test_dropped_after_hand_off_waits_for_the_engine_and_skips_the_de_abort():
    t = core("de")
    reply(t, setup(t)[0])
    t.dropped("revoked")
    assert t.release() == [AwaitEngineRelease(), FreePages()]


def test_a_request_the_engine_never_took_is_freed_without_waiting():
    t = core("pe")
    setup(t)
    t.dropped("revoked")
    t.engine_discarded()
    assert t.release() == [FreePages()]


def test_cancelled_task_counts_as_dropped():
    t = core("pe")
    setup(t)
    assert kinds(t.cancelled()) == ["Abort"] and t.dropped_reason == "cancelled"
    assert t.error.hop == "pe_receiver" and t.cancelled() == []
    read = {"read_bytes": HIT * B * L, "pe_read_bytes": HIT * B * L}    # its hit, read
    assert t.finished_failed() == [Count("attempts_dropped"), Report("dropped", read)]


def test_paced_loads_stop_after_a_failure():
    t = core("pe", lookahead_layers=1)
    setup(t, pace=True)
    t.failed(PeerFailed("x"), "gateway")
    assert t.layer_loaded(0) == [MarkReady((0,))]
    assert t.engine_wants(0) == []


def test_finished_failed_needs_an_error():
    with pytest.raises(InternalError):
        core().finished_failed()
