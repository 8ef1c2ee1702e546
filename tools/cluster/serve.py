"""``dualpath serve <service> -c FILE [--node ID]``: the one process shell of every service.

What the launcher, the systemd units, docker-compose, tests and scripts all run:

    dualpath serve scheduler   -c configs/local-1p2d.toml [--lookup-gateway [NAME=]HOST:PORT ...]
    dualpath serve gateway     -c configs/local-1p2d.toml --node p0
    dualpath serve pe_receiver -c configs/local-1p2d.toml --node p0 [--scheduler HOST:PORT]
    dualpath serve de_loader   -c configs/local-1p2d.toml --node d0 [--gateway-port P]
    dualpath serve node        -c ... --node d0      # the node's role service (PE / DE)
    dualpath serve engine_sim  -c ... --node p0      # its emulated engines, in this process,
                                                     # attached over the node's engine socket
    dualpath serve gateway     -c configs/default.toml --node n0 --port 0   # a plain host file

``-c`` takes a cluster file (one with a ``[cluster]`` section: the service's config is rendered
from it, :func:`tools.cluster.config.service_config`, and ``--node`` must name one of its
nodes) or a plain host config without ``[cluster]`` (``configs/default.toml``): used as written,
``--node`` is just this service's id, and ``node`` is refused (a plain file has no roles —
name ``pe_receiver`` or ``de_loader``). Without ``-c``: the embedded 1P2D cluster. Every
service but the scheduler needs ``--node``. Flags override the file: ``--port`` (this
service's port; a plain-file gateway defaults to 0, any free port), ``--scheduler`` /
``--gateway-port`` (what a node service dials), ``--engines`` / ``--no-engines``.

Once serving, one JSON line goes to stdout (and ``--ready-file``, written atomically):
``{"event": "ready", "service", "node_id", "host", "rpc_port", "ucx_port", "metrics_port",
"pid"}`` (node services add ``engines``). SIGTERM/SIGINT stop it in order (metrics, engines,
service): :func:`common.service.serve_process`. Exit status: 0 after a clean stop, 2 for a
bad config or arguments, 1 when the service failed.

The scheduler's hit lookup asks the storage gateways of the shared store (``LookupPrefix``),
one per lookup in turn and the next one when one fails
(:class:`~services.scheduler.shell.gateway_lookup.GatewayHitLookup`): those ``--lookup-gateway``
names (repeated or comma-separated), else every node of the cluster file with a fixed
``gateway_port``. Hits are what storage holds, across sessions too (Mooncake traces share
prefixes between requests). No gateway known: the scheduler's per-session index.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from common.config import build_config, env_overlay, read_toml
from common.errors import ConfigError, DualpathError
from common.logging import configure_logging
from common.metrics import export_source
from common.service import Service, run_cli, serve_process
from tools.config import DualpathConfig

from .config import ROLE_SERVICE, Cluster, apply_mode, load_cluster, load_data, service_config
from .loop_watch import LoopStallWatch, watching

if TYPE_CHECKING:
    from services.node.base import NodeBase

SERVICE_CHOICES = ("scheduler", "gateway", "pe_receiver", "de_loader", "node", "engine_sim")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath serve", description="run one dualpath service")
    p.add_argument("service", choices=SERVICE_CHOICES)
    p.add_argument("-c", "--config", default=None,
                   help="cluster TOML or plain host TOML (default: embedded 1P2D cluster)")
    p.add_argument("--node", default=None, help="node id (every service but the scheduler)")
    p.add_argument("--mode", default=None, help="ablation mode (basic, +layer, +dpl, pe-only, "
                                               "dualpath, oracle): scheduler policy + engine mode")
    p.add_argument("--port", type=int, default=None, help="override this service's port")
    p.add_argument("--scheduler", default=None, help="HOST:PORT of the scheduler")
    p.add_argument("--gateway-port", type=int, default=None, help="this node's gateway port")
    p.add_argument("--lookup-gateway", action="append", default=None,
                   help="scheduler: [NAME=]HOST:PORT of a gateway answering hit lookups "
                        "(repeat or comma-separate: every gateway of the shared store)")
    p.add_argument("--engines", type=int, default=None,
                   help="node services: emulated engines (default: from the config)")
    p.add_argument("--no-engines", action="store_true",
                   help="attach no emulated engines (a real engine embeds the API instead)")
    p.add_argument("--engine-socket", default=None,
                   help="node services: serve the engine ports on this Unix socket (engines "
                        "in other processes attach; no emulated engines here); engine_sim: "
                        "the node socket to attach to (default: the node's engine_socket)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics here (0: any free port)")
    p.add_argument("--ready-file", type=Path, default=None, help="write the ready JSON here")
    return p


def _hostport(text: str | None, what: str) -> tuple[str, int] | None:
    return None if text is None else _parse_hostport(text, what)


def _parse_hostport(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise DualpathError(f"{what} must be HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def lookup_gateways(values: list[str]) -> dict[str, tuple[str, int]]:
    """``--lookup-gateway`` values (each ``[NAME=]HOST:PORT``, comma-separated or repeated)
    as name → address; a gateway without a name is called by its address."""
    out: dict[str, tuple[str, int]] = {}
    for item in (part.strip() for value in values for part in value.split(",")):
        if not item:
            continue
        name, _, addr = item.rpartition("=")
        out[name or addr] = _parse_hostport(addr, "--lookup-gateway")
    return out


# --------------------------------------------------------------------------- what to serve

@dataclass(frozen=True)
class Target:
    """The file ``serve`` runs from: a cluster (configs rendered per service) or a plain host
    config (every service gets it as written)."""

    cluster: Cluster | None
    host_cfg: DualpathConfig | None = None

    @property
    def cfg(self) -> DualpathConfig:
        if self.cluster is not None:
            return self.cluster.cfg
        assert self.host_cfg is not None
        return self.host_cfg

    def service(self, service: str, node: str | None) -> str:
        """``service`` with ``node`` resolved to the node's role service."""
        if service not in ("node", "engine_sim"):
            return service
        if self.cluster is None:
            raise ConfigError(f"serve {service}: a plain host config (no [cluster]) has no "
                              f"node roles — name the service: pe_receiver or de_loader"
                              f"{' (engine_sim needs a cluster file)' if service != 'node' else ''}")
        return ROLE_SERVICE[self.cluster.spec.node(_need(node, service)).role]

    def config(self, service: str, node: str | None, **dial: Any) -> DualpathConfig:
        """The config ``service`` on ``node`` runs with; a node service's addresses to dial
        (``scheduler``, ``gateway_port``) override the file's."""
        if self.cluster is not None:
            return service_config(self.cluster, service, node, resolve=True, **dial)
        cfg = self.cfg
        if service in ROLE_SERVICE.values():
            sched = dial.get("scheduler")
            over = {} if sched is None else {"scheduler_host": sched[0], "scheduler_port": sched[1]}
            if dial.get("gateway_port") is not None:
                over["gateway_port"] = dial["gateway_port"]
            cfg = _with_section(cfg, service, **over)
        return cfg

    def metrics_port(self, service: str, node: str | None) -> int | None:
        """The fixed metrics port the cluster file gives ``service`` (None: no endpoint)."""
        if self.cluster is None:
            return None
        return self.cluster.spec.metrics_port(service, node)


