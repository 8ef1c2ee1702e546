"""The emulated engines keep serving when one request's end fails typed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog.testing

from common.errors import Cancelled
from common.kv import PRESETS
from tests.helpers import until
from tools.config import EngineSimConfig
from tools.engine_sim import engines
from tools.engine_sim.engines import DecodeEngineSim, EngineHost


@dataclass
class Info:
    session_id: str
    prompt_tokens: int = 64
    gen_tokens: int = 1


@dataclass
class Handle:
    """A decode request whose attempt the node drops while the engine waits in took_kv()
    (``dropped``: finish then fails as a dropped attempt's does), as a failover does."""

    request_id: str
    dropped: bool = False
    info: Info = field(init=False)
    first_token_id: int | None = None
    finished: list[int] | None = None
    failed: BaseException | None = None

    def __post_init__(self) -> None:
        self.info = Info(f"s-{self.request_id}")

    async def took_kv(self) -> None:
        await asyncio.sleep(0)

    async def finish(self, out: list[int]) -> None:
        if self.dropped:
            raise Cancelled("attempt dropped: scheduler lease lost (the scheduler re-planned "
                            "our work)")
        self.finished = list(out)

    async def fail(self, error: BaseException | None) -> None:
        self.failed = error


class Queue:
    engine_id = "d0.e0"

    def __init__(self, handles: list[Handle]) -> None:
        self._ready: asyncio.Queue[Handle] = asyncio.Queue()
        for h in handles:
            self._ready.put_nowait(h)

    async def next_ready(self) -> Handle:
        return await self._ready.get()

    def try_next(self) -> Handle | None:
        return None if self._ready.empty() else self._ready.get_nowait()


async def test_a_one_token_request_dropped_while_admitted_fails_and_the_engine_serves_on():
    """ci19's failover flake: a one-token request ends in admission; its attempt dropped
    meanwhile, finish raised and ended the engine's task — silently, so every later request
    on that engine waited forever. Now it fails typed and the next request finishes."""
    doomed, next_one = Handle("a", dropped=True), Handle("b")
    engine = DecodeEngineSim(Queue([doomed, next_one]), PRESETS["test-small"],
                             EngineSimConfig(verify=False, hbm_copy=False))
    task = asyncio.create_task(engine.run())
    try:
        await until(lambda: next_one.finished is not None or task.done(),
                    what="the request after the dropped one")
        assert not task.done(), task.exception()
        assert isinstance(doomed.failed, Cancelled) and doomed.finished is None
        assert next_one.finished is not None and next_one.failed is None
        assert engine.counters["dropped"] == 1 and engine.counters["finished"] == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_engine_task_that_dies_is_reported_at_once():
    """An engine's task that ends with an error while its host runs is logged when it dies,
    not only at stop (a dead engine strands every request placed on it), and once."""

    class Service:
        spec = PRESETS["test-small"]
        ports: dict = {}

    async def broken() -> None:
        raise RuntimeError("engine crashed")

    host = EngineHost(Service(), EngineSimConfig())
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(broken(), name="engine-x")
        task.add_done_callback(engines._report_death)      # as EngineHost.start does
        host._tasks.append(task)
        await asyncio.gather(task, return_exceptions=True)
        await until(lambda: logs, what="the death logged while the host runs")
        assert [(e["event"], e["task"]) for e in logs] == [("engine_failed", "engine-x")]
        await host.stop()
    assert len(logs) == 1, logs                                # not again at stop
