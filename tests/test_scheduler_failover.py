"""Scheduler failover through etcd (issue 16, item 1): election, fencing epochs, discovery.

Real etcd members (``tests.etcd_members``: Debian etcd-server on free ports, skipped loudly
without it and failed under CI=true) and real scheduler replicas (``dualpath serve
scheduler`` with ``[etcd] endpoints``), killed with SIGKILL. Frontends and node sessions find
the leader in etcd. Conditions are polled; nothing asserts a duration (the failover time is
``dualpath bench failover``'s).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from common.config import RpcConfig
from common.errors import Unavailable
from common.protocol import EngineInfo, RequestFinished, RequestQueued
from services.config import ServicesConfig
from common.kv import spec_from_config
from services.scheduler.client.client import SchedulerClient
from services.scheduler.client.leader import LeaderResolver
from services.scheduler.client.node_client import NodeSession
from services.scheduler.shell.service import SchedulerService
from services.scheduler.service_config import EtcdConfig
from tests.helpers import reap, require_etcd, until
from tests.test_rpc_tls import Pki
from tests.test_scheduler_restart import plans_for, run_to_first_token, take_until_final
from tests.test_scheduler_service import RPC, make_cfg, nxt
from tools.cluster.config import free_port
from tools.cluster.etcd_members import EtcdMembers

REPO = Path(__file__).resolve().parents[1]
# Clients that must ride out an election: RPC gives up after ~0.15 s of failed connects, far
# shorter than a leader change (etcd.lease_s = 2 s + a poll). A new leader starved of the CPU
# for a lease (the stop-36 CI: two pytest processes and vLLM on 2 cores) loses its key and
# campaigns again; a client with RPC's budget then met "no scheduler leader in etcd" in that
# window and failed. ~7 s of retries (reconnect_max_s 0.25 x 60) span such a re-election.
ELECTION_RPC = msgspec.structs.replace(RPC, reconnect_attempts=60, reconnect_max_s=0.25)


def replica(tmp: Path, name: str, endpoints: list[str], rpc: RpcConfig = RPC,
            **env_extra: str) -> tuple[subprocess.Popen, Path]:
    """One scheduler replica; its ready file appears once it is elected. ``rpc``'s TLS files
    reach it as ``DUALPATH__RPC__TLS_*``; ``env_extra``: more environment."""
    ready = tmp / f"ready-{name}"
    tls = {f"DUALPATH__RPC__{f.upper()}": json.dumps(getattr(rpc, f)) for f in
           ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_require_client_cert")
           if getattr(rpc, f)}
    env = {**os.environ, **tls, "DUALPATH__ETCD__ENDPOINTS": json.dumps(endpoints),
           "DUALPATH__SCHEDULER_SERVICE__LEASE_S": "1.0",
           "DUALPATH__SCHEDULER_SERVICE__HEARTBEAT_S": "0.2",
           "DUALPATH__LOGGING__LEVEL": "warning", **env_extra}
    log = open(tmp / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "tools.cluster.serve", "scheduler", "--port",
                             str(free_port()), "--ready-file", str(ready)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    return proc, ready


async def elected(proc: subprocess.Popen, ready: Path, tmp: Path) -> dict[str, Any]:
    await until(lambda: ready.exists() or proc.poll() is not None, timeout=60,
                what="replica elected")
    assert ready.exists(), (tmp / f"{ready.name[6:]}.log").read_text()[-3000:]
    return json.loads(ready.read_text())


def node(etcd: EtcdConfig, node_id: str, role: str, changed: list[int],
         rpc: RpcConfig = RPC, at: tuple[str, int] | None = None) -> NodeSession:
    """A node session finding the leader in etcd (``at``: at this fixed address instead)."""
    kv = spec_from_config(ServicesConfig().kv).fingerprint()
    if at is not None:
        return NodeSession(rpc, *at, node_id=node_id, service="de_loader", role=role,
                           control=("127.0.0.1", 9001), ucx=("127.0.0.1", 9501),
                           engines=[EngineInfo(f"{node_id}.e0", role, 1 << 40)],
                           kv_fingerprint=kv, on_scheduler_changed=changed.append)
    return NodeSession(rpc, "", 0, node_id=node_id,
                       service="pe_receiver" if role == "prefill" else "de_loader", role=role,
                       control=("127.0.0.1", 9001), ucx=("127.0.0.1", 9501),
                       engines=[EngineInfo(f"{node_id}.e0", role, 1 << 40)], kv_fingerprint=kv,
                       on_scheduler_changed=changed.append, resolve=LeaderResolver(etcd))


@pytest.fixture
def etcd(tmp_path):
    require_etcd()
    with EtcdMembers(tmp_path / "etcd", 1) as members:
        yield members


@pytest.mark.reliability
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
async def test_leader_killed_the_standby_takes_over_and_no_request_is_lost(etcd, tmp_path,
                                                                           reliability, tls):
    """Also with mutual TLS on every hop (rpc.tls_*): the failover is unchanged by it."""
    rpc = ELECTION_RPC
    if tls:
        pki = Pki(tmp_path / "pki")
        rpc = pki.cfg(base=ELECTION_RPC, tls_require_client_cert=True)
    cfg = EtcdConfig(endpoints=etcd.endpoints)
    a, a_ready = replica(tmp_path, "a", etcd.endpoints, rpc)
    b = None
    changed: list[int] = []
    p0, d0 = node(cfg, "p0", "prefill", changed, rpc), node(cfg, "d0", "decode", changed, rpc)
    fe = SchedulerClient("", 0, rpc=rpc, resolve=LeaderResolver(cfg))
    try:
        first = await elected(a, a_ready, tmp_path)
        b, b_ready = replica(tmp_path, "b", etcd.endpoints, rpc)    # the standby
        await p0.start()
        await d0.start()
        assert p0.scheduler_epoch == first["epoch"] == p0.highest_epoch
        stream = fe.submit("r", "s", 300, 2)
        assert isinstance(await nxt(stream), RequestQueued)
        await run_to_first_token(p0, await plans_for(p0, d0, "r"))
        seen: list[Any] = []
        final = asyncio.create_task(take_until_final(stream, seen))

        a.kill()                                          # the leader dies without a word
        a.wait()
        second = await elected(b, b_ready, tmp_path)      # its lease ran out: b won
        assert second["epoch"] > first["epoch"]           # fencing epochs only grow
        await until(lambda: len(changed) == 2, timeout=30, what="nodes re-registered with b")
        assert d0.scheduler_epoch == second["epoch"] == d0.highest_epoch
        assert not a_ready.read_text() == b_ready.read_text()
        plan = await plans_for(p0, d0, "r")               # resubmitted, planned again on b
        await run_to_first_token(p0, plan)
        await d0.report("r", plan.attempt, "finished", tokens=2)
        assert isinstance(await final, RequestFinished)
        assert sum(isinstance(e, RequestFinished) for e in seen) == 1
        assert fe.resubmits >= 1
        reliability.record("fault", "kill -9 scheduler leader, etcd standby takes over"
                           + (" (mutual TLS on every hop)" if tls else ""),
                           f"request finished once after resubmission; epoch "
                           f"{first['epoch']} → {second['epoch']}; nodes re-registered",
                           target="scheduler (etcd leader)", action="kill")
    finally:
        await fe.close()
        await p0.close()
        await d0.close()
        for proc in (a, b):
            if proc is not None:
                reap(proc)


@pytest.mark.reliability
async def test_etcd_lost_the_leader_steps_down_and_leads_again_when_it_returns(
        etcd, tmp_path, reliability):
    """etcd gone for longer than ``step_down_s``: the leader stops serving, steps down — and
    stays up as a standby (no supervisor restarts it) — then, once etcd returns, campaigns and
    leads again with a higher epoch, and frontends reach it there."""
    a, a_ready = replica(tmp_path, "a", etcd.endpoints, DUALPATH__ETCD__STEP_DOWN_S="3")
    resolver = LeaderResolver(EtcdConfig(endpoints=etcd.endpoints))
    try:
        first = await elected(a, a_ready, tmp_path)
        etcd.kill(0)
        log = tmp_path / "a.log"
        await until(lambda: "scheduler_stepped_down" in log.read_text() or a.poll() is not None,
                    timeout=30, what="leader stepped down")
        assert a.poll() is None, log.read_text()[-3000:]     # stepped down, still running
        etcd.restart(0)

        async def leads_again() -> bool:
            try:
                return await resolver() == ("127.0.0.1", first["rpc_port"])
            except Unavailable:
                return False
        await until(leads_again, timeout=60, what="the replica leads again on its port")
        fe = SchedulerClient("", 0, rpc=ELECTION_RPC,
                             resolve=LeaderResolver(EtcdConfig(endpoints=etcd.endpoints)))
        try:
            async def new_term_serves() -> bool:   # the key is in etcd just before it serves
                return (await fe.cluster_status()).counters["epoch"] > first["epoch"]
            await until(new_term_serves, timeout=30, what="a new term (a higher epoch) serves")
        finally:
            await fe.close()
        assert a.poll() is None
        reliability.record("fault", "etcd lost while running (1 member killed, restarted)",
                           "leader stepped down after etcd.step_down_s and stayed up as a "
                           "standby; once etcd returned it was elected again with a higher "
                           "epoch, on its port", target="etcd", action="kill")
    finally:
        await resolver.close()
        reap(a)


@pytest.mark.reliability
async def test_a_leader_frozen_past_its_lease_is_deposed_rejoins_and_leads_once_the_other_dies(
        etcd, tmp_path, reliability):
    """The CI failure of ci73, made on purpose: the leader does not run for longer than its
    lease (SIGSTOP here; CPU starvation or a stalled etcd there), its lease lapses and the
    standby leads. Resumed, the old leader learns its lease is gone, steps down and campaigns
    again as a standby — it does not exit — so when the new leader dies too, it leads again:
    some replica always leads once etcd answers."""
    a, a_ready = replica(tmp_path, "a", etcd.endpoints)
    b = None
    resolver = LeaderResolver(EtcdConfig(endpoints=etcd.endpoints))

    async def leader_port() -> int | None:
        try:
            return (await resolver())[1]
        except Unavailable:
            return None
    try:
        first = await elected(a, a_ready, tmp_path)
        b, b_ready = replica(tmp_path, "b", etcd.endpoints)
        os.kill(a.pid, signal.SIGSTOP)                    # frozen: no renewal
        try:
            second = await elected(b, b_ready, tmp_path)  # a's lease lapsed: b won
        finally:
            os.kill(a.pid, signal.SIGCONT)
        assert second["epoch"] > first["epoch"]
        log = tmp_path / "a.log"
        await until(lambda: "scheduler_stepped_down" in log.read_text() or a.poll() is not None,
                    timeout=30, what="the deposed leader stepped down")
        assert a.poll() is None, log.read_text()[-3000:]  # a standby again, not exited
        # The deposed one did not take the lead back: etcd names b — unless b too was starved
        # past its 1-s lease meanwhile (ci80, a host at load 8: etcd then named nobody for a
        # moment), when a later winner is legitimate and b's log says b stepped down.
        named: list[int | None] = []

        async def someone_leads() -> bool:
            named.append(await leader_port())
            return named[-1] is not None
        await until(someone_leads, timeout=30, what=lambda: f"etcd names a leader ({named[-5:]})")
        b_log = (tmp_path / "b.log").read_text()
        assert named[-1] == second["rpc_port"] or "scheduler_stepped_down" in b_log, \
            (named[-5:], b_log[-3000:])
        b.kill()
        b.wait()

        async def a_leads() -> bool:
            return await leader_port() == first["rpc_port"]
        await until(a_leads, timeout=60, what="the rejoined replica leads again")
        reliability.record("fault", "leader frozen past its etcd lease (SIGSTOP), then the "
                           "new leader killed", "the frozen leader, resumed, stepped down and "
                           "rejoined as a standby (no exit); it led again when the new leader "
                           "died", target="scheduler (etcd leader)", action="stop")
    finally:
        await resolver.close()
        for proc in (a, b):
            if proc is not None:
                reap(proc)


async def test_a_term_that_fails_on_its_own_ends_the_replica_and_a_clean_stop_resigns(etcd):
    """A lost lease starts a new term; the term's scheduler failing on its own (a fatal loop
    error) does not: the replica stops FAILED (exit 1 under ``serve_process``, so a supervisor
    restarts it). A replica stopped cleanly revokes its lease: etcd names no leader at once."""
    from common.service import Status as ServiceStatus
    from services.scheduler.app import SchedulerReplica
    cfg = msgspec.structs.replace(make_cfg(), etcd=EtcdConfig(endpoints=etcd.endpoints))
    resolver = LeaderResolver(EtcdConfig(endpoints=etcd.endpoints))
    try:
        failing = SchedulerReplica(cfg, {}, 0, "replica-a")
        await failing.start()                         # returns once elected
        assert failing.epoch > 0 and failing.terms == 1
        assert await resolver() == (failing.host, failing.port)
        await failing.svc.stop()                      # the term's service ends on its own
        await asyncio.wait_for(failing.wait_stopped(), 30)
        assert failing.status is ServiceStatus.FAILED and failing.step_downs == 0
        with pytest.raises(Unavailable):              # and it resigned on the way out
            await resolver()

        clean = SchedulerReplica(cfg, {}, 0, "replica-b")
        await clean.start()
        assert clean.stats()["terms"] == 1.0 and clean.stats()["epoch"] > failing.epoch
        await clean.stop()
        assert clean.status is ServiceStatus.CLOSED
        with pytest.raises(Unavailable):
            await resolver()
    finally:
        await resolver.close()


def test_etcd_unreachable_at_start_fails_naming_the_endpoint(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    # a start window of 4 dial timeouts: a failed try on a loaded host can take past 1.5 s,
    # which left no second try and so no retry log (ci115, beside the real-engine tests)
    env = {**os.environ, "DUALPATH__ETCD__ENDPOINTS": json.dumps([dead]),
           "DUALPATH__ETCD__DIAL_TIMEOUT_S": "1.0", "DUALPATH__ETCD__START_TIMEOUT_S": "4.0"}
    r = subprocess.run([sys.executable, "-m", "tools.cluster.serve", "scheduler", "--port", "0"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert dead in r.stderr and "etcd unreachable" in r.stderr
    assert "etcd_unreachable_at_start" in r.stderr       # it retried for start_timeout_s first


# --------------------------------------------------------------------------- fencing, in-process

async def test_a_deposed_leaders_replies_are_refused_and_a_standby_serves_nobody():
    old, new = (SchedulerService(make_cfg(), port=0, epoch=e) for e in (5, 10))
    standby = SchedulerService(make_cfg(), port=0, epoch=0)
    for svc in (old, new, standby):
        await svc.start()
    target = {"svc": old}

    async def resolve() -> tuple[str, int]:
        return "127.0.0.1", target["svc"].port
    s = NodeSession(RPC, "", 0, node_id="d0", service="de_loader", role="decode",
                    engines=[EngineInfo("d0.e0", "decode", 1 << 40)],
                    kv_fingerprint=new.kv.fingerprint(), resolve=resolve)
    fe = SchedulerClient("127.0.0.1", standby.port, rpc=RPC, resubmit_window_s=0)
    try:
        assert (await s.register()).scheduler_epoch == 5
        target["svc"] = new                               # a new leader was elected
        await s._rpc.drop_connection()
        assert (await s.register()).scheduler_epoch == 10 and s.highest_epoch == 10
        target["svc"] = old                               # the old one still answers (partition)
        await s._rpc.drop_connection()
        assert (await s.fetch()).plans == [] and s.stale_replies == 1   # its plans: refused
        with pytest.raises(Unavailable, match="deposed leader"):
            await s.register()
        assert s.stale_replies == 2 and s.highest_epoch == 10
        with pytest.raises(Unavailable, match="standby"):
            await nxt(fe.submit("r", "s", 100, 2))
        assert standby.active_requests == 0
    finally:
        await fe.close()
        await s.close()
        for svc in (old, new, standby):
            await svc.stop()


async def registered(session: NodeSession, timeout: float = 30.0) -> int:
    """Register ``session`` once the scheduler serves (it refuses while its lease is
    unconfirmed); the epoch it registered under."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return (await session.register()).scheduler_epoch
            except Unavailable:
                await asyncio.sleep(0.1)


