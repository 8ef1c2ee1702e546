"""The emulated engines of one node, attached to it across processes.

:class:`RemoteEngineHost` is :class:`~tools.engine_sim.engines.EngineHost` for an engine
process: it attaches each of the node's engine ids to the node's engine socket
(:class:`~services.engine_api.remote.EngineClient`) and runs the unchanged
:class:`~tools.engine_sim.engines.PrefillEngineSim` / ``DecodeEngineSim`` on the remote ports,
so the KV bytes they check and write travel through the node's shared-memory arena. Run it
with ``dualpath serve engine_sim -c CLUSTER --node ID`` (or ``[cluster] remote_engines``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

import structlog

from common.errors import DualpathError
from common.kv import KVSpec
from common.service import Status
from services.engine_api.remote import EngineClient

from tools.config import EngineSimConfig
from .engines import DecodeEngineSim, PrefillEngineSim

log = structlog.get_logger(__name__)

REATTACH_DELAY_S = 0.2     # between attach attempts after the node went away (connect backs off)
REPORT_INTERVAL_S = 0.1    # engine counters pushed to the node at most this often, when changed


class RemoteEngineHost:
    """One emulated engine per id, each attached to ``socket_path`` as that engine."""

    name = "engine_sim"

    def __init__(self, socket_path: str, engine_ids: Sequence[str], role: str, spec: KVSpec,
                 cfg: EngineSimConfig, *, connect_timeout_s: float = 30.0,
                 replace: bool = False) -> None:
        self.socket_path, self.engine_ids, self.role = socket_path, list(engine_ids), role
        self.spec, self.cfg = spec, cfg
        self.connect_timeout_s, self.replace = connect_timeout_s, replace
        self.clients: dict[str, EngineClient] = {}
        self.sims: dict[str, Any] = {}          # engine id → its emulated engine
        self._tasks: list[asyncio.Task] = []
        self.counters_reattach = 0
        self.status = Status.INIT

    async def start(self) -> None:
        """Attach every engine now (a refusal — KV spec, unknown id — fails the start), then
        run each one; an engine whose node went away re-attaches when the node is back."""
        try:
            for engine_id in self.engine_ids:
                client = await self._connect(engine_id, self.replace)
                self._tasks.append(asyncio.get_running_loop().create_task(
                    self._run(engine_id, client), name=f"remote-engine-{engine_id}"))
            self._tasks.append(asyncio.get_running_loop().create_task(
                self._report_loop(), name="remote-engine-counters"))
        except BaseException:
            await self.stop()
            raise
        self.status = Status.RUNNING

    async def _report_loop(self) -> None:
        """Push each engine's counters to its node when they changed (the node's stats show
        them: replay's byte checks read ``engine_verified_requests`` there)."""
        last: dict[str, dict[str, float]] = {}
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            for engine_id, eng in list(self.sims.items()):
                now = {k: float(v) for k, v in eng.counters.items()}
                client = self.clients.get(engine_id)
                if client is None or now == last.get(engine_id):
                    continue
                try:
                    await client.report_counters(now)
                    last[engine_id] = now
                except DualpathError as e:
                    log.debug("engine_counters_not_reported", engine=engine_id, error=repr(e))

    async def _connect(self, engine_id: str, replace: bool) -> EngineClient:
        client = await EngineClient.connect(
            self.socket_path, engine_id=engine_id, role=self.role, kv_spec=self.spec,
            timeout_s=self.connect_timeout_s, replace=replace)
        self.clients[engine_id] = client
        return client

    async def _run(self, engine_id: str, client: EngineClient | None) -> None:
        sim = PrefillEngineSim if self.role == "prefill" else DecodeEngineSim
        while True:
            try:
                if client is None:
                    client = await self._connect(engine_id, False)
                eng = sim(client.port, self.spec, self.cfg)
                old = self.sims.get(engine_id)
                if old is not None:
                    eng.counters = old.counters        # cumulative across re-attaches
                self.sims[engine_id] = eng
                await eng.run()
            except asyncio.CancelledError:
                raise
            except DualpathError as e:
                # the node stopped or restarted: it failed what we held; attach again
                log.warning("remote_engine_detached", engine=engine_id, error=repr(e))
                self.counters_reattach += 1
            if client is not None:
                client.port.close()
                await client.close()
                self.clients.pop(engine_id, None)
            client = None
            await asyncio.sleep(REATTACH_DELAY_S)

    async def stop(self) -> None:
        self.status = Status.CLOSING
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks.clear()
        for engine_id, c in list(self.clients.items()):
            eng = self.sims.get(engine_id)
            if eng is not None:         # a last report: what the node shows is complete
                try:
                    await asyncio.wait_for(c.report_counters(dict(eng.counters)), 1.0)
                except (DualpathError, TimeoutError):
                    pass
            c.port.close()
            await c.close()
        self.clients.clear()
        self.status = Status.CLOSED

    async def wait_stopped(self) -> None:
        """Until every engine task ended (only ``stop`` ends them: they re-attach)."""
        if self._tasks:
            await asyncio.wait(self._tasks)

    def counters(self) -> dict[str, float]:
        total: collections.Counter = collections.Counter()
        for e in self.sims.values():
            total.update(e.counters)
        total["reattaches"] = self.counters_reattach
        return {k: float(v) for k, v in total.items()}

    async def __aenter__(self) -> RemoteEngineHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
