"""The scheduler's etcd side (``[etcd] endpoints``): leader election with fencing epochs and
leader discovery (``election``), node registration (``discovery``) and the leader's live view of
the registered nodes (``discovery_watch``). Without endpoints none of it runs: the scheduler has
one static address. docs/cluster.md, "etcd".
"""
