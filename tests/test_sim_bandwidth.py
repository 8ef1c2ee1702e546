"""Paper §3 / eq. (9): the no-bottleneck P/D window, per-link loads, and the deployment check."""

from __future__ import annotations

from fractions import Fraction as F

import pytest

from sim import bandwidth as bw
from sim.check import check_config, main as check_main


# Digest §3.8 test vectors: (g, s, M/Bs) -> [lower, upper] and the binding constraint.
VECTORS = [
    ((8, 1, 10), (F(1, 7), F(7, 2)), {bw.DE_CNIC_WRITE, bw.DE_DRAM}),
    ((8, 1, 20), (F(1, 7), F(7, 2)), {bw.DE_CNIC_WRITE}),
    ((8, 1, 7), (F(1, 7), F(2)), {bw.DE_DRAM}),
    ((8, 2, 10), (F(1, 3), F(3, 2)), {bw.DE_CNIC_WRITE}),
    ((4, 1, 10), (F(1, 3), F(3, 2)), {bw.DE_CNIC_WRITE}),
    ((16, 1, 10), (F(1, 15), F(7, 2)), {bw.DE_DRAM}),
]


@pytest.mark.parametrize("args, expect, binding", VECTORS)
def test_eq9_test_vectors(args, expect, binding):
    r = bw.pd_range(*args)
    assert (r.lower, r.upper) == expect          # exact: Fractions in, Fractions out
    assert set(r.binding_uppers()) == binding
    assert r.feasible


def test_worked_example_one_seventh_to_seven_halves():
    r = bw.pd_range(8, 1, 10)
    assert r.lower == F(1, 7) and r.upper == F(7, 2)
    assert r.uppers == {bw.DE_CNIC_READ: 6, bw.DE_CNIC_WRITE: F(7, 2), bw.DE_DRAM: F(7, 2)}
    # float inputs give the same numbers
    rf = bw.pd_range(8.0, 1.0, 10.0)
    assert rf.lower == pytest.approx(1 / 7) and rf.upper == pytest.approx(3.5)


def test_eq1_pe_cnic_read_needs_s_at_most_half_g():
    assert bw.pd_range(8, 4, 10).pe_read_ok
    r = bw.pd_range(8, 5, 10)
    assert not r.pe_read_ok and not r.feasible


@pytest.mark.parametrize("P, D", [(1, 7), (1, 2), (1, 1), (2, 1), (7, 2)])
def test_link_loads_at_most_one_inside_the_window(P, D):
    loads = bw.link_loads(P, D, 8, 1, 1, 10)
    assert max(loads.values()) <= 1
    assert loads["PE_DRAM"] == F(1, 5)


def test_link_loads_hit_one_exactly_at_the_bounds():
    lo = bw.link_loads(1, 7, 8, 1, 1, 10)            # P/D = 1/7: PE CNIC write binds
    assert lo["PE_CNIC_write"] == 1
    hi = bw.link_loads(7, 2, 8, 1, 1, 10)            # P/D = 7/2: DE CNIC write and DRAM bind
    assert hi["DE_CNIC_write"] == 1 and hi["DE_DRAM"] == 1
    over = bw.link_loads(4, 1, 8, 1, 1, 10)
    assert over["DE_CNIC_write"] > 1 and over["DE_DRAM"] > 1


def test_link_loads_closed_forms():
    # paper §4.2's per-link formulas, spelled out for P=2, D=4, g=8, s=1
    loads = bw.link_loads(2, 4, 8, 1, 1, 10)
    tp, tc = F(1, 4 * 64), F(1, 2 * 64)
    assert loads["PE_CNIC_read"] == 2 * tp * 4 * 8 == F(1, 4)
    assert loads["PE_CNIC_write"] == (tp + tc) * 4 * 8
    assert loads["DE_CNIC_read"] == (tp + 2 * tc) * 2 * 8
    assert loads["DE_CNIC_write"] == (2 * tp + tc) * 2 * 8
    assert loads["DE_DRAM"] == (3 + 2 * F(1, 2)) / 10


def test_check_verdicts():
    v = bw.check(2, 4, 8, 50e9, 50e9, 500e9)
    assert v.inside and v.pd == 0.5 and v.violated == []
    assert v.binding == [bw.PE_CNIC_WRITE]        # 0.5 is relatively closer to 1/7 than to 7/2
    assert v.storage_basic_bytes_per_s == 100e9 and v.storage_dualpath_bytes_per_s == 300e9
    out = bw.check(7, 1, 8, 50e9, 50e9, 500e9)
    assert not out.inside
    assert set(out.violated) == {bw.DE_CNIC_READ, bw.DE_CNIC_WRITE, bw.DE_DRAM}
    low = bw.check(1, 8, 8, 50e9, 50e9, 500e9)
    assert not low.inside and low.violated == [bw.PE_CNIC_WRITE]


def test_launcher_warning():
    assert bw.pd_window_warning(2, 4, 8, 50e9, 50e9, 500e9) is None
    msg = bw.pd_window_warning(4, 1, 8, 50e9, 50e9, 500e9)
    assert "OUTSIDE" in msg and "DE DRAM" in msg


def test_shipped_paper_configs_are_inside(capsys):
    for name in ("2p4d-ds660b", "1p1d-ds27b", "2p1d-ds27b", "1p2d-ds27b", "1p2d-qwen32b",
                 "48p96d-ds660b", "44p88d-ds660b", "local-1p2d"):
        assert check_config(f"configs/sim-{name}.toml").inside, name
    assert check_main(["-c", "configs/sim-2p4d-ds660b.toml"]) == 0
    assert check_main(["-c", "configs/sim-2p4d-ds660b.toml", "--P", "8", "--D", "1"]) == 1
    assert "OUTSIDE" in capsys.readouterr().out
    assert check_main(["-c", "configs/does-not-exist.toml"]) == 2
