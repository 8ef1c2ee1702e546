"""Workloads of the Kubernetes manifests: etcd, scheduler replicas, node pods, monitoring.

Split from :mod:`tools.cluster.kubernetes` (names, config, CLI); the choices are argued in
docs/kubernetes.md. Every service binds the address its cluster file names, so probes dial the
pod's IP (``$POD_IP`` from the downward API), never 127.0.0.1.
"""

from __future__ import annotations

from typing import Any

from . import kubernetes_secrets as secrets
from .config import ROLE_SERVICE, Cluster
from .kubernetes import (APP, CONF_DIR, ETCD_PORT, STATE_MOUNT, STORAGE_MOUNT, KubeOptions, meta,
                         node_pod, selector)
from .schema import NodeSpec

POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
POD_NAME_ENV = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
CONFIG = f"{CONF_DIR}/cluster.toml"


SCHEDULER_HOST_ENV = "DUALPATH__CLUSTER__SCHEDULER_HOST"


def ping_probe(port: int, *, period_s: int, failures: int) -> dict[str, Any]:
    """The Ping of ``tools.cluster.health`` on the pod's IP (the service binds it, not lo).

    The probe reads a plain host config, which has no ``[cluster]``: the scheduler pods'
    ``DUALPATH__CLUSTER__…`` override would make it refuse to start, so it is unset.
    """
    cmd = f'exec env -u {SCHEDULER_HOST_ENV} python -m tools.cluster.health "$POD_IP:{port}"'
    return {"exec": {"command": ["sh", "-c", cmd]},
            "periodSeconds": period_s, "timeoutSeconds": 5, "failureThreshold": failures}


def container(name: str, opts: KubeOptions, args: list[str], ports: dict[str, int],
              probe_port: int, mounts: list[dict[str, Any]],
              env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "name": name, "image": opts.image, "args": args,
        "env": [POD_IP_ENV, POD_NAME_ENV, *(env or [])],
        "ports": [{"name": k, "containerPort": v} for k, v in ports.items()],
        "volumeMounts": mounts,
        # ready: answers Ping; live: still answers (a wedged loop is restarted, §reliability)
        "readinessProbe": ping_probe(probe_port, period_s=5, failures=3),
        "livenessProbe": ping_probe(probe_port, period_s=10, failures=6),
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def headless(name: str, opts: KubeOptions, component: str, ports: dict[str, int]
             ) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, opts, component),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": selector(component),
                     "ports": [{"name": k, "port": v, "targetPort": v}
                               for k, v in ports.items()]}}


def pdb(name: str, sel: dict[str, str], opts: KubeOptions, *, max_unavailable: int | None = None,
        min_available: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": sel}}
    if max_unavailable is not None:
        spec["maxUnavailable"] = max_unavailable
    if min_available is not None:
        spec["minAvailable"] = min_available
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(f"{APP}-{name}", opts, name), "spec": spec}


def statefulset(name: str, opts: KubeOptions, component: str, service: str, replicas: int,
                pod_spec: dict[str, Any], sel: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": meta(name, opts, component),
            "spec": {"serviceName": service, "replicas": replicas,
                     "podManagementPolicy": "Parallel", "selector": {"matchLabels": sel},
                     "template": {"metadata": {"labels": sel}, "spec": pod_spec}}}


CONFIG_MOUNT: dict[str, Any] = {"name": "config", "mountPath": CONF_DIR, "readOnly": True}
CONFIG_VOLUME: dict[str, Any] = {"name": "config", "configMap": {"name": f"{APP}-config"}}


# --------------------------------------------------------------------------- etcd

