"""TOML text of a config dict (the launcher writes the effective cluster file), via ``tomli_w``.

The one thing added on top of the library: ``None`` values are dropped, since TOML has no null
and an unset optional key reads back as its default. ``tomllib`` reads back what this writes
(tested).
"""

from __future__ import annotations

from typing import Any

import tomli_w


def dumps(data: dict[str, Any]) -> str:
    """``data`` as TOML, keys whose value is ``None`` left out (at any depth)."""
    return tomli_w.dumps(_drop_none(data))


def _drop_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list | tuple):
        return [_drop_none(x) for x in v]
    return v
