"""Aligned result tables on the terminal (``rich``), shared by the tools and the benchmarks.

Here rather than in ``bench`` so the tools layer (``dualpath demo``) prints the same tables
without importing the layer above it.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

_WIDTH = 10_000     # never wrap or elide a cell: the table is as wide as its content


def cell(v: Any) -> str:
    """How a value prints: floats to 3 decimals, large ones as grouped integers."""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def print_table(rows: list[dict[str, Any]], columns: list[str], file: IO[str] | None = None) -> None:
    """Print ``rows`` as a right-aligned table of ``columns`` (a missing key prints empty)."""
    table = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False)
    for c in columns:
        table.add_column(Text(c), justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*(Text(cell(r.get(c, ""))) for c in columns))
    out = file if file is not None else sys.stdout
    Console(file=out, width=_WIDTH, highlight=False, markup=False, emoji=False).print(table)
