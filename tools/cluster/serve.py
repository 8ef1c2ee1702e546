"""``dualpath serve <service> -c cluster.toml --node ID``: run one service of a cluster.

What the launcher, the systemd units and docker-compose all run. The service's config is
rendered from the cluster file (:func:`tools.cluster.config.service_config`); addresses a
local launcher learns at start are passed as flags:

    dualpath serve scheduler   -c configs/local-1p2d.toml [--lookup-gateway HOST:PORT]
    dualpath serve gateway     -c configs/local-1p2d.toml --node p0
    dualpath serve pe_receiver -c configs/local-1p2d.toml --node p0 [--scheduler HOST:PORT]
    dualpath serve de_loader   -c configs/local-1p2d.toml --node d0 [--gateway-port P]
    dualpath serve node        -c ... --node d0      # the node's role service (PE / DE)

Once serving, one JSON line goes to stdout (and ``--ready-file``, written atomically):
``{"event": "ready", "service", "node_id", "host", "rpc_port", "ucx_port", "metrics_port",
"pid"}``. SIGTERM/SIGINT stop it in order (metrics, engines, service). Exit status: 0 after a
clean stop, 2 for a bad config or arguments, 1 when the service failed.

The scheduler's hit lookup asks a storage gateway (``LookupPrefix``) when one is known
(``--lookup-gateway`` or the first node's fixed ``gateway_port``): hits are what storage holds,
across sessions too (Mooncake traces share prefixes between requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from common.errors import DualpathError
from common.logging import configure_logging
from common.service import run_cli

from .config import Cluster, ROLE_SERVICE, load_cluster, service_config

SERVICE_CHOICES = ("scheduler", "gateway", "pe_receiver", "de_loader", "node")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath serve", description="run one service of a cluster")
    p.add_argument("service", choices=SERVICE_CHOICES)
    p.add_argument("-c", "--config", default=None, help="cluster TOML (default: embedded 1P2D)")
    p.add_argument("--node", default=None, help="node id (every service but the scheduler)")
    p.add_argument("--mode", default=None, help="ablation mode (basic, +layer, +dpl, dualpath, "
                                               "oracle): scheduler policy + engine mode")
    p.add_argument("--port", type=int, default=None, help="override this service's port")
    p.add_argument("--scheduler", default=None, help="HOST:PORT of the scheduler")
    p.add_argument("--gateway-port", type=int, default=None, help="this node's gateway port")
    p.add_argument("--lookup-gateway", default=None, help="scheduler: HOST:PORT of a gateway "
                                                          "answering hit lookups")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics here (0: any free port)")
    p.add_argument("--ready-file", type=Path, default=None, help="write the ready JSON here")
    return p


def _hostport(text: str | None, what: str) -> tuple[str, int] | None:
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise DualpathError(f"{what} must be HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


class _Runner:
    """Starts one service, announces it, waits for a signal, stops it in order."""

    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        self.cluster, self.args = cluster, args
        self.stack = contextlib.AsyncExitStack()
        self.info: dict[str, Any] = {}

    async def main(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with self.stack:
            svc = await self._start()
            await self._metrics()
            self._announce()
            waiter = asyncio.ensure_future(svc.wait_stopped())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
            for t in (waiter, stopper):
                t.cancel()
            if waiter.done() and not stopper.done():
                raise DualpathError(f"{self.info.get('service')} stopped on its own "
                                    f"(status {svc.status.value})")

    async def _start(self) -> Any:
        a, service = self.args, self.args.service
        if service == "node":
            service = ROLE_SERVICE[self.cluster.spec.node(_need_node(a)).role]
        self.info = {"event": "ready", "service": service, "node_id": a.node or "scheduler",
                     "pid": os.getpid()}
        if service == "scheduler":
            return await self._scheduler()
        if service == "gateway":
            return await self._gateway()
        return await self._node(service)

    async def _scheduler(self) -> Any:
        from services.scheduler.service import SchedulerService
        cfg = service_config(self.cluster, "scheduler", resolve=True)
        lookup = await self._lookup(cfg)
        svc = SchedulerService(cfg, port=self.args.port, hit_lookup=lookup)
        await self.stack.enter_async_context(svc)
        self.info.update(host=svc.host, rpc_port=svc.port)
        self._source("scheduler", "scheduler", _scheduler_source(svc))
        return svc

    async def _lookup(self, cfg: Any) -> Any:
        target = _hostport(self.args.lookup_gateway, "--lookup-gateway")
        c = self.cluster.spec
        first = c.nodes[0]
        if target is None and first.gateway_port:
            target = (c.node_host(first), first.gateway_port)
        if target is None:
            return None            # the scheduler's per-session index
        from common.kv import spec_from_config
        from services.scheduler.hit_lookup import FunctionHitLookup
        from storage_gateway.client import GatewayClient
        client = GatewayClient.connect(cfg.rpc, target[0], target[1], None, None,
                                       spec_from_config(cfg.kv), node_id="scheduler")
        self.stack.push_async_callback(client.close)

        async def lookup(keys):
            return (await client.lookup_prefix(keys)).hit_blocks
        return FunctionHitLookup(lookup)

    async def _gateway(self) -> Any:
        from storage_gateway.service import GatewayService
        node = _need_node(self.args)
        cfg = service_config(self.cluster, "gateway", node, resolve=True)
        port = self.args.port if self.args.port is not None else \
            self.cluster.spec.node(node).gateway_port
        Path(cfg.gateway.root).mkdir(parents=True, exist_ok=True)
        svc = GatewayService(cfg, node, rpc_port=port)
        await self.stack.enter_async_context(svc)
        self.info.update(host=cfg.rpc.host, rpc_port=svc.rpc_port, ucx_port=svc.ucx_address[1])
        from common.metrics import gateway_stats
        self._source("storage_gateway", node, gateway_stats(svc))
        return svc

    async def _node(self, service: str) -> Any:
        from tools.engine_sim.engines import EngineHost
        from tools.cluster.node_runner import build
        a = self.args
        node = _need_node(a)
        cfg = service_config(self.cluster, service, node,
                             scheduler=_hostport(a.scheduler, "--scheduler"),
                             gateway_port=a.gateway_port, resolve=True)
        if a.port is not None:
            import msgspec
            section = msgspec.structs.replace(getattr(cfg, service), rpc_port=a.port)
            cfg = msgspec.structs.replace(cfg, **{service: section})
        svc = build(service, cfg, node, None)
        await self.stack.enter_async_context(svc)
        host = await self.stack.enter_async_context(EngineHost(svc, cfg.engine_sim))
        svc.extra_stats = host.counters
        self.info.update(host=getattr(cfg, service).host, rpc_port=svc.rpc_port,
                         ucx_port=svc.ucx_address[1], engines=list(svc.engine_ids))
        self._source(service, node, svc.stats)
        return svc

    def _source(self, service: str, node: str, fn: Any) -> None:
        from common.metrics import register_source, unregister_source
        register_source(service, node, fn)
        self.stack.callback(unregister_source, service, node)

    async def _metrics(self) -> None:
        port = self.args.metrics_port
        if port is None:
            port = _configured_metrics_port(self.cluster, self.info["service"],
                                            self.args.node)
        if port is None:
            self.info["metrics_port"] = None
            return
        from common.metrics import MetricsEndpoint
        ep = MetricsEndpoint()
        host = self.info.get("host") or self.cluster.spec.host
        self.info["metrics_port"] = await ep.start(port, host)
        self.stack.push_async_callback(ep.stop)

    def _announce(self) -> None:
        line = json.dumps(self.info)
        f = self.args.ready_file
        if f is not None:
            tmp = f.with_suffix(f.suffix + ".tmp")
            tmp.write_text(line + "\n")
            tmp.replace(f)                     # readers never see half a line
        print(line, flush=True)


def _need_node(a: argparse.Namespace) -> str:
    if not a.node:
        raise DualpathError(f"dualpath serve {a.service} needs --node ID")
    return a.node


def _configured_metrics_port(cluster: Cluster, service: str, node: str | None) -> int | None:
    c = cluster.spec
    if service == "scheduler":
        return c.scheduler_metrics_port
    n = c.node(node)
    return n.gateway_metrics_port if service == "gateway" else n.metrics_port


def _scheduler_source(svc: Any) -> Any:
    from common.metrics import scheduler_stats
    return scheduler_stats(svc)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from common.faults import check_env
        armed = check_env()              # a bad DUALPATH_FAILPOINTS exits 2 before starting
        cluster = load_cluster(args.config, mode=args.mode)
        if args.service != "scheduler":
            node = cluster.spec.node(_need_node(args))
            service = ROLE_SERVICE[node.role] if args.service == "node" else args.service
            service_config(cluster, service, node.id)        # wrong role → exit 2
    except DualpathError as e:
        print(f"dualpath serve: {e.message}", file=sys.stderr)
        return 2
    cfg = cluster.cfg
    configure_logging(cfg.logging.level, cfg.logging.json)
    if armed:
        print(f"dualpath serve {args.service}: failpoints armed: {armed}", file=sys.stderr)
    return run_cli(f"dualpath serve {args.service}", _Runner(cluster, args).main(),
                   use_uvloop=cfg.rpc.use_uvloop)


if __name__ == "__main__":
    sys.exit(main())
