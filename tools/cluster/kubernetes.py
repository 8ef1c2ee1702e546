"""Kubernetes manifests rendered from a cluster TOML (docs/kubernetes.md).

``python -m tools.cluster.kubernetes -c deploy/kubernetes/cluster.toml -o deploy/kubernetes/dualpath.yaml``

Plain Python instead of a Helm chart or a kustomize base: the cluster file already *is* the
deployment's single source (nodes, roles, ports, links), CI is offline except for package
registries (no helm/kustomize binaries), and a renderer in the repo can be tested like any
other code (``tests/test_kubernetes.py``: names and ports against the cluster file, every
object against the Kubernetes schemas with ``kubernetes-validate``). What it renders:

* a ConfigMap with the cluster file, its hosts rewritten to the pods' stable DNS names;
* etcd (a 3-member StatefulSet) unless the file's ``[etcd] endpoints`` name an external one;
* the scheduler replicas (a StatefulSet; each binds its pod IP, the leader is elected in etcd);
* one StatefulSet (one pod) per node: gateway + PE receiver / DE loader (+ an ``engine_sim``
  container with ``remote_engines``, or with ``--vllm`` a real vLLM and the OpenAI front:
  :mod:`tools.cluster.kubernetes_vllm`), sharing the pod's ``/dev/shm`` (a memory emptyDir);
* headless Services (stable names, ``publishNotReadyAddresses``: a service resolves its own
  name at start, before it is ready), readiness/liveness = the Ping probe
  (``tools.cluster.health``), PodDisruptionBudgets;
* Prometheus (scraping every service's fixed metrics port) and Grafana provisioned with the
  operations dashboard (:mod:`tools.cluster.observability`).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import tomli_w

from common.config import PositiveInt, Section
from common.errors import ConfigError, DualpathError

from .config import Cluster, load_cluster
from .observability import load_dashboard, metrics_targets, prometheus_config

APP = "dualpath"
CONF_DIR = "/etc/dualpath"
STORAGE_MOUNT = "/data/storage"
STATE_MOUNT = "/var/lib/dualpath"
ETCD_PORT = 2379


class KubeOptions(Section, frozen=True):
    """Choices a cluster file does not hold (flags of the render command)."""

    namespace: str = "dualpath"
    image: str = "dualpath:latest"               # the repo's Dockerfile
    cluster_domain: str = "cluster.local"
    scheduler_replicas: PositiveInt = 2
    etcd_image: str = "quay.io/coreos/etcd:v3.5.17"
    etcd_members: PositiveInt = 3
    storage_claim: str = "dualpath-kvstore"      # ReadWriteMany PVC (CephFS, NFS, 3FS CSI …)
    host_network: bool = False                   # RoCE/IB NICs outside the pod network
    rdma_resource: str = ""                      # e.g. "rdma/hca_shared_devices_a" (plugin)
    hugepages_2mi: str = ""                      # e.g. "2Gi": hugepage-backed UCX bounce buffers
    shm_size: str = "2Gi"                        # the pod's /dev/shm (buffers + engine IPC)
    prometheus_image: str = "prom/prometheus:v2.53.2"
    grafana_image: str = "grafana/grafana:11.2.0"
    rpc_secret: str = "dualpath-rpc"             # Secret with the [rpc] TLS / auth files
    vllm: bool = False                           # real engines: vLLM per node + the front
    vllm_image: str = "dualpath-vllm:latest"     # the Dockerfile with WITH_VLLM=1


def meta(name: str, opts: KubeOptions, component: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": opts.namespace,
            "labels": {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component},
            **extra}


def selector(component: str, node: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}
    if node is not None:
        out["dualpath/node"] = node
    return out


# --------------------------------------------------------------------------- names

def node_pod(node_id: str) -> str:
    """The pod of node ``node_id`` (StatefulSet ``dualpath-<id>``, ordinal 0)."""
    return f"{APP}-{node_id.lower().replace('_', '-').replace('.', '-')}-0"


def node_host(node_id: str, opts: KubeOptions) -> str:
    """The stable DNS name a node's services bind to and advertise (headless ``dualpath-nodes``)."""
    return f"{node_pod(node_id)}.{APP}-nodes.{opts.namespace}.svc.{opts.cluster_domain}"


def service_host(name: str, opts: KubeOptions) -> str:
    return f"{name}.{opts.namespace}.svc.{opts.cluster_domain}"


def etcd_endpoints(cluster: Cluster, opts: KubeOptions) -> list[str]:
    """The file's external etcd, or the members of the rendered StatefulSet."""
    external = list(cluster.cfg.etcd.endpoints)
    if external:
        return external
    return [f"{APP}-etcd-{i}.{APP}-etcd.{opts.namespace}.svc.{opts.cluster_domain}:{ETCD_PORT}"
            for i in range(opts.etcd_members)]


# --------------------------------------------------------------------------- config

def cluster_toml(cluster: Cluster, opts: KubeOptions) -> str:
    """The cluster file as the pods read it: stable names, mounted storage, etcd endpoints."""
    data = copy.deepcopy(cluster.data)
    c = data.setdefault("cluster", {})
    c["scheduler_host"] = service_host(f"{APP}-scheduler", opts)   # each pod: its IP (env)
    c["data_dir"] = STATE_MOUNT
    c["storage_root"] = STORAGE_MOUNT
    for n in c.get("nodes", []):
        n["host"] = node_host(n["id"], opts)
    data.setdefault("etcd", {})["endpoints"] = etcd_endpoints(cluster, opts)
    return tomli_w.dumps(data)