def etcd(opts: KubeOptions) -> list[dict[str, Any]]:
    """A 3-member etcd (Debian's etcd 3.4 in CI; any 3.4+ image here); the PDB keeps quorum."""
    name = f"{APP}-etcd"
    dom = f"{name}.{opts.namespace}.svc.{opts.cluster_domain}"
    initial = ",".join(f"{name}-{i}=http://{name}-{i}.{dom}:2380"
                       for i in range(opts.etcd_members))
    cmd = ("exec etcd --name $(POD_NAME) --data-dir /var/run/etcd "
           f"--listen-client-urls http://0.0.0.0:{ETCD_PORT} "
           f"--advertise-client-urls http://$(POD_NAME).{dom}:{ETCD_PORT} "
           "--listen-peer-urls http://0.0.0.0:2380 "
           f"--initial-advertise-peer-urls http://$(POD_NAME).{dom}:2380 "
           f"--initial-cluster {initial} --initial-cluster-state new "
           f"--initial-cluster-token {APP}-etcd")
    pod = {"containers": [{
        "name": "etcd", "image": opts.etcd_image, "command": ["sh", "-c", cmd],
        "env": [POD_NAME_ENV],
        "ports": [{"name": "client", "containerPort": ETCD_PORT},
                  {"name": "peer", "containerPort": 2380}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": ETCD_PORT}, "periodSeconds": 5},
        "volumeMounts": [{"name": "data", "mountPath": "/var/run/etcd"}]}],
        "volumes": [{"name": "data", "emptyDir": {}}]}
    sel = selector("etcd")
    return [headless(name, opts, "etcd", {"client": ETCD_PORT, "peer": 2380}),
            statefulset(name, opts, "etcd", name, opts.etcd_members, pod, sel),
            pdb("etcd", sel, opts, min_available=opts.etcd_members // 2 + 1)]


# --------------------------------------------------------------------------- scheduler

def scheduler(cluster: Cluster, opts: KubeOptions) -> list[dict[str, Any]]:
    """Replicas elect a leader in etcd; each binds its own pod IP (env overrides the file)."""
    c = cluster.spec
    name = f"{APP}-scheduler"
    ports = {"rpc": c.scheduler_port}
    if c.scheduler_metrics_port:
        ports["metrics"] = c.scheduler_metrics_port
    ctr = container("scheduler", opts,
                    ["serve", "scheduler", "-c", CONFIG, "--node", "$(POD_NAME)"], ports,
                    c.scheduler_port, [CONFIG_MOUNT, *secrets.mounts(cluster)],
                    env=[{"name": SCHEDULER_HOST_ENV, "value": "$(POD_IP)"},
                         *secrets.env(cluster, opts)])
    pod = {"containers": [ctr], "volumes": [CONFIG_VOLUME, *secrets.volumes(cluster, opts)],
           "terminationGracePeriodSeconds": 20}
    sel = selector("scheduler")
    return [headless(name, opts, "scheduler", ports),
            statefulset(name, opts, "scheduler", name, opts.scheduler_replicas, pod, sel),
            pdb("scheduler", sel, opts, min_available=1)]


# --------------------------------------------------------------------------- nodes

def nodes_service(cluster: Cluster, opts: KubeOptions) -> list[dict[str, Any]]:
    """One headless Service over every node pod: ``<pod>.dualpath-nodes`` names each."""
    ports: dict[str, int] = {}
    short = {"gateway_port": "gw", "rpc_port": "rpc", "metrics_port": "m",
             "gateway_metrics_port": "gwm"}    # port names: at most 15 characters
    for n in cluster.spec.nodes:       # the same port on every node is one Service port
        for f, tag in short.items():
            port = getattr(n, f)
            if port and port not in ports.values():
                ports[f"{tag}-{port}"] = port
    return [headless(f"{APP}-nodes", opts, "node", ports)]


def node_statefulset(cluster: Cluster, n: NodeSpec, opts: KubeOptions) -> dict[str, Any]:
    """Node ``n``'s pod: gateway, PE receiver / DE loader (+ engines), one ``/dev/shm``."""
    c = cluster.spec
    mounts: list[dict[str, Any]] = [CONFIG_MOUNT, {"name": "shm", "mountPath": "/dev/shm"},
              # the state dir itself (it holds the engine socket; nothing creates it)
              {"name": "state", "mountPath": f"{STATE_MOUNT}/{c.name}"},
              *secrets.mounts(cluster)]           # [rpc] TLS / auth files, when set
    gw_ports = {"gateway": n.gateway_port, **({"gw-metrics": n.gateway_metrics_port}
                                               if n.gateway_metrics_port else {})}
    node_ports = {"rpc": n.rpc_port, **({"metrics": n.metrics_port} if n.metrics_port else {})}
    serve = ["serve"]
    containers = [
        container("gateway", opts, [*serve, "gateway", "-c", CONFIG, "--node", n.id], gw_ports,
                  n.gateway_port, [*mounts, {"name": "kvstore", "mountPath": STORAGE_MOUNT}]),
        container(ROLE_SERVICE[n.role].replace("_", "-"), opts,
                  [*serve, "node", "-c", CONFIG, "--node", n.id], node_ports, n.rpc_port,
                  list(mounts))]
    if opts.vllm:                   # a real engine on the node's socket (kubernetes_vllm)
        from .kubernetes_vllm import vllm_container
        containers.append(vllm_container(cluster, n, opts, list(mounts)))
    elif c.remote_engines:          # engines in their own container, on the node's socket
        eng = container("engines", opts, [*serve, "engine_sim", "-c", CONFIG, "--node", n.id],
                        {}, n.rpc_port, list(mounts))
        # no port of its own: it lives while its node socket does (it exits when that goes)
        del eng["readinessProbe"], eng["livenessProbe"], eng["ports"]
        containers.append(eng)
    for ctr in containers:
        ctr["env"] += secrets.env(cluster, opts)
        _hardware(ctr, opts)
    volumes: list[dict[str, Any]] = [
        CONFIG_VOLUME,
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}},
        {"name": "state", "emptyDir": {}},
        {"name": "kvstore", "persistentVolumeClaim": {"claimName": opts.storage_claim}},
        *secrets.volumes(cluster, opts)]
    if opts.hugepages_2mi:
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}})
    pod: dict[str, Any] = {"containers": containers, "volumes": volumes,
                           "terminationGracePeriodSeconds": 20,
                           "hostNetwork": opts.host_network}
    if opts.host_network:
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    sel = selector("node", n.id)
    name = node_pod(n.id)[: -len("-0")]
    return statefulset(name, opts, "node", f"{APP}-nodes", 1, pod, sel)


