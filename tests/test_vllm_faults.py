"""Real vLLM engines through dualpath while its services are SIGKILLed mid-request.

``dualpath cluster up`` of ``configs/vllm-1p2d.toml`` (free ports, temporary state): gateways,
scheduler, a PE receiver, two DE loaders, three vLLM OpenAI servers with the connector and the
front — every one its own process. Agents' conversations go through the front; each fault is a
real SIGKILL at a chosen step of a request (a failpoint armed in the victim over SIGUSR1,
``common.faults``) or from outside while a request is in flight:

1. a DE loader dies while assembling a request's prompt KV and stays dead: the request is
   re-planned onto the other decode node (or fails typed) — never held to a deadline; the
   node is then restarted in place and its vLLM instance re-attaches; then the other DE
   loader dies while the PE pulls a hit from it layer by layer (a load failing inside the
   prefill's forward), and is restarted;
2. the PE receiver dies while sending a prefilled layer to the DE, and is restarted;
3. a storage gateway dies while reading a hit; restarted;
4. the scheduler is killed with a request in flight and restarted on its port (no etcd
   standby here: tests/test_failover_burst.py covers the standby);
4b. a decode vLLM instance is frozen (SIGSTOP): its DE loader hears no beat for
   ``engine_silence_s`` and detaches it, the turns meanwhile are answered, and once resumed it
   attaches again by itself;
4c. a decode vLLM instance's step does not end (``vllm.step=delay``, armed in its engine
   process) while its worker's client thread still beats: past ``engine_stuck_s`` its DE
   loader takes it out of service, what it held is re-planned, the turns meanwhile are
   answered, and once the step ends its next beat puts it back in service, on the same
   attachment (a claim refused OUT_OF_SERVICE meanwhile asks again);
5. a decode vLLM instance is killed and stays dead: the scheduler takes its engine out of
   placement (its node reports it not attached) and every later turn is served by the other.

Every answered request's greedy output equals plain vLLM (the front with ``kv_loading: false``
on the same prompt); a failed one is a typed OpenAI error (503/502/500 with a code), within a
deadline far below the front's 900 s. Afterwards every session's next turn, which loads what
the faults' turns stored, still equals plain vLLM: nothing wrong was stored (a wrong block
would change the greedy output of the turns that load it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from common.config import RpcConfig
from common.faults import FILE_ENV
from services.scheduler.client.client import SchedulerClient
from tests.helpers import until
from tests.test_durability import service_stats
from tests.vllm_env import require_vllm
from tools.cluster.launcher import Launcher, State, alive
from tools.cluster.real_engines import on_loopback
from tools.proc_group import group_files, group_pids, remove_files
from tools.vllm_serve import ahttp, tokenize

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "vllm-1p2d.toml"
GEN = 12
FIRST = 600
APPEND = 40
ANSWER_S = 240.0        # a request's answer (output or typed error) within this, faults included
STUCK_S = 15.0          # the DE loaders' engine_stuck_s here (120 s by default)
HUNG_STEP_S = 45.0      # how long 4c's hung step lasts: well past STUCK_S


class Agents:
    """Multi-turn sessions through the front, each turn checked against plain vLLM."""

    def __init__(self, front: str, texts: list[list[int]]) -> None:
        self.front, self.texts = front, texts
        self.prompts = [t[:FIRST] for t in texts]
        self.cursor = [FIRST] * len(texts)
        self.outcomes: list[dict] = []

    async def turn(self, a: int) -> dict:
        """One turn of agent ``a``: through dualpath, then the same prompt recomputed; the
        conversation moves on only when dualpath answered."""
        body = {"model": "smollm2", "prompt": self.prompts[a], "max_tokens": GEN,
                "session_id": f"agent-{a}"}
        t0 = time.monotonic()
        status, raw = await ahttp("POST", f"{self.front}/v1/completions", body, ANSWER_S)
        took = time.monotonic() - t0
        ref_status, ref_raw = await ahttp("POST", f"{self.front}/v1/completions",
                                          {**body, "kv_loading": False}, ANSWER_S)
        assert ref_status == 200, ref_raw
        ref = json.loads(ref_raw)["dualpath"]["token_ids"]
        out = {"agent": a, "status": status, "took_s": took}
        if status == 200:
            dp = json.loads(raw)["dualpath"]
            out.update(hit=dp["hit_tokens"], equal=dp["token_ids"] == ref,
                       request=dp["request_id"], side=dp["read_side"], pe=dp["pe_engine"],
                       de=dp["de_engine"])
            if not out["equal"]:              # what differs, for the failure's message
                out.update(got=dp["token_ids"], ref=ref)
            self.prompts[a] = (self.prompts[a] + dp["token_ids"]
                               + self.texts[a][self.cursor[a]:self.cursor[a] + APPEND])
            self.cursor[a] += APPEND
        else:                                  # a typed OpenAI error, never a bare failure
            out["error"] = json.loads(raw)["error"]
        self.outcomes.append(out)
        return out


def check_answered(out: dict) -> None:
    assert out["took_s"] < ANSWER_S, out
    if out["status"] == 200:
        assert out["equal"], f"output after a fault != plain vLLM: {out}"
    else:
        assert out["status"] in (500, 502, 503) and out["error"].get("code"), out


async def kill_at(launcher: Launcher, victim: str, spec: str, agents: Agents,
                  turns: list[int], fp_file: Path) -> list[dict]:
    """Arm ``spec`` in ``victim`` (SIGKILL at that step), then run agents' turns — together,
    round after round — until the victim died; every turn's outcome."""
    state = launcher.state
    assert state is not None
    proc = state.proc(victim)
    fp_file.write_text(spec)
    os.kill(proc.pid, signal.SIGUSR1)
    outs: list[dict] = []
    for _ in range(4):                     # the scheduler places: the victim may not get one
        outs += await asyncio.gather(*(agents.turn(a) for a in turns))
        if not alive(proc):
            return outs
    raise AssertionError(f"{victim} never reached {spec} in 4 rounds: {outs}")


