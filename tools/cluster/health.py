"""``python -m tools.cluster.health HOST:PORT``: exit 0 when the service answers a Ping.

Every dualpath service (scheduler, gateway, PE receiver, DE loader) serves ``Ping`` on its
control port; container healthchecks and scripts use this probe (no UCX, no KV spec). Its
``[rpc]`` settings come from the environment overlay like every service's, so where control
connections are authenticated it finds the secret the same way
(``DUALPATH__RPC__AUTH_SECRET_FILE`` / ``DUALPATH__RPC__AUTH_SECRET_ENV``), and where they
run over TLS its certificates (``DUALPATH__RPC__TLS_*``; the Kubernetes render sets both).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Union

import msgspec

from common.config import load_config
from tools.config import DualpathConfig
from common.errors import DualpathError
from common.logging import configure_logging
from common.protocol import ErrorReply, Ping, Pong
from common.rpc import RpcClient


async def ping(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        rpc = load_config(None, DualpathConfig).rpc
    except DualpathError as e:          # a bad DUALPATH__RPC__* overlay: say so, report down
        print(f"health: {e.message}", file=sys.stderr)
        return False
    cfg = msgspec.structs.replace(rpc, connect_timeout_s=timeout, reconnect_attempts=1)
    client = RpcClient(cfg, host, port, role="health", node_id="health",
                       reply_type=Union[Pong, ErrorReply])
    try:
        await client.call(Ping(b"health"), timeout=timeout)
        return True
    except Exception:
        return False
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or ":" not in argv[0]:
        print("usage: python -m tools.cluster.health HOST:PORT", file=sys.stderr)
        return 2
    host, _, port = argv[0].rpartition(":")
    configure_logging("error", False)
    return 0 if asyncio.run(ping(host or "127.0.0.1", int(port))) else 1


if __name__ == "__main__":
    sys.exit(main())
