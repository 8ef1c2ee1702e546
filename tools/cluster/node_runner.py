"""Process entry shared by ``python -m services.pe_receiver`` and ``python -m services.de_loader``:
a node service with its emulated engines attached (the in-process engine API)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from tools.config import DualpathConfig, load_host_config
from common.errors import DualpathError
from common.logging import configure_logging
from common.service import run_cli


def _parser(kind: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"dualpath {kind}",
                                description=f"run one node's {kind} with emulated engines")
    p.add_argument("-c", "--config", default=None, help="TOML config (default: embedded defaults)")
    p.add_argument("--node", default="local", help="node id")
    p.add_argument("--engines", type=int, default=None,
                   help=f"emulated engines on this node (default: [{kind}] engines)")
    p.add_argument("--port", type=int, default=None, help="control RPC port (0: any free port)")
    p.add_argument("--no-engines", action="store_true",
                   help="attach no emulated engines (a real engine embeds the API instead)")
    return p


def build(kind: str, cfg: DualpathConfig, node: str, engines: int | None):
    if kind == "pe_receiver":
        from services.pe_receiver.service import PEReceiverService
        return PEReceiverService(cfg, node, engines=engines)
    from services.de_loader.service import DELoaderService
    return DELoaderService(cfg, node, engines=engines)


async def serve(kind: str, cfg: DualpathConfig, args: argparse.Namespace) -> None:
    from tools.engine_sim.engines import EngineHost

    svc = build(kind, cfg, args.node, args.engines)
    host = EngineHost(svc, cfg.engine_sim)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await svc.start()
    try:
        if not args.no_engines:
            await host.start()
            svc.extra_stats = host.counters
        print(json.dumps({"event": f"{kind}_ready", "node_id": args.node,
                          "rpc_port": svc.rpc_port, "ucx_port": svc.ucx_address[1],
                          "engines": svc.engine_ids, "pid": os.getpid()}), flush=True)
        waiter = asyncio.ensure_future(svc.wait_stopped())
        await asyncio.wait([waiter, asyncio.ensure_future(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        await host.stop()
        await svc.stop()


def main_for(kind: str, argv: list[str] | None = None) -> int:
    args = _parser(kind).parse_args(argv)
    try:
        cfg = load_host_config(args.config)
        if args.port is not None:
            import msgspec
            section = getattr(cfg, kind)
            cfg = msgspec.structs.replace(cfg, **{kind: msgspec.structs.replace(
                section, rpc_port=args.port)})
    except DualpathError as e:
        print(f"dualpath {kind}: {e.message}", file=sys.stderr)
        return 2
    configure_logging(cfg.logging.level, cfg.logging.json)
    return run_cli(f"dualpath {kind}", serve(kind, cfg, args), use_uvloop=cfg.rpc.use_uvloop)


def main(argv: list[str] | None = None) -> int:
    """``dualpath serve``-style entry: first argument picks the service."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("pe_receiver", "de_loader"):
        print("usage: runner (pe_receiver|de_loader) [args]", file=sys.stderr)
        return 2
    return main_for(argv[0], argv[1:])
