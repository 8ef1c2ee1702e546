"""The cluster layer: one TOML file describes a whole PD cluster; this package starts it.

* :mod:`tools.cluster.config` — the cluster config schema (``[cluster]`` + nodes on top of
  every service section), validation, ablation modes, per-service config rendering.
* :mod:`tools.cluster.launcher` — ``dualpath cluster up/down/status``: every service as a
  subprocess on loopback, health-checked, pids and ports in a state file.
* :mod:`tools.cluster.serve` — ``dualpath serve <service> -c cfg --node ID``: the one process
  shell of every service (launcher, systemd units, docker-compose, scripts); it renders the
  service's config and dispatches to the service's own composition root (``*/app.py``).
* :mod:`tools.cluster.inprocess` — the one in-process cluster: :func:`start_cluster` (a cluster
  file in one event loop, optionally with stub nodes) and :func:`local_datapath` (small, ad hoc).
* :mod:`tools.cluster.emulated` — emulated engines attached to a node service (both of the above).
"""
