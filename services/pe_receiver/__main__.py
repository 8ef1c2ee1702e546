"""``python -m services.pe_receiver -c config.toml --node p0 [--engines g] [--port P]``.

Runs one prefill node: the PE receiver (PE buffer, UCX, registration with the scheduler at
``[pe_receiver] scheduler_host/port``) with ``g`` emulated prefill engines attached through
the in-process engine API. Once serving it prints one JSON line —
``{"event": "pe_receiver_ready", "node_id", "rpc_port", "ucx_port", "pid"}`` — and stops in
order on SIGTERM/SIGINT (engines first, then the service).
"""

from __future__ import annotations

import sys

from tools.cluster.node_runner import main_for

if __name__ == "__main__":
    sys.exit(main_for("pe_receiver", sys.argv[1:]))
