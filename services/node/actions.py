"""The actions both transfer cores emit: one declaration, so the node-attempt driver
(``services/node/driver.py``) runs them the same way for a PE and a DE attempt.

Each core adds its own action types beside these (``services/pe_receiver/transfer.py``,
``services/de_loader/transfer.py``); the ones here mean the same thing on either node. Pure
data, no I/O: the cores stay sans-I/O (docs/datapath.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from common.protocol import Stage


@dataclass(frozen=True, slots=True)
class Report:
    """Report ``stage`` of the attempt to the scheduler (in order)."""

    stage: Stage
    fields: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Log:
    """Log ``event`` at ``level`` (the logger method) with ``fields`` (they include the
    request id)."""

    level: str
    event: str
    fields: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class Count:
    """Add one to the node counter ``counter``."""

    counter: str