def load_target(path: str | None, mode: str | None) -> Target:
    """Read ``path`` as a cluster file when it has ``[cluster]``, else as a plain host file."""
    if path is None:
        return Target(load_cluster(None, mode=mode))
    data = read_toml(path)
    if "cluster" in data:
        return Target(load_data(data, str(path), mode=mode))
    data = env_overlay(data)
    if mode is not None:
        data = apply_mode(data, mode)
    return Target(None, build_config(data, DualpathConfig, str(path), environ={}))


def _with_section(cfg: DualpathConfig, section: str, **fields: Any) -> DualpathConfig:
    if not fields:
        return cfg
    new = msgspec.structs.replace(getattr(cfg, section), **fields)
    return msgspec.structs.replace(cfg, **{section: new})


def _need(node: str | None, service: str) -> str:
    if not node:
        raise ConfigError(f"dualpath serve {service} needs --node ID")
    return node


# --------------------------------------------------------------------------- the roles

@dataclass
class Serving:
    """One ``dualpath serve`` invocation: what to serve, from which file, with which flags."""

    target: Target
    args: argparse.Namespace

    @property
    def service(self) -> str:
        """The service run (``node`` / ``engine_sim`` resolved to the node's role service)."""
        return self.target.service(self.args.service, self.args.node)

    def head(self) -> dict[str, Any]:
        """The ready line's first fields; the composition root adds its own."""
        return {"event": "ready", "service": self.service,
                "node_id": self.args.node or "scheduler", "pid": os.getpid()}

    def metrics_port(self) -> int | None:
        """``--metrics-port``, else the fixed port the cluster file gives (None: none)."""
        if self.args.metrics_port is not None:
            return int(self.args.metrics_port)
        return self.target.metrics_port(self.service, self.args.node)

    def lookup_gateways(self) -> dict[str, tuple[str, int]]:
        """Name → address of every gateway the hit lookup may ask (empty: none known)."""
        if self.args.lookup_gateway:
            return lookup_gateways(self.args.lookup_gateway)
        cluster = self.target.cluster
        if cluster is None:
            return {}            # the scheduler's per-session index
        return {n.id: (cluster.spec.node_host(n), n.gateway_port)
                for n in cluster.spec.nodes if n.gateway_port}

    async def start(self, stack: contextlib.AsyncExitStack) -> tuple[Service, dict[str, Any]]:
        """Start the role (:data:`ROLES`) into ``stack``: the service and its ready info."""
        role = "engine_sim" if self.args.service == "engine_sim" else self.service
        svc, info = await ROLES[role](self, stack)
        self.watch_loop(stack)
        return svc, {**self.head(), **info}

    def watch_loop(self, stack: contextlib.AsyncExitStack) -> LoopStallWatch | None:
        """Watch this process's event loop (``[logging] loop_stall_s``; None when 0): a stall
        is logged with the stack that held the loop, a long one dumps every thread's stack to
        stderr during it (``loop_stall_dump_s``), and the stalls are counted on ``/metrics``
        (``dualpath_stat{service="event_loop"}``). Entered once the service has started: its
        start holds the loop by design (the first import of ucxx, 0.6 s here, must follow the
        UCX environment the transport sets), and the stop that closes the stack ends it first.

        Why in every service: a node whose loop stands still misses its heartbeats and the
        scheduler drops it (stop 54's lost lease of a DE loader, whose log said nothing of
        why); the heartbeat counters say *that* the process did not run, the stack *what*
        held it."""
        logging = self.target.cfg.logging
        if not logging.loop_stall_s:
            return None
        watch = stack.enter_context(watching(
            logging.loop_stall_s, dump_to=sys.stderr.fileno() if logging.loop_stall_dump_s
            else None, dump_after_s=logging.loop_stall_dump_s))
        export_source(stack, "event_loop", self.args.node or "scheduler", watch.stats)
        return watch


