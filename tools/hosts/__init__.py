"""Hosts as namespaces (issue #17): ``netns`` makes the hosts, ``cluster`` runs a 1P2D cluster
on them the bare-metal way (docs/deploy.md, deploy/systemd), ``ucx_lanes`` reads UCX's own
transport choice from the services' logs."""
