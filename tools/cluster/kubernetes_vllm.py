"""The real-engine variant of the Kubernetes manifests (``--vllm``; docs/kubernetes.md).

Each node pod gets a ``vllm`` container instead of the emulated engines: the OpenAI server with
the DualPathConnector on the node's engine socket (the pod's shared state volume), its argv the
one the real-engine tests start (:func:`tools.vllm_serve.vllm_server_argv`), run from the image
``docker build --build-arg WITH_VLLM=1`` makes (its ``.venv-vllm`` and model). One Deployment
runs the OpenAI front over the scheduler replicas (following the etcd leader) and every node's
vLLM. What is checked at render: the file has ``remote_engines`` (else no socket) and the KV
preset the instances serve (else the connector refuses to start).
"""

from __future__ import annotations

from typing import Any

from common.errors import ConfigError
from tools.vllm_engines import PRESET
from tools.vllm_serve import FRONT_PORT, VLLM_PORTS, front_argv, vllm_server_argv

from . import kubernetes_secrets as secrets
from .config import Cluster
from .kubernetes import (APP, STATE_MOUNT, KubeOptions, etcd_endpoints, meta, node_host,
                         selector, service_host)
from .schema import NodeSpec

PYTHON = "/app/.venv-vllm/bin/python"            # the WITH_VLLM image (WORKDIR /app)
MODEL = "/opt/models/smollm2-135m-0.1.2"         # DUALPATH_MODEL_CACHE of the WITH_VLLM image
KVCACHE_ENV = {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}


def check(cluster: Cluster) -> None:
    """Refuse a file the instances could not attach to, naming what to set."""
    if not cluster.spec.remote_engines:
        raise ConfigError(f"{cluster.source}: --vllm needs [cluster] remote_engines = true "
                          "(each node serves its vLLM on its engine socket)")
    if cluster.cfg.kv.preset != PRESET:
        raise ConfigError(f"{cluster.source}: --vllm serves the model in float32: [kv] preset "
                          f"must be {PRESET!r}, not {cluster.cfg.kv.preset!r}")


def engine_url(n: NodeSpec, opts: KubeOptions) -> str:
    return f"http://{node_host(n.id, opts)}:{VLLM_PORTS[n.role]}"


def vllm_container(cluster: Cluster, n: NodeSpec, opts: KubeOptions,
                   mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """Node ``n``'s vLLM beside its node service, on the pod IP (the front dials it)."""
    port = VLLM_PORTS[n.role]
    sock = f"{STATE_MOUNT}/{cluster.spec.name}/{n.id}.engine.sock"   # the pods' data_dir
    argv = vllm_server_argv(PYTHON, MODEL, n.role, sock, f"{n.id}.e0", port,
                            cluster.spec.vllm_max_model_len, host="$(POD_IP)",
                            prefix_caching=cluster.spec.vllm_prefix_caching)
    return {"name": "vllm", "image": opts.vllm_image, "workingDir": "/app",
            "command": argv[:1], "args": argv[1:],
            "env": [_POD_IP_ENV, KVCACHE_ENV],
            "ports": [{"name": "vllm", "containerPort": port}], "volumeMounts": mounts,
            **_http_probes(port), "securityContext": {"allowPrivilegeEscalation": False}}


def front(cluster: Cluster, opts: KubeOptions) -> list[dict[str, Any]]:
    """The front Deployment and its Service (clients' OpenAI endpoint)."""
    name = f"{APP}-front"
    urls = {f"{n.id}.e0": engine_url(n, opts) for n in cluster.spec.nodes}
    scheduler = f"{service_host(f'{APP}-scheduler', opts)}:{cluster.spec.scheduler_port}"
    argv = front_argv(PYTHON, MODEL, scheduler, urls, port=FRONT_PORT, host="$(POD_IP)",
                      max_model_len=cluster.spec.vllm_max_model_len,
                      etcd=etcd_endpoints(cluster, opts), etcd_prefix=cluster.cfg.etcd.prefix)
    rpc = cluster.cfg.rpc
    for flag, path in (("--auth-secret-file", rpc.auth_secret_file),
                       ("--rpc-tls-ca-file", rpc.tls_ca_file),
                       ("--rpc-tls-cert-file", rpc.tls_cert_file),
                       ("--rpc-tls-key-file", rpc.tls_key_file)):
        if path:
            argv += [flag, path]
    ctr = {"name": "front", "image": opts.vllm_image, "workingDir": "/app",
           "command": argv[:1], "args": argv[1:],
           "env": [_POD_IP_ENV], "ports": [{"name": "http", "containerPort": FRONT_PORT}],
           "volumeMounts": secrets.mounts(cluster), **_http_probes(FRONT_PORT),
           "securityContext": {"allowPrivilegeEscalation": False}}
    pod = {"containers": [ctr], "volumes": secrets.volumes(cluster, opts)}
    sel = selector("front")
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(name, opts, "front"),
             "spec": {"replicas": 1, "selector": {"matchLabels": sel},
                      "template": {"metadata": {"labels": sel}, "spec": pod}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, opts, "front"),
             "spec": {"selector": sel, "ports": [{"name": "http", "port": FRONT_PORT,
                                                   "targetPort": FRONT_PORT}]}}]


_POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _http_probes(port: int) -> dict[str, Any]:
    """``/health`` (vLLM's and the front's): a start window for the model load (20-40 s on
    two cores, more on a busy node), then readiness and liveness."""
    get = {"httpGet": {"path": "/health", "port": port}}
    return {"startupProbe": {**get, "periodSeconds": 5, "failureThreshold": 180},
            "readinessProbe": {**get, "periodSeconds": 5, "failureThreshold": 3},
            "livenessProbe": {**get, "periodSeconds": 10, "failureThreshold": 6}}
