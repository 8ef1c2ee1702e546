"""One replay run against a cluster: workload → records + telemetry → summary dict.

:class:`ClusterTarget` says where the cluster is (a launcher's state, an in-process cluster,
or just a scheduler address) and what the results need to know about it (roles, link rates,
KV bytes per token). :func:`replay` runs the workload and returns everything the results
JSON holds: the workload spec, the per-request records, the telemetry samples, the summary.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from common.config import RpcConfig
from common.kv import spec_from_config

from .driver import ClientPool, Progress, run_agentic, run_trace
from .results import summarize
from .telemetry import Sampler, Target
from .sessions import SessionTrace, SessionTraceSpec, run_sessions
from .workloads import AgenticSpec, AgenticWorkload, TraceSpec, load_mooncake


@dataclass
class ClusterTarget:
    """Where a running cluster answers and what its results need."""

    scheduler: tuple[str, int]
    targets: list[Target] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)
    links: dict[str, float] = field(default_factory=dict)     # storage link bytes/s per node
    bytes_per_token: int = 1024
    block_tokens: int = 64
    slo_scale: float = 1.0
    rpc: RpcConfig = field(default_factory=RpcConfig)
    name: str = "cluster"
    mode: str | None = None

    @classmethod
    def for_cluster(cls, cluster: Any, scheduler: tuple[str, int],
                    gateways: dict[str, tuple[str, int]],
                    nodes: dict[str, tuple[str, int]]) -> ClusterTarget:
        from tools.cluster.config import ROLE_SERVICE
        c, cfg = cluster.spec, cluster.cfg
        spec = spec_from_config(cfg.kv)
        roles = {n.id: n.role for n in c.nodes}
        targets = [Target(n, "storage_gateway", roles[n], *gateways[n]) for n in gateways]
        targets += [Target(n, ROLE_SERVICE[roles[n]], roles[n], *nodes[n]) for n in nodes]
        return cls(scheduler, targets, roles, {n.id: c.storage_link(n) for n in c.nodes},
                   spec.bytes_per_token, spec.block_tokens, c.slo, cfg.rpc, c.name,
                   cluster.mode)

    @classmethod
    def static(cls, cluster: Any) -> ClusterTarget:
        """A cluster deployed elsewhere: endpoints from the config's hosts and fixed ports."""
        from common.errors import ConfigError
        c = cluster.spec
        missing = [f"cluster.nodes[{i}].{f}" for i, n in enumerate(c.nodes)
                   for f in ("gateway_port", "rpc_port") if not getattr(n, f)]
        if not c.scheduler_port:
            missing.insert(0, "cluster.scheduler_port")
        if missing:
            raise ConfigError(f"{cluster.source}: --static needs fixed ports; unset: "
                              f"{', '.join(missing)}")
        return cls.for_cluster(cluster, (c.scheduler_host or c.host, c.scheduler_port),
                               {n.id: (c.node_host(n), n.gateway_port) for n in c.nodes},
                               {n.id: (c.node_host(n), n.rpc_port) for n in c.nodes})

    @classmethod
    def from_state(cls, cluster: Any, state: Any) -> ClusterTarget:
        """A cluster started by ``dualpath cluster up`` (its state file)."""
        return cls.for_cluster(cluster, state.scheduler, state.gateways(),
                               state.node_services())

    @classmethod
    def from_inprocess(cls, c: Any) -> ClusterTarget:
        """A :func:`tools.cluster.inprocess.start_cluster` cluster."""
        return cls.for_cluster(c.cluster, c.scheduler_address, c.gateway_endpoints(),
                               c.node_endpoints())


