"""``python -m services.scheduler`` / ``dualpath scheduler``: run the central scheduler.

    dualpath scheduler -c configs/local-1p2d.toml --port 7700 [--host 0.0.0.0] [--port-file F]

Prints ``scheduler listening on HOST:PORT`` on stdout once bound (``--port 0`` picks a free
port; ``--port-file`` also writes it there, for launchers), then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.config import load_host_config
from common.errors import ConfigError
from common.logging import configure_logging
from common.service import Status, run_cli

from .service import SchedulerService


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath scheduler",
                                description="Run the central dualpath scheduler service.")
    p.add_argument("-c", "--config", help="TOML config (default: embedded defaults + env)")
    p.add_argument("--host", help="bind address (default: scheduler_service.host or rpc.host)")
    p.add_argument("--port", type=int, help="port (default: scheduler_service.port; 0 = any)")
    p.add_argument("--port-file", type=Path, help="write the bound port to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_host_config(args.config)
        configure_logging(cfg.logging.level, cfg.logging.json)
        service = SchedulerService(cfg, host=args.host, port=args.port,
                                   on_listening=lambda h, p: _announce(h, p, args.port_file))
    except ConfigError as e:
        print(f"dualpath scheduler: {e}", file=sys.stderr)
        return 2
    rc = run_cli("dualpath scheduler", service.serve_forever(), use_uvloop=cfg.rpc.use_uvloop)
    return 1 if rc or service.status is Status.FAILED else 0


def _announce(host: str, port: int, port_file: Path | None) -> None:
    if port_file is not None:
        tmp = port_file.with_suffix(port_file.suffix + ".tmp")
        tmp.write_text(f"{port}\n")
        tmp.replace(port_file)          # readers never see a half-written file
    print(f"scheduler listening on {host}:{port}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