async def test_services_killed_under_real_engines(tmp_path, monkeypatch):
    python, model = require_vllm()
    fp_file = tmp_path / "failpoints"
    fp_file.write_text("")
    monkeypatch.setenv(FILE_ENV, str(fp_file))     # every service re-arms from it on SIGUSR1
    launcher = Launcher(on_loopback(CONFIG, tmp_path / "cluster",
                                    sections={"de_loader": {"engine_stuck_s": STUCK_S}}))
    state: State = await asyncio.to_thread(launcher.up)
    try:
        front = str(state.proc("front").url)
        prefill = str(state.proc("vllm:p0.e0").url)
        text = " ".join(f"Step {i}: tool read_file('pkg/m{i}.py') gave {i * 7} lines; "
                        f"call parse_{i}(limit={i * 3})." for i in range(260))
        ids = await tokenize(prefill, str(model), text)
        texts = [ids[k * 7:] for k in range(3)]        # three agents, different contexts
        agents = Agents(front, texts)
        for out in await asyncio.gather(*(agents.turn(a) for a in range(3))):
            assert out["status"] == 200 and out["equal"], out            # turn 1: no fault

        # 1. a DE loader dies while assembling a request's KV, and stays dead meanwhile
        outs = await kill_at(launcher, "de_loader:d0", "de.assemble=kill", agents, [0, 1, 2],
                             fp_file)
        for out in outs:
            check_answered(out)
        await asyncio.to_thread(launcher.restart, "de_loader:d0")

        # 1b. a DE loader dies while the PE pulls a hit from it layer by layer (DE read path):
        # the PE's loads (or its saves to the dead DE) fail inside vLLM's forward, after vLLM
        # cached the hit's blocks; every row not loaded is reported and the prefill instance
        # (kv_load_failure_policy "fail") evicts them, so the re-planned attempt on it never
        # takes half-written blocks as a local hit (docs/vllm.md "A failed load")
        outs = await kill_at(launcher, "de_loader:d1", "de.pull.send=kill@3", agents,
                             [0, 1, 2], fp_file)
        for out in outs:
            check_answered(out)
        await asyncio.to_thread(launcher.restart, "de_loader:d1")

        # 2. the PE receiver dies sending a prefilled layer; a supervisor restarts it
        victim = state.proc("pe_receiver:p0")
        fp_file.write_text("pe.handoff.send=kill")
        os.kill(victim.pid, signal.SIGUSR1)
        turn = asyncio.create_task(agents.turn(1))
        await asyncio.to_thread(wait_dead, victim)
        await asyncio.to_thread(launcher.restart, "pe_receiver:p0")
        check_answered(await turn)

        # 3. a storage gateway dies reading a hit
        outs = await kill_at(launcher, "gateway:p0", "gw.read=kill", agents, [0, 2], fp_file)
        for out in outs:
            check_answered(out)
        await asyncio.to_thread(launcher.restart, "gateway:p0")

        # 4. the scheduler dies with a request in flight; restarted on its port
        sched = state.proc("scheduler")
        turn = asyncio.create_task(agents.turn(0))
        await front_in_flight(front)
        os.kill(sched.pid, signal.SIGKILL)
        await asyncio.to_thread(wait_dead, sched)
        await asyncio.to_thread(launcher.restart, "scheduler")
        check_answered(await turn)

        # 4b. a decode vLLM instance frozen (SIGSTOP, every process of it): its socket stays
        # open but its worker's beats stop; after engine_silence_s its DE loader detaches it,
        # the scheduler takes it out (what it held re-plans onto d0) and the turns meanwhile
        # are answered; resumed (SIGCONT), it attaches again by itself (docs/engine-api.md,
        # "A silent engine")
        victim = state.proc("vllm:d1.e0")
        frozen = group_pids(victim.pid)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            turns = asyncio.gather(*(agents.turn(a) for a in range(3)))
            await engine_placement(state.proc("scheduler").rpc_port, "d1.e0", attached=False)
            for out in await turns:
                check_answered(out)
        finally:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        await engine_placement(state.proc("scheduler").rpc_port, "d1.e0", attached=True)

        # 4c. a decode vLLM instance whose step does not end (a hung kernel, a deadlocked
        # collective) while its worker's client thread still beats: the beats say how long the
        # step has run; past engine_stuck_s its DE loader takes it out of service (what the
        # node still held for it fails retryable and re-plans; a turn already decoding inside
        # vLLM resumes with the step) and the turns meanwhile are answered; once the step
        # ends its next beat puts it back in service (engines_unstuck), on the same
        # attachment: a claim of its first step after the hang that comes before that beat
        # is refused OUT_OF_SERVICE and asks again, it does not attach anew (before, it did:
        # docs/engine-api.md "A stuck engine")
        victim = state.proc("vllm:d1.e0")
        loader = state.proc("de_loader:d1")
        de_d1 = {"d1": (loader.host, int(loader.rpc_port))}
        before = (await service_stats(RpcConfig(), de_d1))["d1"]
        fp_file.write_text(f"vllm.step=delay:{HUNG_STEP_S:g}")
        os.kill(worker_pid(victim.pid), signal.SIGUSR1)
        for _ in range(4):                     # the scheduler places: d1 may not get one
            for out in await asyncio.gather(*(agents.turn(a) for a in range(3))):
                check_answered(out)
            if "FAILPOINT vllm.step" in Path(victim.log).read_text(errors="replace"):
                break
        else:
            raise AssertionError("no turn reached d1's vLLM in 4 rounds")
        fp_file.write_text("")

        async def grew(*keys: str) -> bool:
            now = (await service_stats(RpcConfig(), de_d1))["d1"]
            return any(now.get(k, 0) > before.get(k, 0) for k in keys)
        # (the step may hang after the turn it served was answered: the judgement comes now)
        await until(lambda: grew("engine_api_engines_stuck"), HUNG_STEP_S + 60,
                    "d1's engine out of service while its step hung", interval=0.2)
        await until(lambda: grew("engine_api_engines_unstuck"),
                    HUNG_STEP_S + 60, "d1's engine back in service after its step ended",
                    interval=0.2)
        assert not await grew("engine_api_attaches"), "d1's worker attached anew"
        await engine_placement(state.proc("scheduler").rpc_port, "d1.e0", attached=True)

        # 5. a decode vLLM instance is SIGKILLed and stays dead: its DE loader reports its
        # engine not attached, the scheduler places nothing more on it, and every turn is
        # served by the other decode instance (before, each placement there waited for its
        # deadline: docs/engine-api.md "An engine that is not attached")
        victim = state.proc("vllm:d1.e0")
        left_files = group_files(victim.pid)        # unlinked below: nobody stops it later
        kill_instance(victim.pid)
        await asyncio.to_thread(wait_dead, victim)
        await until(lambda: not group_pids(victim.pid), 60, what="d1's vLLM group gone")
        remove_files(left_files)
        await engine_placement(state.proc("scheduler").rpc_port, "d1.e0", attached=False)
        outs = await asyncio.gather(*(agents.turn(a) for a in range(3)))
        for out in outs:
            assert out["status"] == 200 and out["equal"] and out["de"] == "d0.e0", out

        # afterwards: every agent's next turn loads what the faults' turns stored
        for out in await asyncio.gather(*(agents.turn(a) for a in range(3))):
            assert out["status"] == 200 and out["equal"], out
        hits = [o["hit"] for o in agents.outcomes[-3:]]
        assert all(h > 0 for h in hits), agents.outcomes
        print("outcomes:", json.dumps(agents.outcomes))
    finally:
        await asyncio.to_thread(launcher.down)


