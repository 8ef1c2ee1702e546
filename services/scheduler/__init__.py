"""The central scheduler's pure policy core (paper §6; digest §5) and its intra-engine batcher.

Sans-I/O: nothing here imports asyncio or ucxx, reads a clock or touches the network, so the live
service, the tests and the discrete-event simulator run exactly the same decisions.

* ``core.Scheduler`` — inter-engine placement: DE two-phase placement, PE Algorithm 1, read side;
  the request flow and how a service or a simulator drives it are in ``core``'s docstring.
* ``policy`` — the individual rules as small functions; ``state`` — the mutable state they use.
* ``config.SchedulerConfig`` — α, β, Z factor and the ablation switches.
* ``batching.PrefillBatcher`` — FIFO forward batches under a 300 ms attention quota with
  binary-searched chunked prefill; ``cost_model`` — FLOPs → seconds per model preset.
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
