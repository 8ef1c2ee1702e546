"""A small TOML writer for config dicts (the launcher writes the effective cluster file).

Handles what configs hold: strings, booleans, ints, finite floats, lists of scalars, nested
tables and arrays of tables. ``tomllib`` reads back exactly what this writes (tested).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def dumps(data: dict[str, Any]) -> str:
    lines: list[str] = []
    _table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _key(k: str) -> str:
    return k if _BARE.fullmatch(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML cannot hold {v}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)          # JSON string escapes are valid TOML basic strings
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(d: dict[str, Any], path: list[str], lines: list[str]) -> None:
    for k, v in d.items():
        if v is None or isinstance(v, dict) or _is_table_list(v):
            continue
        lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append("")
            lines.append("[" + ".".join(_key(p) for p in [*path, k]) + "]")
            _table(v, [*path, k], lines)
        elif _is_table_list(v):
            for item in v:
                lines.append("")
                lines.append("[[" + ".".join(_key(p) for p in [*path, k]) + "]]")
                _table(item, [*path, k], lines)
