"""Start-time checks of a service against the machine it runs on (issue #17, bad input).

A cluster file is the same on every host (docs/deploy.md); what differs is which entry a
machine is. Two mistakes it cannot see by itself are checked where the service starts, so the
service refuses with the reason instead of half-working:

* **An address this machine does not own** (the node's ``host``, or the scheduler's): binding
  it fails deep inside the RPC/UCX start with a bare ``EADDRNOTAVAIL``; here it is a
  :class:`~common.errors.ConfigError` naming the address, the entry and this host.
* **A storage directory missing on this host** (the shared file system not mounted): in a
  cluster whose nodes are on more than one host, ``storage_root`` is a mount every gateway
  shares, so a gateway never creates it — creating it would silently split the store into a
  private copy. On one machine (every node on one address) it is created as before.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from common.errors import ConfigError

from .config import Cluster, ip_of

_ANY = ("", "0.0.0.0", "::")


def owns_address(host: str) -> bool:
    """Can this machine bind ``host``? (A wildcard always can.)"""
    if host in _ANY:
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip_of(host), 0))
    except OSError as e:
        if e.errno in (errno.EADDRNOTAVAIL, errno.EINVAL):
            return False
        raise
    return True


def check_service_host(cluster: Cluster, service: str, node: str | None) -> None:
    """Refuse to start ``service`` (of ``node``) on a machine that is not its host."""
    c = cluster.spec
    if service == "scheduler":
        host, what = c.scheduler_host or c.host, "cluster.scheduler_host"
    else:
        assert node is not None
        host, what = c.node_host(c.node(node)), f"the host of node {node}"
    if not owns_address(host):
        raise ConfigError(f"{cluster.source}: {what} is {host}, not an address of this "
                          f"machine ({socket.gethostname()}): is this the right host, or "
                          f"the right --node?")


def multi_host(cluster: Cluster) -> bool:
    c = cluster.spec
    return len({ip_of(c.node_host(n)) for n in c.nodes}) > 1


def check_storage_root(cluster: Cluster, root: str) -> None:
    """In a multi-host cluster the storage directory must already exist (a shared mount)."""
    if multi_host(cluster) and not Path(root).is_dir():
        raise ConfigError(f"{cluster.source}: storage directory {root} is missing on this host "
                          f"({socket.gethostname()}): mount the shared file system every node "
                          f"uses (docs/deploy.md step 1) — a gateway never creates it in a "
                          f"multi-host cluster, which would split the store")
