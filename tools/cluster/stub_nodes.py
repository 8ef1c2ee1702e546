"""Stand-in group leaders whose engines finish every request at once (no KV, no engines).

For frontend tests and demos of the scheduler alone: each stub prefill node fetches plans and
reports every stage of each (allocated, read_done, prefill_done, second_token, finished with
``gen_tokens``); each stub decode node fetches (and so binds) and applies nothing else. Real
node services replace them (issue 4); the scheduler cannot tell the difference.
"""

from __future__ import annotations

import asyncio
import contextlib

from common.config import RpcConfig
from common.protocol import EngineInfo, RequestPlan

from services.scheduler.client.node_client import NodeSession

STAGES = ("allocated", "read_done", "prefill_done", "second_token")


class StubCluster:
    """``prefill_nodes`` × ``decode_nodes`` stub leaders with ``engines`` engines each."""

    def __init__(self, rpc: RpcConfig, host: str, port: int, *, prefill_nodes: int = 1,
                 decode_nodes: int = 1, engines: int = 2, hbm_bytes: int = 1 << 40,
                 kv_fingerprint: str = "") -> None:
        def session(node: str, role: str, hbm: int) -> NodeSession:
            infos = [EngineInfo(f"{node}.e{i}", role, hbm) for i in range(engines)]
            return NodeSession(rpc, host, port, node_id=node, service=f"stub_{role}", role=role,
                               control=("127.0.0.1", 0), ucx=("127.0.0.1", 0), engines=infos,
                               kv_fingerprint=kv_fingerprint)
        self.sessions = ([session(f"p{i}", "prefill", 0) for i in range(prefill_nodes)]
                         + [session(f"d{i}", "decode", hbm_bytes) for i in range(decode_nodes)])
        self._tasks: list[asyncio.Task] = []
        self.completed = 0

    async def start(self) -> None:
        for s in self.sessions:
            await s.start()
            self._tasks.append(asyncio.create_task(self._fetch_loop(s),
                                                   name=f"stub-fetch-{s.node_id}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        for s in self.sessions:
            await s.close()

    async def __aenter__(self) -> StubCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _fetch_loop(self, s: NodeSession) -> None:
        while True:
            reply = await s.fetch()
            for plan in reply.plans:
                await self._run(s, plan)
            if not reply.more:
                await asyncio.sleep(s.fetch_interval_s)

    async def _run(self, s: NodeSession, plan: RequestPlan) -> None:
        for stage in STAGES:
            await s.report(plan.request_id, plan.attempt, stage)
        await s.report(plan.request_id, plan.attempt, "finished", tokens=plan.gen_tokens)
        self.completed += 1
