"""The scheduler service: the sans-I/O core behind one RPC port (``service.SchedulerService``).

The service is a composition; each part is an object handed its collaborators:
``table.RequestTable`` (live requests, timers, outcomes; status derived from the core's phase),
``lifecycle.RequestLifecycle`` (end, re-plan, finish), ``frontend_channel.FrontendChannel``,
``node_channel.NodeChannel`` and ``progress.ProgressReports`` (the RPC handlers),
``dispatch.Outboxes`` (per-group decisions awaiting a fetch), ``leases.LeaseTable``,
``longpoll.WorkSignal``, ``hit_lookup``, ``recovery.KeptResults``,
``stored_prefix.PromisedPrefixes`` and ``gate.Gate`` (fencing epoch, closing). Only
``service`` is meant to be imported from outside (by whoever assembles a scheduler process).
"""
