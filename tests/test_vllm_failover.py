"""Real vLLM engines through dualpath while the scheduler leader is SIGKILLed and a standby,
elected over etcd, takes over: the front and the node services follow the leader in etcd.

``dualpath cluster up`` of ``configs/vllm-1p1d.toml`` in etcd mode (``[etcd] endpoints``: one
etcd member this test starts): gateways, the scheduler (the first leader), a PE receiver, a DE
loader, two vLLM OpenAI servers with the connector and the front, which ``cluster up`` starts
with ``--etcd`` (``tools.cluster.real_engines.front_command``) — every one its own process —
plus a standby scheduler replica from the leader's own command line on another port
(``tools.cluster.failover.spawn_standby``).

1. two agents' first turns, each equal to plain vLLM;
2. a turn in flight when the leader — whichever replica etcd names — is SIGKILLed (no
   restart): the other replica is elected and the turn answers — the correct output, or a
   typed OpenAI error — within a deadline far below the front's 900 s;
3. that new leader is SIGKILLed too, the next standby held stopped until etcd holds no
   leader at all, and a turn is sent into that gap: the front holds it until the standby,
   resumed, is elected and takes it — the output of plain vLLM, not an error;
4. every agent's next turn goes through the last leader (the old one's port is dead: only a
   front and nodes that follow etcd reach it), loads the KV the earlier turns stored (a hit)
   and equals plain vLLM: nothing wrong was stored across the change of leader.

``tests/test_vllm_faults.py`` restarts a killed scheduler on its port (no etcd) and kills the
other services; ``tests/test_failover_burst.py`` kills leaders under a burst on emulated
engines.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from functools import partial
from pathlib import Path

import pytest

from tests.helpers import require_etcd
from tests.test_vllm_faults import Agents, check_answered, front_in_flight, wait_dead
from tests.vllm_env import require_vllm
from tools.cluster.chaos import ChaosLauncher
from tools.cluster.etcd_members import EtcdMembers
from tools.cluster.failover import poll_until, spawn_standby
from tools.cluster.real_engines import on_loopback
from tools.vllm_serve import tokenize

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "vllm-1p1d.toml"
ELECTED_S = 30.0        # lease 2 s: the standby is elected within a few seconds


async def test_standby_takes_over_a_killed_leader_under_real_engines(tmp_path):
    python, model = require_vllm()
    require_etcd()
    etcd = EtcdMembers(tmp_path / "etcd", 1)              # ports chosen, nothing started yet
    launcher = ChaosLauncher(on_loopback(CONFIG, tmp_path / "cluster",
                                         sections={"etcd": {"endpoints": etcd.endpoints}}))
    spawned: list = []                       # standby replicas this test started
    try:
        etcd.start()
        state = await asyncio.to_thread(launcher.up)
        front = str(state.proc("front").url)
        assert "--etcd" in launcher.commands["front"].argv     # cluster up wired it
        leader_argv = list(launcher.commands["scheduler"].argv)
        standby = spawn_standby(leader_argv, tmp_path, 0)
        spawned.append(standby)
        prefill = str(state.proc("vllm:p0.e0").url)
        text = " ".join(f"Round {i}: the agent ran grep -n 'def f{i}' src/a{i}.py and got "
                        f"{i * 5} matches; next it edits line {i * 11}." for i in range(240))
        ids = await tokenize(prefill, str(model), text)
        agents = Agents(front, [ids[k * 5:] for k in range(2)])
        for out in await asyncio.gather(*(agents.turn(a) for a in range(2))):
            assert out["status"] == 200 and out["equal"], out            # turn 1: no fault

        # the leader dies with a turn in flight and stays dead: the other replica takes over.
        # "The leader" is whichever replica etcd names now: a host stall longer than the 2-s
        # lease during turn 1 may have deposed the first one already (ci70), which then
        # stepped down and campaigns again as a standby (services.scheduler.app)
        first = state.proc("scheduler")
        # port → (pid, wait until it is dead): the launcher's process, and our own child
        by_port = {int(first.rpc_port): (first.pid, partial(wait_dead, first)),
                   argv_port(standby.proc.args): (standby.pid, partial(standby.proc.wait, 60))}
        lead = await poll_until(leader_port(etcd.endpoints), ELECTED_S)
        assert lead in by_port, f"etcd names a leader on port {lead}, none of {by_port}"
        (other,) = set(by_port) - {lead}
        turn = asyncio.create_task(agents.turn(0))
        await front_in_flight(front)
        t_kill = time.monotonic()
        os.kill(by_port[lead][0], signal.SIGKILL)
        await asyncio.to_thread(by_port[lead][1])
        assert await poll_until(leader_is(etcd.endpoints, other), ELECTED_S), \
            f"the other replica was not elected within {ELECTED_S} s"
        t_elected = time.monotonic() - t_kill
        out = await turn
        check_answered(out)

        # that leader dies too, with the next standby held stopped (SIGSTOP) until etcd holds
        # no leader at all; a turn sent into that gap is held by the front until the
        # standby, resumed, is elected and takes it — never failed
        standby = spawn_standby(leader_argv, tmp_path, 1)
        spawned.append(standby)
        os.kill(standby.pid, signal.SIGSTOP)
        try:
            os.kill(by_port[other][0], signal.SIGKILL)
            await asyncio.to_thread(by_port[other][1])
            assert await poll_until(no_leader(etcd.endpoints), ELECTED_S), \
                "the dead leader's key outlived its etcd lease"
            in_the_gap = asyncio.create_task(agents.turn(1))
            await front_in_flight(front)                 # the only request: it is waiting
        finally:
            os.kill(standby.pid, signal.SIGCONT)
        assert await poll_until(standby.elected, ELECTED_S), \
            f"the resumed standby was not elected within {ELECTED_S} s"
        gap = await in_the_gap
        assert gap["status"] == 200 and gap["equal"], gap
        print(f"elected {t_elected:.1f} s after the first kill; the turn in flight then: "
              f"status {out['status']} in {out['took_s']:.1f} s; the turn sent with no "
              f"leader: {gap['took_s']:.1f} s")

        # every agent's next turn through the last leader: hits what was stored, correct
        for out in await asyncio.gather(*(agents.turn(a) for a in range(2))):
            assert out["status"] == 200 and out["equal"], out
            assert out["hit"] > 0, out
    finally:
        for replica in spawned:
            if replica.proc.poll() is None:
                replica.proc.kill()                  # (a stopped one dies of SIGKILL too)
            replica.proc.wait()
        try:
            await asyncio.to_thread(launcher.down)
        finally:
            etcd.stop()


def argv_port(argv: list[str]) -> int:
    return int(argv[argv.index("--port") + 1])


def leader_port(endpoints: list[str]):
    """A probe: the port of the scheduler leader etcd names (None while there is none)."""
    from common.errors import Unavailable
    from services.scheduler.client.leader import LeaderResolver
    from services.scheduler.service_config import EtcdConfig

    async def probe() -> int | None:
        resolver = LeaderResolver(EtcdConfig(endpoints=endpoints))
        try:
            return (await resolver())[1]
        except Unavailable:
            return None
        finally:
            await resolver.close()
    return probe


def leader_is(endpoints: list[str], port: int):
    probe = leader_port(endpoints)

    async def is_it() -> bool:
        return await probe() == port
    return is_it


def no_leader(endpoints: list[str]):
    """A probe: True once etcd holds no scheduler leader (the dead one's lease lapsed)."""
    probe = leader_port(endpoints)

    async def none() -> bool:
        return await probe() is None
    return none
