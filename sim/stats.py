"""Bounded-memory measurement: log-bucket latency sketches, per-window link series, summaries.

Millions of requests are measured without keeping a record per request: each latency goes into
a ``LogHistogram`` (1 % relative bucket width, fixed size), and link traffic is sampled once per
time window from the links' integrated byte counters.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

from .flows import Link


class LogHistogram:
    """Streaming percentiles with ≤ 0.5 % relative error over [1 µs, 1e6 s]; O(1) insert."""

    __slots__ = ("counts", "n", "total", "lo", "hi", "_inv", "_base", "zeros")

    LO = 1e-6
    RATIO = 1.01

    def __init__(self) -> None:
        self._inv = 1.0 / math.log(self.RATIO)
        size = int(math.log(1e6 / self.LO) * self._inv) + 2
        self.counts = array("q", bytes(8 * size))
        self.n = 0
        self.total = 0.0
        self.lo = math.inf
        self.hi = 0.0
        self.zeros = 0
        self._base = math.log(self.LO)

    def add(self, x: float, _log=math.log) -> None:
        self.n += 1
        self.total += x
        if x > self.hi:
            self.hi = x
        if x < self.lo:
            self.lo = x
        if x <= 1e-6:
            self.zeros += 1
            return
        i = int((_log(x) - self._base) * self._inv)
        try:
            self.counts[i] += 1
        except IndexError:
            self.counts[-1] += 1

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def quantile(self, q: float) -> float:
        if not self.n:
            return 0.0
        rank = q * (self.n - 1)
        seen = self.zeros
        if rank < seen:
            return max(self.lo, 0.0)
        for i, c in enumerate(self.counts):
            seen += c
            if seen > rank:
                mid = math.exp(self._base + (i + 0.5) / self._inv)
                return min(max(mid, self.lo), self.hi)
        return self.hi

    def summary(self) -> dict[str, float]:
        return {"n": self.n, "mean": self.mean, "p50": self.quantile(0.5), "p90": self.quantile(0.9),
                "p99": self.quantile(0.99), "max": self.hi if self.n else 0.0}

    def cdf_points(self) -> tuple[list[float], list[float]]:
        """(value, cumulative fraction) per non-empty bucket, for plots."""
        xs, ys, seen = [], [], self.zeros
        for i, c in enumerate(self.counts):
            if c:
                seen += c
                xs.append(math.exp(self._base + (i + 1) / self._inv))
                ys.append(seen / self.n)
        return xs, ys


class WindowSeries:
    """Bytes carried by each of a set of links per fixed time window."""

    def __init__(self, links: Sequence[Link], window_s: float) -> None:
        self.links = list(links)
        self.window_s = window_s
        self.rows: list[array] = []
        self._last = [0.0] * len(self.links)

    def sample(self, now: float) -> None:
        cur = [link.bytes_at(now) for link in self.links]
        self.rows.append(array("d", (c - p for c, p in zip(cur, self._last))))
        self._last = cur

    def utilisation(self) -> list[list[float]]:
        """Per window, per link: carried ÷ (capacity × window)."""
        caps = [link.cap * self.window_s for link in self.links]
        return [[b / c for b, c in zip(row, caps)] for row in self.rows]

    def max_avg(self, min_load: float = 0.5) -> tuple[float, int]:
        """Mean over loaded windows of max ÷ mean traffic across the links (1.0 = perfect balance).

        A window counts when its mean traffic is at least ``min_load`` × the busiest window's mean:
        the paper notes the ratio loses meaning once the run winds down (§7.4).
        """
        means = [sum(r) / len(r) for r in self.rows if len(r)]
        if not means:
            return 1.0, 0
        thr = min_load * max(means)
        ratios = [max(r) / m for r, m in zip(self.rows, means) if m > 0 and m >= thr]
        return (sum(ratios) / len(ratios) if ratios else 1.0), len(ratios)


def link_summary(groups: dict[str, Sequence[Link]], now: float) -> dict[str, dict[str, float]]:
    """Per link class: mean and max utilisation over [0, now] and bytes carried."""
    out = {}
    for name, links in groups.items():
        if not links or now <= 0:
            continue
        utils = [link.bytes_at(now) / (link.cap * now) for link in links]
        out[name] = {"links": len(links), "mean_util": sum(utils) / len(utils), "max_util": max(utils),
                     "bytes": sum(link.bytes_at(now) for link in links)}
    return out
