"""Paper §4.2: per-link loads of a PD cluster whose storage links all run at full speed,
and the no-bottleneck P/D window of eq. (9).

Notation (paper §4.2): ``P``/``D`` prefill/decode nodes, ``g`` GPUs (and CNICs) per node, one
CNIC of bandwidth ``B`` per GPU, ``s·B`` storage (SNIC) bandwidth per node, ``M`` DRAM bandwidth
per node. With every SNIC saturated, one (PE GPU, DE GPU) pair carries ``T_p = B·s/(D·g²)`` on
the PE read path and ``T_c = B·s/(P·g²)`` on the DE read path (eq. 1–8):

=====================  ==============================  =====================================
link                   load                            constraint
=====================  ==============================  =====================================
PE CNIC read           2·T_p·D·g = 2s/g · B            (1) s ≤ g/2
PE CNIC write          (T_p + T_c)·D·g                 (3) P/D ≥ s/(g − s)
DE CNIC read           (T_p + 2·T_c)·P·g               (5) P/D ≤ (g − 2s)/s
DE CNIC write          (2·T_p + T_c)·P·g               (7) P/D ≤ (g − s)/(2s)
PE DRAM (half-duplex)  2·s·B                           normally far below M
DE DRAM (half-duplex)  (3 + 2·P/D)·s·B                 (8) P/D ≤ (M/(B·s) − 3)/2
=====================  ==============================  =====================================

The window is a *sufficient* condition (the paper ran nothing outside it). Eq. (1) is printed in
the paper as "s ≤ g"; the algebra gives s ≤ g/2, which is what is checked here.

Exact arithmetic: integers and ``Fraction`` in give ``Fraction`` out (the test vectors of
``tests/test_sim_bandwidth.py`` are exact); floats in give floats.
"""

from __future__ import annotations

from fractions import Fraction
from numbers import Real

import msgspec

# Constraint names as printed by check-config (and used by the tests).
PE_CNIC_READ = "PE CNIC read s <= g/2 (eq. 1)"
PE_CNIC_WRITE = "PE CNIC write s/(g-s) (eq. 3)"
DE_CNIC_READ = "DE CNIC read (g-2s)/s (eq. 5)"
DE_CNIC_WRITE = "DE CNIC write (g-s)/(2s) (eq. 7)"
DE_DRAM = "DE DRAM (M/Bs-3)/2 (eq. 8)"

_REL_TIE = 1e-9


def _num(x: Real) -> Real:
    """Keep ints/Fractions exact; everything else becomes float."""
    return Fraction(x) if isinstance(x, (int, Fraction)) else float(x)


class PDRange(msgspec.Struct, frozen=True):
    """Eq. (9): ``lower ≤ P/D ≤ upper``; ``uppers`` holds every upper bound by name."""

    lower: Real
    upper: Real
    uppers: dict[str, Real]
    pe_read_ok: bool            # eq. (1)

    @property
    def feasible(self) -> bool:
        return self.pe_read_ok and self.lower <= self.upper

    def binding_uppers(self) -> list[str]:
        """Names of the upper bounds equal to the minimum (ties listed together)."""
        up = float(self.upper)
        return [k for k, v in self.uppers.items() if abs(float(v) - up) <= _REL_TIE * max(1.0, abs(up))]


def pd_range(g: Real, s: Real, m_over_bs: Real) -> PDRange:
    """The no-bottleneck P/D interval of eq. (9).

    ``g``: GPUs = CNICs per node; ``s``: per-node storage bandwidth in units of one CNIC;
    ``m_over_bs``: per-node DRAM bandwidth ÷ per-node storage bandwidth.
    """
    g, s, m = _num(g), _num(s), _num(m_over_bs)
    if g <= 0 or s <= 0 or m <= 0:
        raise ValueError(f"g, s and M/Bs must be positive, got g={g}, s={s}, M/Bs={m}")
    lower = s / (g - s) if g > s else float("inf")
    uppers = {DE_CNIC_READ: (g - 2 * s) / s,
              DE_CNIC_WRITE: (g - s) / (2 * s),
              DE_DRAM: (m - 3) / 2}
    return PDRange(lower, min(uppers.values()), uppers, 2 * s <= g)


