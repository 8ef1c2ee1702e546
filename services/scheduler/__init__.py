"""The central scheduler (paper §6): a pure policy core, its intra-engine batcher,
and the live service that runs them behind one RPC port.

Sans-I/O core — what this package exports. ``core``, ``policy``, ``state``, ``records``,
``config``, ``batching`` and ``cost_model`` (with the service's pure helpers ``leases``,
``modes``, ``recovery``, ``stored_prefix`` and ``service_config``) import neither asyncio nor
ucxx, read no clock and touch no network, so the live service, the tests and the
discrete-event simulator run exactly the same decisions (``core``, ``policy``, ``state`` and
``batching`` are compiled with mypyc for the simulator: ``sim.accel``). Importing
``services.scheduler`` pulls in no asyncio. ``dispatch`` (the per-group outboxes) awaits
nothing and reads no clock either, but it works on the shell's ``request_state.RequestState``
(which holds each request's asyncio event queue), so importing it loads asyncio: it is part of
the service, not of the core.

* ``core.Scheduler`` — inter-engine placement: DE two-phase placement, PE Algorithm 1, read side;
  the request flow and how a service or a simulator drives it are in ``core``'s docstring.
* ``policy`` — the individual rules as small functions; ``state`` — the mutable state they use.
* ``config.SchedulerConfig`` — α, β, Z factor and the ablation switches.
* ``batching.PrefillBatcher`` — FIFO forward batches under a 300 ms attention quota with
  binary-searched chunked prefill; ``cost_model`` — FLOPs → seconds per model preset.

Service (asyncio), imported by name only: ``service.SchedulerService`` (the shell; its node
channel handlers in ``node_channel``, per-request state in ``request_state``, held fetches in
``longpoll``, hit lookups in ``hit_lookup``); ``client`` (frontends) and ``node_client`` (node services) are the client
modules other packages talk to it through (``resubmit``: the client's stream that reconnects and
resubmits across a scheduler restart); ``election`` — leader election, fencing epochs and
leader discovery through etcd (``[etcd] endpoints``); ``stub_nodes`` are stand-in group
leaders for tests and tools.
"""

from .batching import BatchItem, ForwardBatch, PrefillBatcher, max_chunk, plan_batch
from .config import SchedulerConfig
from .core import Scheduler
from .cost_model import ModelCost, cost_model
from .records import (Assignment, DEBinding, EngineReport, EngineSpec, Phase, ReadSide,
                      ReplanResult, Request, Role, Telemetry)

__all__ = [
    "Assignment", "BatchItem", "DEBinding", "EngineReport", "EngineSpec", "ForwardBatch",
    "ModelCost", "Phase", "PrefillBatcher", "ReadSide", "ReplanResult", "Request", "Role",
    "Scheduler", "SchedulerConfig", "Telemetry", "cost_model", "max_chunk", "plan_batch",
]
