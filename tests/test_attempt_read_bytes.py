"""A failed attempt reports the storage bytes it read (issue #16): both transfer cores.

A retry reads the hit again, so the replay's storage check adds these bytes to the final
attempts' hits; the cores are where the read is known.
"""

from __future__ import annotations

import collections

from common.errors import DeadlineExceeded, PeerFailed
from common.kv import PRESETS
from common.protocol import LayerSlots, ReportProgress
from services.de_loader.transfer import DecodeTransfer
from services.engine_api.prompt import PromptInfo
from services.node.actions import Report
from services.pe_receiver.transfer import Lookahead, PostPull, PrefillTransfer

L, B, BT = 8, 16, 64
PROMPT, HIT = 5 * BT + 10, 4 * BT


def pe_core(side: str) -> PrefillTransfer:
    keys = tuple(f"k{j}" for j in range(PROMPT // BT))
    info = PromptInfo("r", 0, "s", PROMPT, HIT, 4, keys, tuple(range(PROMPT % BT)), BT, side)
    t = PrefillTransfer(info, L, B, Lookahead(), engine_id="p0.e0")
    t.start()
    t.allocated()
    t.prepare_sent("d0.e0", "p0", ("h", 1), None, 5.0)
    return t


def failed_report(actions) -> dict:
    (rep,) = [a for a in actions if isinstance(a, Report) and a.stage == "failed"]
    return dict(rep.fields)


def test_pe_path_failure_reports_the_gateways_byte_count():
    t = pe_core("pe")
    t.pe_read_done(3, nbytes=4 * BT * L * B)     # a found block past the gap was read too
    t.failed(PeerFailed("DE loader went away"), "de_loader")
    fields = failed_report(t.finished_failed())
    assert fields["read_bytes"] == 4 * BT * L * B and fields["hop"] == "de_loader"
    ReportProgress("r", 0, "failed", **fields)   # the fields are the wire message's


def test_pe_path_without_a_byte_count_reports_the_prefix():
    t = pe_core("pe")
    t.pe_read_done(2)
    t.deadline()
    assert failed_report(t.finished_failed())["read_bytes"] == 2 * BT * L * B


def test_failure_before_any_read_reports_zero():
    t = pe_core("pe")
    t.deadline()
    assert failed_report(t.finished_failed())["read_bytes"] == 0


def test_de_path_failure_after_the_first_pull_reports_the_des_read():
    t = pe_core("de")
    (pull,) = [a for a in t.prepare_replied([], now=1.0) if isinstance(a, PostPull)]
    hit = 3 * BT                                   # the DE read found three blocks
    rows = [LayerSlots(layer, 200 + layer, [(0, (PROMPT - hit) * B)]) for layer in pull.layers]
    t.pull_replied(pull.layers, hit, rows)
    t.failed(PeerFailed("send failed"), "de_loader")
    assert failed_report(t.finished_failed())["read_bytes"] == hit * L * B


SPEC = PRESETS["test-small"]


def de_core() -> DecodeTransfer:
    keys = tuple(f"{j:032x}" for j in range(3))
    info = PromptInfo("r", 0, "s", 200, 128, 4, keys, tuple(range(200 % 64)), 64, "de",
                      keys, None)
    t = DecodeTransfer("r", 0, "d0.e0", SPEC, writeback=False, counters=collections.Counter())
    t.prepare(info)
    t.region_allocated()
    return t


def test_de_failure_after_the_hit_read_reports_its_bytes():
    t = de_core()
    t.hit_blocks_read(2, nbytes=2 * SPEC.full_block_bytes)
    acts = t.engine_failed(DeadlineExceeded("engine too slow"))
    fields = failed_report(acts)
    assert fields["read_bytes"] == 2 * SPEC.full_block_bytes and fields["hop"] == "engine"
    ReportProgress("r", 0, "failed", **fields)


def test_de_read_failure_reports_zero():
    t = de_core()
    assert failed_report(t.read_failed(PeerFailed("gateway went away")))["read_bytes"] == 0