@pytest.mark.reliability
@pytest.mark.parametrize("lost", ["raft-leader", "raft-follower"])
async def test_an_etcd_member_lost_the_leader_keeps_its_lease_through_the_others(tmp_path,
                                                                                 reliability,
                                                                                 lost):
    """The lost member is the first one the scheduler tries. Losing etcd's raft leader leaves
    etcd without one for an election or two (seconds; longer than the 2-s lease when the two
    survivors split their votes: ci22): the scheduler may stop serving meanwhile, but its lease
    lives on (a new raft leader extends every lease), so it serves on with the same epoch."""
    require_etcd()
    with EtcdMembers(tmp_path / "etcd3", 3) as members:
        leader = members.raft_leader()
        gone = leader if lost == "raft-leader" else (leader + 1) % 3
        endpoints = [members.endpoints[gone]] + [e for i, e in enumerate(members.endpoints)
                                                 if i != gone]
        cfg = EtcdConfig(endpoints=endpoints)
        a, a_ready = replica(tmp_path, "a", endpoints)
        d0 = node(cfg, "d0", "decode", [])
        fe = SchedulerClient("", 0, rpc=RPC, resolve=LeaderResolver(cfg))
        try:
            first = await elected(a, a_ready, tmp_path)
            members.kill(gone)
            # Fixed wait, on purpose: two leases (etcd.lease_s = 2 s) pass, so a leader whose
            # lease had lapsed would have stepped down (exited) by now. Nothing here is timed;
            # the process, its service and its epoch are checked.
            await asyncio.sleep(4.5)
            assert a.poll() is None, (tmp_path / "a.log").read_text()[-2000:]
            assert await registered(d0) == first["epoch"]         # serving, no failover
            status = await fe.cluster_status(timeout=10)
            assert status.counters["epoch"] == first["epoch"]
            doubted = status.counters["lease_unconfirmed"]
            reliability.record("fault", f"kill -9 one member of a 3-member etcd ({lost}, the "
                               f"member the scheduler tries first)",
                               f"leader kept its lease through the other members; same epoch "
                               f"(stopped serving while unconfirmed: {doubted} time(s))",
                               target="etcd member", action="kill")
        finally:
            await fe.close()
            await d0.close()
            reap(a)


