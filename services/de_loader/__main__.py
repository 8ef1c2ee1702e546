"""``python -m services.de_loader -c config.toml --node d0 [--engines g] [--port P]``.

Runs one decode node: the DE loader (DE buffer, data-path channel on ``--port``, UCX,
registration with the scheduler at ``[de_loader] scheduler_host/port``, write-back to the
gateway at ``[de_loader] gateway_host/port``) with ``g`` emulated decode engines attached.
Prints ``{"event": "de_loader_ready", "node_id", "rpc_port", "ucx_port", "pid"}`` once serving.
"""

from __future__ import annotations

import sys

from tools.cluster.node_runner import main_for

if __name__ == "__main__":
    sys.exit(main_for("de_loader", sys.argv[1:]))
