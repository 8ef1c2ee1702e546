"""Chaos case "leader kill during a burst" (issue 16) on a live 1P2D cluster in etcd mode.

Real processes: a 3-member etcd, two scheduler replicas (leader + standby), the node
services and gateways of local 1P2D, which register themselves in etcd (the leader's
``ClusterStatus.discovery`` lists them). Every agent submits its first turn at once; the
leader is SIGKILLed 0.3 s into the burst; every request must finish exactly once with
verified bytes, and no page may leak. Nothing is timed here (``dualpath bench failover``
measures the failover time).
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.helpers import require_etcd, until
from tools.cluster.failover import FailoverHarness

REGISTERED = {"/dualpath/nodes/p0/pe_receiver", "/dualpath/nodes/d0/de_loader",
              "/dualpath/nodes/d1/de_loader", "/dualpath/nodes/p0/storage_gateway",
              "/dualpath/nodes/d0/storage_gateway", "/dualpath/nodes/d1/storage_gateway"}


@pytest.mark.reliability
def test_leader_kill_during_a_burst_loses_and_duplicates_nothing(reliability):
    require_etcd()
    with FailoverHarness() as h:
        discovery = asyncio.run(h.status()).discovery
        assert REGISTERED <= set(discovery), discovery        # every node service and gateway
        assert all(v.startswith("ok ") for v in discovery.values()), discovery
        res = asyncio.run(h.burst_kill(16, turns=2))
        # pages of attempts the dead leader planned are freed by their leases: wait for quiet
        quiet_s = asyncio.run(h._quiet(None))
        not_quiet = h.not_quiet                           # what it saw last, if never quiet
        leaks, mismatches, _ = asyncio.run(h._leaks())
        after = asyncio.run(h.status()).discovery
        gone = asyncio.run(_kill_9_a_node(h, "de_loader:d1", "/dualpath/nodes/d1/de_loader"))
    assert len(res.kills) == 1
    kill = res.kills[0]
    assert kill.in_flight and kill.in_flight > 0           # the burst was in the dead leader
    assert kill.new_epoch is not None and kill.old_epoch is not None
    assert kill.new_epoch > kill.old_epoch
    assert res.lost == 0, res.lost_detail
    assert res.finished == res.planned > 0
    assert res.duplicate_finals == 0
    assert quiet_s is not None, (leaks, not_quiet)        # every page free in the end
    assert sum(v or 0 for v in leaks.values()) == 0 and mismatches == 0, leaks
    assert REGISTERED <= set(after)                        # the new leader's watch sees them
    assert gone                                            # kill -9 → key and node gone
    reliability.record("fault", "kill -9 the scheduler leader during a burst (standby, etcd)",
                       f"{kill.in_flight} requests in the dead leader; {res.finished}/"
                       f"{res.planned} finished once, epoch {kill.old_epoch} → "
                       f"{kill.new_epoch}, 0 leaked pages",
                       target="scheduler (etcd leader)", action="kill")


async def _kill_9_a_node(h: FailoverHarness, name: str, key: str) -> bool:
    """SIGKILL one node service; its etcd key runs out with its lease and the leader's view
    (``ClusterStatus.discovery`` and ``nodes``) drops it. The other keys stay."""
    os.kill(h.launcher.state.proc(name).pid, signal.SIGKILL)
    node_id, service = key.split("/")[-2:]

    async def dropped() -> bool:
        st = await h.status()
        return key not in st.discovery and not any(
            n.node_id == node_id and n.service == service for n in st.nodes)
    await until(dropped, timeout=30, what=f"{key} gone from the leader's view")
    return set((await h.status()).discovery) == REGISTERED - {key}
