"""The cluster layer: one TOML file describes a whole PD cluster; this package starts it.

* :mod:`tools.cluster.config` — the cluster config schema (``[cluster]`` + nodes on top of
  every service section), validation, ablation modes, per-service config rendering.
* :mod:`tools.cluster.launcher` — ``dualpath cluster up/down/status``: every service as a
  subprocess on loopback, health-checked, pids and ports in a state file.
* :mod:`tools.cluster.serve` — ``dualpath serve <service> -c cfg --node ID``: one service
  (what the launcher, systemd units and docker-compose run).
* :mod:`tools.cluster.inprocess` — :func:`start_cluster`, the same cluster in one event loop
  (tests), optionally with stub nodes instead of the data path.
"""
