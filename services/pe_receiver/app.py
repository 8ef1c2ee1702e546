"""The PE receiver's composition root: a typed config in, a running, announced service out.

``app.start`` is the service of one node with its engines attached (the caller's ``attach``:
engines are not this package's), what the in-process cluster runs; ``app.serve`` is the whole
process: that, plus etcd registration, exported stats and the ``/metrics`` endpoint
(:class:`services.node.app.NodeApp`, the same for both node services).
"""

from __future__ import annotations

from services.node.app import NodeApp

from .service import PEReceiverService

app = NodeApp(PEReceiverService)
build, start, serve = app.build, app.start, app.serve