async def replay(target: ClusterTarget, workload: AgenticSpec | TraceSpec | SessionTraceSpec, *,
                 aps: float | None = None, deadline_s: float = 300.0, retries: int = 3,
                 progress: bool | None = None, window_s: float = 0.5,
                 sample_s: float = 0.25, stop_after_s: float | None = None) -> dict[str, Any]:
    """Run ``workload`` (offline, or online at ``aps``) and summarize it."""
    if isinstance(workload, TraceSpec):
        reqs = load_mooncake(workload, target.block_tokens)
        total, label, streams = len(reqs), "mooncake trace", max(len(reqs), 1)
    elif isinstance(workload, SessionTraceSpec):
        sessions = SessionTrace(workload, target.block_tokens)
        total, label, streams = sessions.requests(), sessions.label, max(len(sessions.plans), 1)
    else:
        w = AgenticWorkload(workload)
        trajs_requests = sum(t.requests for t in w.trajectories())
        total, label, streams = trajs_requests, w.describe(), workload.agents
    sampler = Sampler(target.targets, sample_s, target.rpc) if target.targets else None
    wall0 = time.time()
    async with ClientPool(*target.scheduler, min(streams, 4096), target.rpc) as pool:
        if sampler is not None:
            await sampler.start()
        try:
            with Progress(total, f"{target.mode or 'replay'}", progress) as bar:
                if isinstance(workload, TraceSpec):
                    r = await run_trace(pool, reqs, deadline_s=deadline_s, retries=retries,
                                        progress=bar)
                elif isinstance(workload, SessionTraceSpec):
                    r = await run_sessions(pool, sessions, aps=aps, deadline_s=deadline_s,
                                           retries=retries, progress=bar, stop_after_s=stop_after_s)
                else:
                    r = await run_agentic(pool, w, block_tokens=target.block_tokens, aps=aps,
                                          deadline_s=deadline_s, retries=retries,
                                          progress=bar, stop_after_s=stop_after_s)
        finally:
            if sampler is not None:
                await sampler.stop()
    # the sampler's clock started before the replayer's: align telemetry to the records
    offset = (r.t0 - sampler.t0) if sampler is not None else 0.0
    summary = summarize(r.records, sampler, roles=target.roles, links=target.links,
                        bytes_per_token=target.bytes_per_token,
                        block_tokens=target.block_tokens, slo_scale=target.slo_scale,
                        window_s=window_s)
    return {"cluster": target.name, "mode": target.mode, "started_at": wall0,
            "workload": {"kind": _kind(workload),
                         "online": aps is not None or getattr(workload, "arrivals", "") == "trace",
                         "aps": aps, "label": label,
                         **msgspec.to_builtins(workload)},
            "summary": summary, "telemetry_offset_s": offset,
            **({"dropped_turns": sessions.dropped} if isinstance(workload, SessionTraceSpec) else {}),
            "records": [msgspec.to_builtins(x) for x in sorted(r.records,
                                                                key=lambda x: x.submit_s)],
            "samples": sampler.samples if sampler is not None else []}


def _kind(workload: Any) -> str:
    return {TraceSpec: "trace", SessionTraceSpec: "sessions"}.get(type(workload), "agentic")


async def replay_fresh(cluster: Any, workload: AgenticSpec | TraceSpec | SessionTraceSpec, *, mode: str | None,
                       storage_root: str, inprocess: bool = False, echo: Any = None,
                       remove_storage: bool = False, **kw: Any) -> dict[str, Any]:
    """Start ``cluster`` in ``mode`` on empty storage, replay ``workload``, stop it
    (``remove_storage``: and delete the blocks it wrote)."""
    async with fresh_cluster(cluster, mode=mode, storage_root=storage_root, inprocess=inprocess,
                             echo=echo, remove_storage=remove_storage) as target:
        return await replay(target, workload, **kw)


@contextlib.asynccontextmanager
async def fresh_cluster(cluster: Any, *, mode: str | None, storage_root: str,
                        inprocess: bool = False, echo: Any = None,
                        remove_storage: bool = False) -> AsyncIterator[ClusterTarget]:
    """``cluster`` started in ``mode`` on empty storage, as a replay target; stopped on exit
    (``remove_storage``: and the blocks it wrote deleted). Several may run at once under
    different cluster names (``bench e2e``'s hit-rate sweep alternates bursts between two)."""
    import asyncio
    import shutil
    from pathlib import Path

    from tools.cluster.inprocess import start_cluster
    from tools.cluster.launcher import Launcher

    cl = cluster.with_mode(mode) if mode is not None else cluster
    shutil.rmtree(storage_root, ignore_errors=True)
    Path(storage_root).mkdir(parents=True, exist_ok=True)
    try:
        if inprocess:
            async with start_cluster(cl, storage_root=storage_root) as c:
                yield ClusterTarget.from_inprocess(c)
            return
        cl = cl.with_overrides(cluster={"storage_root": storage_root})
        launcher = Launcher(cl, echo=echo)
        try:
            state = await asyncio.to_thread(launcher.up)
            yield ClusterTarget.from_state(cl, state)
        finally:
            await asyncio.to_thread(launcher.down)
    finally:
        if remove_storage:
            shutil.rmtree(storage_root, ignore_errors=True)