Started = tuple[Service, dict[str, Any]]


async def _scheduler(s: Serving, stack: contextlib.AsyncExitStack) -> Started:
    from services.scheduler.app import serve_scheduler
    return await serve_scheduler(stack, s.target.config("scheduler", None), s.lookup_gateways(),
                                 port=s.args.port, replica=s.args.node,
                                 metrics_port=s.metrics_port())


async def _gateway(s: Serving, stack: contextlib.AsyncExitStack) -> Started:
    from storage_gateway.app import serve_gateway
    node = _need(s.args.node, "gateway")
    cfg = s.target.config("gateway", node)
    port = s.args.port
    if port is None:
        cluster = s.target.cluster
        port = cluster.spec.node(node).gateway_port if cluster is not None else 0
    register = None
    if cfg.etcd.endpoints:          # the etcd client is loaded in etcd mode only
        from services.node.registration import etcd_registration
        register = etcd_registration(cfg)
    return await serve_gateway(stack, cfg, node, port=port, register=register,
                               metrics_port=s.metrics_port())


async def _node(s: Serving, stack: contextlib.AsyncExitStack) -> Started:
    a, service = s.args, s.service
    node = _need(a.node, service)
    cfg = s.target.config(service, node, scheduler=_hostport(a.scheduler, "--scheduler"),
                          gateway_port=a.gateway_port)
    if a.port is not None:
        cfg = _with_section(cfg, service, rpc_port=a.port)
    if a.engine_socket is not None:
        cfg = _with_section(cfg, service, engine_socket=a.engine_socket)
    attach = None
    if not a.no_engines and not getattr(cfg, service).engine_socket:
        engine_cfg = cfg.engine_sim

        async def attach(stack: contextlib.AsyncExitStack, svc: NodeBase) -> object:
            from .emulated import attach_engines        # the emulator: loaded only here
            return await attach_engines(stack, svc, engine_cfg)
    if service == "pe_receiver":
        from services.pe_receiver import app as pe_app
        return await pe_app.serve(stack, cfg, node, engines=a.engines, attach=attach,
                                  metrics_port=s.metrics_port())
    from services.de_loader import app as de_app
    return await de_app.serve(stack, cfg, node, engines=a.engines, attach=attach,
                              metrics_port=s.metrics_port())


