"""The scheduler's sans-I/O core: placement decisions from events, nothing else.

``scheduler.Scheduler`` (how a service or a simulator drives it: that module's docstring),
``policy`` (the individual rules as small functions), ``state`` (the mutable state they use),
``records`` (inputs and outputs as frozen Structs), ``config.SchedulerConfig`` (α, β, Z and the
ablation switches) and ``modes`` (the ablation-mode table the simulator and the cluster read).
Nothing here imports asyncio, ucxx, the RPC layer or ``tools`` (import-linter's
``sans-io-cores`` contract and ``tests/test_layering.py``); ``scheduler``, ``policy`` and
``state`` are compiled with mypyc for the simulator (``sim.accel``).
"""

from .config import SchedulerConfig
from .records import (Assignment, DEBinding, EngineReport, EngineSpec, Phase, ReadSide,
                      ReplanResult, Request, Role, Telemetry)
from .scheduler import Scheduler

__all__ = [
    "Assignment", "DEBinding", "EngineReport", "EngineSpec", "Phase", "ReadSide",
    "ReplanResult", "Request", "Role", "Scheduler", "SchedulerConfig", "Telemetry",
]
