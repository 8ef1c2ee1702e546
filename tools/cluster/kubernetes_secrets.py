"""The control plane's key material in the Kubernetes manifests: TLS files and the RPC secret.

When the cluster file's ``[rpc]`` names ``tls_cert_file`` / ``tls_key_file`` / ``tls_ca_file``
or ``auth_secret_file``, every dualpath container mounts them read-only (mode 0400) from one
Secret (``KubeOptions.rpc_secret``, keys = the files' base names) at the directories the file
names, and carries the same settings as ``DUALPATH__RPC__*`` variables so the Ping probe
(``tools.cluster.health``, which reads only the environment) speaks TLS / authenticates like
the services. Pods are reached by changing IPs (the scheduler leader advertises its pod IP),
so unless the file sets ``tls_server_name`` the render sets one cluster-wide name
(:func:`tls_server_name`) that every certificate must carry as a DNS SAN (docs/kubernetes.md).
Nothing secret is rendered: the Secret itself is created by the operator
(``kubectl create secret generic dualpath-rpc --from-file=...``).
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any

from common.errors import ConfigError

from .config import Cluster

if TYPE_CHECKING:
    from .kubernetes import KubeOptions

FILE_FIELDS = ("tls_cert_file", "tls_key_file", "tls_ca_file", "auth_secret_file")


def secret_files(cluster: Cluster) -> dict[str, str]:
    """``[rpc]`` field → the in-container path it names, for the files that are set."""
    rpc = cluster.cfg.rpc
    files = {f: getattr(rpc, f) for f in FILE_FIELDS if getattr(rpc, f)}
    by_key: dict[str, str] = {}
    for field, path in files.items():
        if not posixpath.isabs(path):
            raise ConfigError(f"{cluster.source}: rpc.{field} {path!r} must be an absolute "
                              "path (it is where the Secret is mounted in the pods)")
        key = posixpath.basename(path)
        if by_key.setdefault(key, field) != field:
            raise ConfigError(f"{cluster.source}: rpc.{by_key[key]} and rpc.{field} share the "
                              f"file name {key!r}: they would be one key of the Secret")
    return files


def tls_server_name(cluster: Cluster, opts: KubeOptions) -> str | None:
    """The name every service certificate carries (None: TLS off)."""
    rpc = cluster.cfg.rpc
    if not (rpc.tls_cert_file or rpc.tls_ca_file):
        return None
    return rpc.tls_server_name or f"dualpath.{opts.namespace}.svc"


def volumes(cluster: Cluster, opts: KubeOptions) -> list[dict[str, Any]]:
    """One Secret volume per directory the files live in (items: only that dir's files)."""
    return [{"name": name, "secret": {
        "secretName": opts.rpc_secret, "defaultMode": 0o400,
        "items": [{"key": posixpath.basename(p), "path": posixpath.basename(p)} for p in paths]}}
        for name, (_, paths) in _dirs(cluster).items()]


def mounts(cluster: Cluster) -> list[dict[str, Any]]:
    return [{"name": name, "mountPath": d, "readOnly": True}
            for name, (d, _) in _dirs(cluster).items()]


def env(cluster: Cluster, opts: KubeOptions) -> list[dict[str, Any]]:
    """The same ``[rpc]`` settings as variables, for the probe (and harmless to the services)."""
    out = [{"name": f"DUALPATH__RPC__{f.upper()}", "value": p}
           for f, p in secret_files(cluster).items()]
    if (name := tls_server_name(cluster, opts)) is not None:
        out.append({"name": "DUALPATH__RPC__TLS_SERVER_NAME", "value": name})
    return out


def _dirs(cluster: Cluster) -> dict[str, tuple[str, list[str]]]:
    grouped: dict[str, list[str]] = {}
    for path in secret_files(cluster).values():
        grouped.setdefault(posixpath.dirname(path), []).append(path)
    return {f"rpc-secret-{i}": (d, paths) for i, (d, paths) in enumerate(sorted(grouped.items()))}
