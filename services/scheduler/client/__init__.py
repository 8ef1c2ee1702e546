"""The scheduler's public seam: the only modules other packages import to talk to it.

``client.SchedulerClient`` / ``SyncSchedulerClient`` for frontends (submit, follow events,
cancel, status), ``node_client.NodeSession`` for node services (register, heartbeat, fetch
work, report progress), ``resubmit.ResubmittingStream`` (the frontend's stream that reconnects
and resubmits across a scheduler restart). They speak ``common.protocol`` over ``common.rpc``
and import nothing else of the scheduler. Sequence and messages: docs/frontend-api.md.
"""