def link_loads(P: Real, D: Real, g: Real, s: Real, B: Real = 1, M: Real | None = None) -> dict[str, Real]:
    """Per-link loads as fractions of capacity when every SNIC is saturated.

    CNIC loads are per GPU, DRAM loads per node; every value must be ≤ 1 for no new bottleneck.
    """
    P, D, g, s, B = (_num(x) for x in (P, D, g, s, B))
    tp, tc = B * s / (D * g * g), B * s / (P * g * g)
    out = {"PE_CNIC_read": 2 * tp * D * g / B,
           "PE_CNIC_write": (tp + tc) * D * g / B,
           "DE_CNIC_read": (tp + 2 * tc) * P * g / B,
           "DE_CNIC_write": (2 * tp + tc) * P * g / B}
    if M is not None:
        M = _num(M)
        out["PE_DRAM"] = 2 * s * B / M
        out["DE_DRAM"] = (3 + 2 * P / D) * B * s / M
    return out


class Verdict(msgspec.Struct, frozen=True):
    """check-config's answer for one cluster shape."""

    P: int
    D: int
    g: int
    s: float
    m_over_bs: float
    pd: float
    lower: float
    upper: float
    inside: bool
    binding: list[str]          # the constraint(s) that bind: violated ones if outside, else the tightest
    violated: list[str]
    loads: dict[str, float]     # per-link loads at full storage speed (fractions of capacity)
    storage_basic_bytes_per_s: float
    storage_dualpath_bytes_per_s: float

    def summary(self) -> str:
        where = "inside" if self.inside else "OUTSIDE"
        return (f"P/D = {self.P}/{self.D} = {self.pd:.3f} is {where} the no-bottleneck range "
                f"[{self.lower:.4g}, {self.upper:.4g}] (g={self.g}, s={self.s:g}, M/Bs={self.m_over_bs:g}); "
                f"binding: {', '.join(self.binding)}")


def check(P: int, D: int, g: int, snic_bytes_per_s: float, cnic_bytes_per_s: float,
          dram_bytes_per_s: float) -> Verdict:
    """Eq. (9) and the §3 per-link loads for a concrete cluster's hardware."""
    if P <= 0 or D <= 0:
        raise ValueError(f"need at least one prefill and one decode node, got P={P}, D={D}")
    s = _ratio(snic_bytes_per_s, cnic_bytes_per_s)
    m = _ratio(dram_bytes_per_s, snic_bytes_per_s)
    r = pd_range(g, s, m)
    pd = Fraction(P, D)
    violated = []
    if not r.pe_read_ok:
        violated.append(PE_CNIC_READ)
    if pd < r.lower:
        violated.append(PE_CNIC_WRITE)
    violated += [k for k, v in r.uppers.items() if pd > v]
    if violated:
        binding = violated
    else:
        # The tightest side: the bound P/D sits closest to (relative distance).
        lo_gap = float(pd / r.lower) if r.lower else float("inf")
        hi_gap = float(r.upper / pd)
        binding = [PE_CNIC_WRITE] if lo_gap < hi_gap else r.binding_uppers()
    loads = {k: float(v) for k, v in link_loads(P, D, g, s, 1, m * s).items()}
    return Verdict(P, D, g, float(s), float(m), float(pd), float(r.lower), float(r.upper),
                   not violated, binding, violated, loads,
                   P * snic_bytes_per_s, (P + D) * snic_bytes_per_s)


def pd_window_warning(P: int, D: int, g: int, snic_bytes_per_s: float, cnic_bytes_per_s: float,
                      dram_bytes_per_s: float) -> str | None:
    """One line for a launcher to log when the shape is outside eq. (9)'s window, else ``None``."""
    v = check(P, D, g, snic_bytes_per_s, cnic_bytes_per_s, dram_bytes_per_s)
    if v.inside:
        return None
    return (v.summary() + " — with every storage link busy, " + ", ".join(v.violated)
            + " would become the bottleneck; change P/D or the link rates")


def _ratio(a: float, b: float) -> Real:
    """a/b, exact when both are integral (config values like 50e9 are), else float."""
    if b <= 0 or a <= 0:
        raise ValueError(f"bandwidths must be positive, got {a} and {b}")
    if float(a).is_integer() and float(b).is_integer():
        return Fraction(int(a), int(b))
    return a / b