def require_fixed_ports(cluster: Cluster) -> None:
    """Every port a pod serves must be fixed in the file (probes, Services, scrape targets)."""
    c = cluster.spec
    missing = [] if c.scheduler_port else ["cluster.scheduler_port"]
    for i, n in enumerate(c.nodes):
        missing += [f"cluster.nodes[{i}].{f} ({n.id})" for f in ("gateway_port", "rpc_port")
                    if not getattr(n, f)]
    if missing:
        raise ConfigError(f"{cluster.source}: Kubernetes needs fixed ports; 0 (any free port) "
                          f"in {', '.join(missing)}")
    metrics_targets(cluster)     # every metrics port fixed too (raises naming the missing ones)


# --------------------------------------------------------------------------- rendering

def render(cluster: Cluster, opts: KubeOptions | None = None) -> list[dict[str, Any]]:
    """Every object, in apply order."""
    from . import kubernetes_pods as pods
    from . import kubernetes_vllm

    opts = opts or KubeOptions()
    require_fixed_ports(cluster)
    if opts.vllm:
        kubernetes_vllm.check(cluster)
    objs: list[dict[str, Any]] = [config_map(cluster, opts)]
    if not cluster.cfg.etcd.endpoints:
        objs += pods.etcd(opts)
    objs += pods.scheduler(cluster, opts)
    objs += pods.nodes_service(cluster, opts)
    for n in cluster.spec.nodes:
        objs.append(pods.node_statefulset(cluster, n, opts))
    objs.append(pods.pdb("nodes", selector("node"), opts, max_unavailable=1))
    if opts.vllm:
        objs += kubernetes_vllm.front(cluster, opts)
    objs += monitoring(cluster, opts)
    return objs


def config_map(cluster: Cluster, opts: KubeOptions) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": meta(f"{APP}-config", opts, "config"),
            "data": {"cluster.toml": cluster_toml(cluster, opts)}}


def scrape_config(cluster: Cluster, opts: KubeOptions) -> dict[str, Any]:
    """Prometheus's config: every service by its stable name and fixed metrics port."""
    def host(service: str, node: str | None) -> str:
        if node is None:
            return service_host(f"{APP}-scheduler", opts)
        return node_host(node, opts)
    groups = metrics_targets(cluster, host)
    # the scheduler replicas: scrape each pod (only the leader has requests to report)
    sched = next(g for g in groups if g["labels"]["dualpath_service"] == "scheduler")
    port = sched["targets"][0].rsplit(":", 1)[1]
    sched["targets"] = [f"{APP}-scheduler-{i}.{service_host(APP + '-scheduler', opts)}:{port}"
                        for i in range(opts.scheduler_replicas)]
    return prometheus_config(groups, interval_s=5.0)


def monitoring(cluster: Cluster, opts: KubeOptions) -> list[dict[str, Any]]:
    """Prometheus + Grafana with the operations dashboard provisioned from ConfigMaps."""
    from . import kubernetes_pods as pods

    prom_url = f"http://{service_host(APP + '-prometheus', opts)}:9090"
    datasource = {"apiVersion": 1, "datasources": [
        {"name": "Prometheus", "type": "prometheus", "uid": "prometheus", "access": "proxy",
         "url": prom_url, "isDefault": True}]}
    provider = {"apiVersion": 1, "providers": [
        {"name": APP, "type": "file", "folder": APP,
         "options": {"path": "/var/lib/grafana/dashboards"}}]}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": meta(f"{APP}-prometheus", opts, "monitoring"),
         "data": {"prometheus.yml": json.dumps(scrape_config(cluster, opts), indent=2)}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         # the grafana Helm chart's dashboard sidecar also picks this label up
         "metadata": meta(f"{APP}-grafana-dashboards", opts, "monitoring",
                          annotations={"dualpath/dashboard": "dualpath-operations"}),
         "data": {"dualpath-operations.json": json.dumps(load_dashboard(), indent=2)}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": meta(f"{APP}-grafana-provisioning", opts, "monitoring"),
         "data": {"datasource.yaml": json.dumps(datasource, indent=2),
                  "dashboards.yaml": json.dumps(provider, indent=2)}},
        *pods.prometheus(opts), *pods.grafana(opts)]


def to_yaml(objs: list[dict[str, Any]]) -> str:
    import yaml

    head = ("# Rendered by `python -m tools.cluster.kubernetes` from a cluster TOML — do not edit;\n"
            "# edit the TOML (or the flags) and render again (docs/kubernetes.md).\n")
    class Dumper(yaml.SafeDumper):
        """Multi-line strings (the files inside ConfigMaps) as readable ``|`` blocks."""

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    Dumper.ignore_aliases = lambda self, data: True      # repeated dicts written out, no &id
    return head + "".join("---\n" + yaml.dump(o, Dumper=Dumper, sort_keys=False, width=100)
                          for o in objs)


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cluster.kubernetes",
                                description="render Kubernetes manifests from a cluster TOML")
    p.add_argument("-c", "--config", required=True, help="cluster TOML (fixed ports)")
    p.add_argument("-o", "--out", default="-", help="output YAML file ('-': stdout)")
    for field in msgspec.structs.fields(KubeOptions):
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool:
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, default=None)
    args = p.parse_args(argv)
    given = {f: v for f, v in vars(args).items() if f not in ("config", "out") and v not in
             (None, False)}
    try:
        opts = msgspec.convert(given, KubeOptions, strict=False)
        text = to_yaml(render(load_cluster(args.config), opts))
    except msgspec.ValidationError as e:
        print(f"kubernetes: {e}", file=sys.stderr)
        return 2
    except DualpathError as e:
        print(f"kubernetes: {e.message}", file=sys.stderr)
        return 2
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