@pytest.mark.reliability
async def test_etcd_restarted_the_leader_serves_on_with_its_lease(etcd, tmp_path, reliability):
    """A one-member etcd killed: the leader stops serving after a lease without renewal (it may
    have been deposed) and, etcd back within ``etcd.step_down_s``, finds its lease alive (etcd
    keeps leases across a restart) and serves on with the same epoch."""
    a, a_ready = replica(tmp_path, "a", etcd.endpoints)
    d0 = fe = None
    try:
        first = await elected(a, a_ready, tmp_path)
        at = ("127.0.0.1", first["rpc_port"])       # etcd is down: no leader lookup there
        d0 = node(EtcdConfig(), "d0", "decode", [], at=at)
        fe = SchedulerClient(*at, rpc=RPC)
        etcd.kill(0)
        await until(lambda: "leader_lease_unconfirmed" in (tmp_path / "a.log").read_text(),
                    timeout=30, what="leader lease unconfirmed")
        with pytest.raises(Unavailable, match="lease unconfirmed"):
            await d0.register()
        etcd.restart(0)
        assert await registered(d0) == first["epoch"]
        assert a.poll() is None
        status = await fe.cluster_status(timeout=10)
        assert status.counters["lease_unconfirmed"] == 1
        assert "leader_lease_confirmed" in (tmp_path / "a.log").read_text()
        reliability.record("fault", "etcd (1 member) killed and restarted under the leader",
                           "leader refused calls while its lease was unconfirmed, then served "
                           "on with the same epoch", target="etcd", action="kill")
    finally:
        for closeable in (fe, d0):
            if closeable is not None:
                await closeable.close()
        reap(a)