def kill_instance(pgid: int) -> None:
    """SIGKILL every process of a vLLM instance (its server, its engine core) but its
    multiprocessing resource tracker: that one sees its clients gone, unlinks the named
    semaphores they registered (``/dev/shm/sem.mp-*``, which no mapping names, so
    ``group_files`` cannot find them) and exits — killed with the rest, it left one per
    run."""
    for pid in group_pids(pgid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def worker_pid(pgid: int) -> int:
    """The worker process of a vLLM instance (group ``pgid``, ``VLLM::Worker``, a child of
    its engine core): where the forward, and so the connector's ``vllm.step``, runs."""
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            if pid != pgid and b"::Worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"no VLLM::Worker process in vLLM group {pgid}: {group_pids(pgid)}")


def wait_dead(proc, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while alive(proc):
        assert time.monotonic() < deadline, f"{proc.name} did not die"
        time.sleep(0.05)


async def engine_placement(port: int | None, engine: str, *, attached: bool,
                           timeout_s: float = 60.0) -> None:
    """Until the scheduler's status lists ``engine`` as (not) attached."""
    assert port is not None
    deadline = time.monotonic() + timeout_s
    async with SchedulerClient("127.0.0.1", port) as sched:
        while True:
            status = await sched.cluster_status(timeout=10.0)
            if any(e.engine_id == engine and e.attached == attached for e in status.engines):
                return
            assert time.monotonic() < deadline, \
                f"{engine} not {'attached' if attached else 'detached'}: {status.engines}"
            await asyncio.sleep(0.1)


async def front_in_flight(front: str, timeout_s: float = 60.0) -> None:
    """Until the front has a request running (its in-flight gauge)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, raw = await ahttp("GET", f"{front}/metrics", None, 10)
        if status == 200 and any(line.startswith("dualpath_front_requests_in_flight ")
                                 and float(line.split()[-1]) >= 1
                                 for line in raw.decode().splitlines()):
            return
        assert time.monotonic() < deadline, "no request in flight at the front"
        await asyncio.sleep(0.05)