def _hardware(ctr: dict[str, Any], opts: KubeOptions) -> None:
    """RDMA device plugin and hugepages, when chosen (docs/kubernetes.md, "Hardware")."""
    limits: dict[str, str] = {}
    if opts.rdma_resource:
        limits[opts.rdma_resource] = "1"
        ctr["securityContext"]["capabilities"] = {"add": ["IPC_LOCK"]}   # pinned RDMA memory
    if opts.hugepages_2mi:
        limits["hugepages-2Mi"] = opts.hugepages_2mi
        limits["memory"] = "4Gi"                # hugepage limits need a memory limit
        ctr["volumeMounts"].append({"name": "hugepages", "mountPath": "/hugepages"})
    if limits:
        ctr["resources"] = {"limits": limits, "requests": dict(limits)}


# --------------------------------------------------------------------------- monitoring

def prometheus(opts: KubeOptions) -> list[dict[str, Any]]:
    name = f"{APP}-prometheus"
    pod = {"containers": [{
        "name": "prometheus", "image": opts.prometheus_image,
        "args": ["--config.file=/etc/prometheus/prometheus.yml",
                 "--storage.tsdb.path=/prometheus", "--storage.tsdb.retention.time=2d"],
        "ports": [{"name": "http", "containerPort": 9090}],
        "readinessProbe": {"httpGet": {"path": "/-/ready", "port": 9090}, "periodSeconds": 5},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/prometheus"},
                         {"name": "data", "mountPath": "/prometheus"}]}],
        "volumes": [{"name": "config", "configMap": {"name": name}},
                    {"name": "data", "emptyDir": {}}]}
    return [_deployment(name, opts, "prometheus", pod), _service(name, opts, "prometheus", 9090)]


def grafana(opts: KubeOptions) -> list[dict[str, Any]]:
    name = f"{APP}-grafana"
    prov = f"{APP}-grafana-provisioning"
    pod = {"containers": [{
        "name": "grafana", "image": opts.grafana_image,
        "ports": [{"name": "http", "containerPort": 3000}],
        "readinessProbe": {"httpGet": {"path": "/api/health", "port": 3000}, "periodSeconds": 5},
        "volumeMounts": [
            {"name": "datasource", "mountPath": "/etc/grafana/provisioning/datasources"},
            {"name": "providers", "mountPath": "/etc/grafana/provisioning/dashboards"},
            {"name": "dashboards", "mountPath": "/var/lib/grafana/dashboards"}]}],
        "volumes": [
            {"name": "datasource", "configMap": {
                "name": prov, "items": [{"key": "datasource.yaml", "path": "datasource.yaml"}]}},
            {"name": "providers", "configMap": {
                "name": prov, "items": [{"key": "dashboards.yaml", "path": "dashboards.yaml"}]}},
            {"name": "dashboards", "configMap": {"name": f"{APP}-grafana-dashboards"}}]}
    return [_deployment(name, opts, "grafana", pod), _service(name, opts, "grafana", 3000)]


def _deployment(name: str, opts: KubeOptions, component: str, pod: dict[str, Any]
                ) -> dict[str, Any]:
    sel = selector(component)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(name, opts, component),
            "spec": {"replicas": 1, "selector": {"matchLabels": sel},
                     "template": {"metadata": {"labels": sel}, "spec": pod}}}


def _service(name: str, opts: KubeOptions, component: str, port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, opts, component),
            "spec": {"selector": selector(component),
                     "ports": [{"name": "http", "port": port, "targetPort": port}]}}