async def _engine_sim(s: Serving, stack: contextlib.AsyncExitStack) -> Started:
    """The node's emulated engines in this process, attached over its engine socket."""
    from common.kv import spec_from_config
    from common.metrics import export_source, serve_metrics
    from tools.engine_sim.remote_host import RemoteEngineHost
    a, service = s.args, s.service
    node = _need(a.node, "engine_sim")
    cfg = s.target.config(service, node)
    settings = getattr(cfg, service)
    path = a.engine_socket or settings.engine_socket
    if not path:
        raise ConfigError(f"serve engine_sim: node {node} has no engine_socket; set "
                          f"[{service}] engine_socket (or [cluster] remote_engines) or "
                          f"pass --engine-socket")
    n = a.engines if a.engines is not None else settings.engines
    host = RemoteEngineHost(path, [f"{node}.e{i}" for i in range(n)],
                            "prefill" if service == "pe_receiver" else "decode",
                            spec_from_config(cfg.kv), cfg.engine_sim)
    await stack.enter_async_context(host)
    info: dict[str, Any] = {"service": "engine_sim", "host": settings.host, "rpc_port": None,
                            "engines": host.engine_ids, "engine_socket": path}
    export_source(stack, "engine_sim", node, host.counters)
    info["metrics_port"] = await serve_metrics(stack, s.metrics_port(),
                                               settings.host or s.target.cfg.rpc.host)
    return host, info


# role → how it starts: each one a composition root (engine_sim: the tools' own emulator)
ROLES: dict[str, Callable[[Serving, contextlib.AsyncExitStack], Awaitable[Started]]] = {
    "scheduler": _scheduler,
    "gateway": _gateway,
    "pe_receiver": _node,
    "de_loader": _node,
    "engine_sim": _engine_sim,
}


# --------------------------------------------------------------------------- entry

def _prepare(args: argparse.Namespace) -> Serving:
    """Everything checkable before the loop starts (a ConfigError here is exit status 2)."""
    target = load_target(args.config, args.mode)
    serving = Serving(target, args)
    if args.lookup_gateway:
        lookup_gateways(args.lookup_gateway)                        # a bad address → 2
    if serving.service != "scheduler":
        node = _need(args.node, serving.service)
        if target.cluster is not None:
            service_config(target.cluster, serving.service, node)   # wrong role / node → 2
    if target.cluster is not None and args.service != "engine_sim":
        from .host_checks import check_service_host, check_storage_root
        check_service_host(target.cluster, serving.service, args.node)   # not this host → 2
        if serving.service == "gateway":
            check_storage_root(target.cluster, serving.target.config("gateway", args.node)
                               .gateway.root)                           # not mounted → 2
    return serving


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from common.faults import check_env
        armed = check_env()              # a bad DUALPATH_FAILPOINTS exits 2 before starting
        serving = _prepare(args)
    except DualpathError as e:
        print(f"dualpath serve: {e.message}", file=sys.stderr)
        return 2
    cfg = serving.target.cfg
    configure_logging(cfg.logging.level, cfg.logging.json)
    if armed:
        print(f"dualpath serve {args.service}: failpoints armed: {armed}", file=sys.stderr)
    return run_cli(f"dualpath serve {serving.service}",
                   serve_process(serving.start, args.ready_file), use_uvloop=cfg.rpc.use_uvloop)


if __name__ == "__main__":
    sys.exit(main())
