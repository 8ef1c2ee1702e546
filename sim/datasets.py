"""The paper's agentic datasets (Table 2): per-dataset averages, one copy for every workload.

One copy for both workload generators: the simulator's (``sim.workload.TraceWorkload``) and
the live replay's (``tools.replay.workloads.AgenticWorkload``, a layer above ``sim``). Plain
ints, no numpy: ``sim.workload`` is compiled by mypyc and reads these as ordinary Python
objects.

``turns``, ``append`` and ``gen`` drive the generators; ``total`` and ``context`` are Table 2's
measured means, kept for comparison only (``sim.workload.table2_check``).
"""

from __future__ import annotations

import msgspec


class Dataset(msgspec.Struct, frozen=True):
    """One row of Table 2 (token counts are means per trajectory or per turn)."""

    name: str
    max_len: int        # MaxLen: the context an agent compacts at
    turns: int          # mean turns per trajectory
    append: int         # mean appended tokens per turn
    gen: int            # mean generated tokens per turn
    total: int          # Table 2 (for comparison only)
    context: int        # Table 2 (for comparison only)


DATASETS: dict[str, Dataset] = {
    "32k": Dataset("32k", 32 * 1024, 60, 608, 148, 28_639, 17_183),
    "48k": Dataset("48k", 48 * 1024, 106, 474, 172, 42_607, 25_120),
    "64k": Dataset("64k", 64 * 1024, 157, 429, 176, 55_958, 32_721),
}


def dataset(name: str) -> Dataset:
    """The dataset called ``name`` (case-insensitive); ValueError naming the known ones."""
    try:
        return DATASETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}") from None
