"""UCX's own transport choice, read from its log (``UCX_LOG_LEVEL=info``).

UCX prints one line per endpoint configuration a worker creates, e.g.::

    ucp_context_0 inter-node cfg#2 tag(tcp/eth0)  rma_am(tcp/eth0)  am(tcp/eth0) ...
    ucp_context_0 intra-node cfg#5 tag(sysv/memory tcp/eth0)  rma(sysv/memory posix/memory) ...

"inter-node" is UCX's verdict that the peer is another machine (its machine id differs: the
hosts' UTS namespaces give them different hostnames). A cross-host lane over shared memory or
single copy would mean the "hosts" still share a kernel object they must not (issue #17): the
check fails on any of :data:`LOCAL_ONLY` in an inter-node configuration, and on a log with no
inter-node configuration at all (then nothing crossed a host and the check would be vacuous).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LOCAL_ONLY = frozenset({"sm", "posix", "sysv", "cma", "knem", "xpmem"})
_LINE = re.compile(r"ucp_context_\d+\s+(intra|inter)-node cfg#\d+\s+(.*)$")
_LANE = re.compile(r"([a-z_]+)\(([^)]*)\)")


@dataclass(frozen=True)
class EpConfig:
    """One endpoint configuration: inter- or intra-node and its transports per operation."""

    inter_node: bool
    lanes: dict[str, tuple[str, ...]]      # "tag" -> ("tcp",), "rma" -> ("sysv", "posix")

    @property
    def transports(self) -> set[str]:
        return {t for tls in self.lanes.values() for t in tls}


def parse(log_text: str) -> list[EpConfig]:
    """Every endpoint configuration line in ``log_text``."""
    out = []
    for line in log_text.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        lanes = {op: tuple(dev.split("/")[0] for dev in devs.split())
                 for op, devs in _LANE.findall(m.group(2))}
        out.append(EpConfig(m.group(1) == "inter", lanes))
    return out


def cross_host_violations(configs: list[EpConfig]) -> list[str]:
    """Why the cross-host lanes are wrong (empty: every inter-node lane avoids shm/cma)."""
    inter = [c for c in configs if c.inter_node]
    if not inter:
        return ["no inter-node endpoint configuration in the log: nothing crossed a host"]
    return [f"inter-node lanes use {sorted(c.transports & LOCAL_ONLY)}: {c.lanes}"
            for c in inter if c.transports & LOCAL_ONLY]
