"""The operations view: Prometheus scrape targets of a cluster and the Grafana dashboard's queries.

What an operator watches first (issue #17, paper §5.1/§7.4): each node's storage-NIC read
queue and bytes, and whether the scheduler keeps the PE- and DE-side storage links equally busy
(SNIC max/avg, the read-side split). One dashboard, ``deploy/grafana/dualpath-operations.json``;
the Kubernetes manifests provision it (:mod:`tools.cluster.kubernetes`) and
``tests/test_prometheus_ops.py`` runs each of its queries against a real Prometheus scraping a
local cluster. Targets come from the cluster file's fixed metrics ports
(``[cluster] scheduler_metrics_port``, ``nodes[].metrics_port`` / ``gateway_metrics_port``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.errors import ConfigError

from .config import ROLE_SERVICE, Cluster

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dualpath-operations.json"
JOB = "dualpath"


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    """The Grafana dashboard (a JSON model Grafana's file provisioning reads as is)."""
    return json.loads(path.read_text())


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` of every target of every panel."""
    out = []
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            out.append((panel.get("title", "?"), target["expr"]))
    return out


ENGINE_FAMILY_PREFIX = "dualpath_engine_"
"""The vLLM connector's families (``common.metrics.CONNECTOR_FAMILIES``): on the vLLM
instances' own ``/metrics``, so only a cluster with a real engine has data for them."""


def engine_queries(queries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The dashboard queries that read the vLLM connector's families (no data on an emulated
    cluster: it has no vLLM instance to scrape)."""
    return [(title, e) for title, e in queries if ENGINE_FAMILY_PREFIX in e]


def metrics_targets(cluster: Cluster, host_of: Callable[[str, str | None], str] | None = None
                    ) -> list[dict[str, Any]]:
    """One scrape target per service with a metrics port: ``{targets, labels}`` groups.

    ``host_of(service, node_id)`` gives the address Prometheus dials (default: the file's
    hosts). A service without a fixed metrics port is an error: Prometheus needs it fixed.
    """
    c = cluster.spec
    def host(service: str, node: str | None) -> str:
        if host_of is not None:
            return host_of(service, node)
        return c.service_host(service, node)
    wanted: list[tuple[str, str | None]] = [("scheduler", None)]
    for n in c.nodes:
        wanted += [("gateway", n.id), (ROLE_SERVICE[n.role], n.id)]
    groups, missing = [], []
    for service, node in wanted:
        port = c.metrics_port(service, node)
        if not port:
            missing.append(f"{service}{'' if node is None else ':' + node}")
            continue
        labels = {"dualpath_service": service, **_node_labels(c, node)}
        groups.append({"targets": [f"{host(service, node)}:{port}"], "labels": labels})
    if missing:
        raise ConfigError(f"{cluster.source}: no fixed metrics port for {', '.join(missing)} — "
                          "set cluster.scheduler_metrics_port and every node's metrics_port and "
                          "gateway_metrics_port")
    return groups


def prometheus_config(groups: list[dict[str, Any]], interval_s: float = 5.0) -> dict[str, Any]:
    """A ``prometheus.yml`` (as a dict) scraping ``groups`` every ``interval_s``."""
    every = f"{max(1, round(interval_s * 1000))}ms"
    return {"global": {"scrape_interval": every, "evaluation_interval": every},
            "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics",
                                "static_configs": groups}]}


def _node_labels(c: Any, node: str | None) -> dict[str, str]:
    # target labels (``node`` and ``service`` are taken by the metrics' own labels): the role
    # lets a query split storage bandwidth into the PE side and the DE side
    if node is None:
        return {}
    return {"node_id": node, "role": c.node(node).role}
