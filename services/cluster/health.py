"""``python -m services.cluster.health HOST:PORT``: exit 0 when the service answers a Ping.

Every dualpath service (scheduler, gateway, PE receiver, DE loader) serves ``Ping`` on its
control port; container healthchecks and scripts use this probe (no UCX, no KV spec). Where
control connections are authenticated, the probe finds the secret the way the services do, from
``DUALPATH__RPC__AUTH_SECRET_FILE`` / ``DUALPATH__RPC__AUTH_SECRET_ENV`` in its environment.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Union

from common.config import RpcConfig
from common.logging import configure_logging
from common.protocol import ErrorReply, Ping, Pong
from common.rpc import RpcClient


async def ping(host: str, port: int, timeout: float = 2.0) -> bool:
    cfg = RpcConfig(connect_timeout_s=timeout, reconnect_attempts=1,
                    auth_secret_file=os.environ.get("DUALPATH__RPC__AUTH_SECRET_FILE") or None,
                    auth_secret_env=os.environ.get("DUALPATH__RPC__AUTH_SECRET_ENV") or None)
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
        print("usage: python -m services.cluster.health HOST:PORT", file=sys.stderr)
        return 2
    host, _, port = argv[0].rpartition(":")
    configure_logging("error", False)
    return 0 if asyncio.run(ping(host or "127.0.0.1", int(port))) else 1


if __name__ == "__main__":
    sys.exit(main())
