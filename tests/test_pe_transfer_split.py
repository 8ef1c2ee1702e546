"""The PE receiver's transfer core on a split read (docs/datapath.md "Split reads"): the DE
reads the hit's leading part and streams it, this node's gateway reads the rest, which goes to
the DE with the new tokens; how the two parts end the hit and what an ended attempt reports."""

from __future__ import annotations

import pytest

from common.errors import PeerFailed, ProtocolError
from common.protocol import Endpoint
from services.engine_api.prompt import PromptInfo
from services.node.actions import Log, Report
from services.pe_receiver.transfer import (HandOff, Lookahead, PostPull, PrefillTransfer,
                                           SendLayer)
from tests.test_pe_transfer_core import B, BT, HIT, L, PROMPT, returns

SPLIT = 2 * BT              # the DE reads blocks 0-1, this node's gateway blocks 2-3


def split_core(**limits: int) -> PrefillTransfer:
    keys = tuple(f"k{j}" for j in range(PROMPT // BT))
    i = PromptInfo("r", 0, "s", PROMPT, HIT, 4, keys, tuple(range(PROMPT % BT)), BT, "split",
                   split_tokens=SPLIT)
    return PrefillTransfer(i, L, B, Lookahead(**limits), engine_id="p0.e0")


def split_setup(t: PrefillTransfer, pe_blocks: int | None = 2, nbytes: int = 777) -> list:
    t.start()
    t.allocated()
    msg = t.prepare_sent("d0.e0", "p0", ("h", 1), Endpoint("d0", "gateway", "g", 1, "g", 2), 5.0)
    assert (msg.read_side, msg.hit_tokens, msg.split_tokens) == ("split", HIT, SPLIT)
    assert msg.read_gateway is not None and t.phase == "gateway"   # both gateways read at once
    t.pe_read_done(pe_blocks, nbytes)
    return t.prepare_replied([], now=1.0)


def test_split_read_pulls_only_the_des_part_and_forwards_the_rest_of_the_hit_with_the_new():
    t = split_core()
    acts = split_setup(t)
    assert acts == [PostPull((0,), SPLIT)]              # receives sized for the DE's part
    assert not t.hit_final
    acts = t.pull_replied((0,), SPLIT, returns([0], SPLIT))
    assert acts[:2] == [Report("read_done"), HandOff()]
    # the whole hit counts: the DE's blocks 0-1 and this node's 2-3
    assert t.hit_tokens == HIT and t.de_hit == SPLIT
    assert t.read_bytes == SPLIT * B * L + 777
    t.layers_received((0,), 2.0)
    assert t.output_range(0) == (HIT, PROMPT)
    # layer 0 goes back from the split on: this node's part of the hit and the new tokens
    assert t.engine_put(0) == [SendLayer(0, returns([0], SPLIT)[0], SPLIT, PROMPT)]


@pytest.mark.parametrize("ends", ["failed", "dropped"])
@pytest.mark.parametrize("de_answered", [False, True])
def test_a_split_attempt_that_ends_reports_its_own_part_beside_what_it_knows(ends, de_answered):
    """Before the DE's first pull reply this node knows only its own part; after it, both.
    Either way its own part goes separately, so the scheduler adds the DE's report to it
    instead of keeping the larger of the two (the parts of one split read add up)."""
    t = split_core()
    split_setup(t, nbytes=777)
    if de_answered:
        t.pull_replied((0,), SPLIT, returns([0], SPLIT))
    if ends == "failed":
        t.failed(PeerFailed("DE gone"), "de_loader")
    else:
        t.dropped("revoked")
    known = 777 + (SPLIT * B * L if de_answered else 0)
    reads = {"read_bytes": known, "pe_read_bytes": 777}
    reports = [a for a in t.finished_failed() if isinstance(a, Report)]
    if ends == "failed":
        assert [(r.stage, {k: r.fields[k] for k in reads}) for r in reports] == [
            ("failed", reads)]
    else:
        assert reports == [Report("dropped", reads)]


def test_split_read_with_a_short_pe_part_ends_the_hit_at_its_gap():
    t = split_core()
    acts = split_setup(t, pe_blocks=1)
    t.pull_replied((0,), SPLIT, returns([0], SPLIT))
    t.layers_received(acts[0].layers, 2.0)
    assert t.hit_tokens == SPLIT + BT and t.output_range(0) == (SPLIT + BT, PROMPT)
    assert t.engine_put(0)[0].first_token == SPLIT


@pytest.mark.parametrize("pe_blocks", [2, 0, None])
def test_split_read_with_a_short_de_part_ignores_the_pe_part_behind_the_gap(pe_blocks):
    t = split_core()
    split_setup(t, pe_blocks=pe_blocks)
    acts = t.pull_replied((0,), BT, returns([0], BT))
    assert Log("info", "hit_shortened", {"request_id": "r", "planned": SPLIT, "hit": BT,
                                         "side": "de"}) in acts
    t.layers_received((0,), 2.0)
    assert t.hit_tokens == BT and t.output_range(0) == (BT, PROMPT)
    assert t.engine_put(0) == [SendLayer(0, returns([0], BT)[0], BT, PROMPT)]


def test_split_read_replies_beyond_the_des_part_or_changing_it_are_protocol_errors():
    t = split_core()
    split_setup(t)
    with pytest.raises(ProtocolError):
        t.pull_replied((0,), HIT, returns([0], HIT))    # more than the DE was asked to read
    t.pull_replied((0,), SPLIT, returns([0], SPLIT))
    t.layers_received((0,), 2.0)
    with pytest.raises(ProtocolError):
        t.pull_replied((1,), BT, returns([1], BT))
