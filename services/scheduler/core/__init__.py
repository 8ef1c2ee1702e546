"""The scheduler's sans-I/O core: placement decisions from events, nothing else.

``scheduler.Scheduler`` (how a service or a simulator drives it: that module's docstring),
``policy`` (the individual rules as small functions), ``state`` (the mutable state they use),
``records`` (inputs and outputs as frozen Structs), ``config.SchedulerConfig`` (α, β, Z and the
ablation switches) and ``modes`` (the ablation-mode table the simulator and the cluster read).
Nothing here imports asyncio, ucxx, the RPC layer or ``tools`` (import-linter's
``sans-io-cores`` contract and ``tests/test_layering.py``); ``scheduler``, ``policy`` and
``state`` are compiled with mypyc for the simulator (``sim.accel``).
Importing this package loads none of them: a process that only needs a section type
(``config``) does not pay for the placement code."""
