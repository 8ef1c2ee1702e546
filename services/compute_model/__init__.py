"""What prefill and decode cost, and how an engine batches prefill under it: shared below the
scheduler (its PE load unit), the simulator (``sim``) and the engine emulator
(``tools.engine_sim``), which all need the same numbers.

* ``cost_model`` — FLOPs → seconds per model preset (``cost_model(name)``), and
  ``PrefillLoad``, the scheduler's cost-weighted PE load;
* ``batching.PrefillBatcher`` — FIFO forward batches under a 300 ms attention quota with
  binary-searched chunked prefill (compiled with mypyc for the simulator: ``sim.accel``).

Sans-I/O: no asyncio, no clock, no network.
"""
