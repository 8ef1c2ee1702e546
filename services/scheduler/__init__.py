"""The central scheduler (paper §6): a sans-I/O placement core and the live service around it.

The sub-packages state the parts; this package itself imports nothing, so importing one part
never loads another:

* ``core`` — the sans-I/O placement core (``core.scheduler.Scheduler``: DE two-phase placement, PE
  Algorithm 1, read side), its rules (``policy``), mutable state (``state``), inputs and outputs
  (``records``), constants (``config.SchedulerConfig``) and the ablation-mode table (``modes``).
  It imports neither asyncio nor ucxx, reads no clock and touches no network, so the live
  service, the tests and the discrete-event simulator run exactly the same decisions (``sim``
  compiles parts of it with mypyc: ``sim.accel``).
* ``shell`` — the asyncio service (``shell.service.SchedulerService``) that puts the core behind
  one RPC port: the request table, the frontend and node channels, leases, outboxes, long-poll,
  hit lookup, kept results.
* ``client`` — the public seam other packages use: ``client.client`` (frontends) and
  ``client.node_client`` (node services), ``client.leader`` (the etcd leader's address, for
  both) and ``client.resubmit`` (the frontend stream that reconnects and resubmits across a
  scheduler restart).
* ``app`` — the composition root: a typed config in, a running scheduler out (election, the
  leader's watch, hit lookup, metrics); what ``dualpath serve scheduler`` and the in-process
  cluster run.
* ``etcd`` — leader election with fencing epochs, node discovery and the leader's watch of it
  (``[etcd] endpoints``).
* ``service_config`` — the ``[scheduler_service]`` and ``[etcd]`` sections (the placement
  constants, ``[scheduler]``, are the core's ``config``).

The prefill batcher and the cost model the simulator and the engine emulator share live in
``services.compute_model``; the scheduler's core reads the cost model for its PE load unit.
"""
