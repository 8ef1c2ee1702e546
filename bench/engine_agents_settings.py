"""``dualpath bench engine_agents``'s settings from its command line: ``--scheduler-set``,
``--set``, ``--variant`` (TOML values, each checked before the cluster starts: a typo found
minutes into a run would lose the run) and the bench's own defaults under them
(:func:`run_defaults`; bench/engine_agents_bench.py's docstring says why each).
"""

from __future__ import annotations

from typing import Any

NODE_BUFFER = 512 * 2**20           # the bench's PE and DE buffers: a wave (the bench's docstring)


def scheduler_settings(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items (TOML values) as ``[scheduler]`` settings, checked against
    ``SchedulerConfig`` now (ValueError naming the item) rather than at the first restart."""
    from services.scheduler.core.config import SchedulerConfig

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{item!r} is not KEY=VALUE")
        out[key.strip()] = _toml_value(value)
    _check(out, SchedulerConfig)
    return out


def _check(values: dict[str, Any], section: type, label: str = "") -> None:
    """``values`` as a ``section`` would take them (ValueError with msgspec's reason, after
    ``label``): checked now, not when a service restarts on them minutes into the run."""
    import msgspec

    try:
        msgspec.convert(values, section)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"{label}{e}") from None


def _section_item(item: str) -> tuple[str, str, Any]:
    """``SECTION.KEY=VALUE`` as (section, key, TOML value); ValueError naming the item."""
    path, sep, value = item.partition("=")
    section, dot, key = path.strip().rpartition(".")
    if not sep or not dot or not section or not key:
        raise ValueError(f"{item!r} is not SECTION.KEY=VALUE")
    return section, key, _toml_value(value)


VARIANT_SECTIONS = ("gateway", "scheduler")    # the services restarted between modes


def variant_settings(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--variant SECTION.KEY=VALUE`` items by section: only ``[gateway]`` and
    ``[scheduler]``, the services restarted between modes (a node service's setting would
    not change within the run); the scheduler's checked as ``--scheduler-set``'s are."""
    from services.scheduler.core.config import SchedulerConfig
    from storage_gateway.config import GatewayConfig

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        section, key, value = _section_item(item)
        if section not in VARIANT_SECTIONS:
            raise ValueError(f"{item!r}: SECTION must be one of {', '.join(VARIANT_SECTIONS)} "
                             f"(the services restarted between modes)")
        out.setdefault(section, {})[key] = value
    _check(out.get("scheduler", {}), SchedulerConfig, "[scheduler] ")
    _check(out.get("gateway", {}), GatewayConfig, "[gateway] ")
    return out


def cluster_settings(items: list[str]) -> dict[str, dict[str, Any]]:
    """``SECTION.KEY=VALUE`` items (TOML values) as cluster-file settings by section; the
    scheduler's go through ``--scheduler-set`` (checked field by field there)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        section, key, value = _section_item(item)
        if section == "scheduler":
            raise ValueError(f"{item!r}: use --scheduler-set {key}={item.partition('=')[2]}")
        out.setdefault(section, {})[key] = value
    return out


def _toml_value(value: str) -> Any:
    import tomllib

    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value            # a bare word: a string


def run_defaults(settings: dict[str, dict[str, Any]], scheduler: dict[str, Any]) -> None:
    """The bench's own defaults, under what ``--set`` / ``--scheduler-set`` gave: the PE's and
    DE's buffers a wave (``NODE_BUFFER``). The storage links are the services' defaults (full
    duplex, no write bytes in the read-side rule, reads in their arrival order); asked for
    half-duplex links, the settings that go with them (write bytes counted, reads shared: the
    bench's docstring, "Storage links")."""
    for service in ("pe_receiver", "de_loader"):
        settings.setdefault(service, {}).setdefault("buffer_bytes", NODE_BUFFER)
    if settings.get("gateway", {}).get("link_duplex") == "half":
        scheduler.setdefault("write_weight", 1)
        settings["gateway"].setdefault("read_order", "shared")


def storage_links(cfg: Any) -> dict[str, Any]:
    """How a cluster config's storage links run — the results name it, since the services'
    defaults decide it unless ``--set`` / ``--scheduler-set`` did (and have changed once:
    half duplex with the shared order before 2026-12-07)."""
    return {"link_duplex": cfg.gateway.link_duplex, "read_order": cfg.gateway.read_order,
            "write_weight": cfg.scheduler.write_weight}
