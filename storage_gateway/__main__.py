"""``dualpath gateway -c config.toml --node n0 --port 7400``: run one node's storage gateway.

Once serving, prints one JSON line to stdout — ``{"event": "gateway_ready", "node_id", "rpc_port",
"ucx_port", "pid"}`` — so scripts and tests started with ``--port 0`` learn the ports. Stops in
order on SIGTERM/SIGINT. Config: ``[gateway]``, ``[gateway_service]`` and the shared sections
(``common.config``), environment overlay ``DUALPATH__GATEWAY__ROOT=...`` on top.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from common.config import load_config
from common.errors import DualpathError
from common.logging import configure_logging
from common.service import run_cli
from storage_gateway.service import GatewayNodeConfig, GatewayService


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath gateway", description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default=None, help="TOML config (default: embedded defaults)")
    p.add_argument("--node", default="local", help="node id of this gateway")
    p.add_argument("--port", type=int, default=0, help="RPC port (0: any free port)")
    return p


async def serve(cfg: GatewayNodeConfig, node_id: str, port: int) -> None:
    service = GatewayService(cfg, node_id, rpc_port=port)
    await service.start()
    print(json.dumps({"event": "gateway_ready", "node_id": node_id, "rpc_port": service.rpc_port,
                      "ucx_port": service.ucx_address[1], "pid": os.getpid()}), flush=True)
    await service.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, GatewayNodeConfig)
    except DualpathError as e:
        print(f"dualpath gateway: {e.message}", file=sys.stderr)
        return 2
    configure_logging(cfg.logging.level, cfg.logging.json)
    return run_cli("dualpath gateway", serve(cfg, args.node, args.port),
                   use_uvloop=cfg.rpc.use_uvloop)


if __name__ == "__main__":
    sys.exit(main())
