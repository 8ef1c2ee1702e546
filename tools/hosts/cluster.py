"""A 1P2D dualpath cluster on namespace hosts, every service started the bare-metal way.

Hosts (``tools.hosts.netns``): ``ctl`` (etcd + the scheduler), ``p0`` (prefill node), ``d0``
and ``d1`` (decode nodes), ``cli`` (the replay driver). Each host gets its own
``etc/cluster.toml`` and ``etc/env`` (docs/deploy.md step 3: one cluster file, per-host env),
and each service is started with the ``ExecStart=`` line of its ``deploy/systemd`` unit (paths
mapped from ``/opt/dualpath`` and ``/etc/dualpath`` to this checkout and the host's ``etc/``;
``EnvironmentFile`` read the way systemd reads it), so the units and this harness cannot
drift. Readiness is the scheduler unit's own ``ExecStartPost`` probe: ``tools.cluster.health``.

The cluster file is ``configs/local-1p2d.toml`` (storage links shaped as there) with every
node's ``host`` its namespace address, the fixed ports of ``deploy/cluster-example.toml``, the
storage root on the shared mount and UCX's KV class over TCP between hosts
(``TLS = "tcp,sm,self"``, ``NET_DEVICES = "all"``: sm only ever serves a node's own gateway on
the same host). Node services log UCX's lane choice (``UCX_LOG_LEVEL=info``) for
``tools.hosts.ucx_lanes``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.config import read_toml
from common.errors import DualpathError
from tools.cluster.toml_write import dumps as dumps_toml

from .netns import HostNet

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"
SCHEDULER_PORT, GATEWAY_PORT, RPC_PORT, ETCD_PORT = 7700, 7400, 7500, 2379
# Prometheus /metrics of every service, the Kubernetes manifests' ports (deploy/kubernetes)
SCHEDULER_METRICS_PORT, NODE_METRICS_PORT, GATEWAY_METRICS_PORT = 9100, 9101, 9102
NODES = {"p0": "prefill", "d0": "decode", "d1": "decode"}
HOST_NAMES = ["ctl", "p0", "d0", "d1", "cli"]
SPARE_HOSTS = ["spare", "nostore"]       # bad-input cases: "nostore" has no storage mount
READY_DEADLINE_S = 60.0
KV_TLS = "tcp,sm,self"


def cluster_data(net: HostNet, *, base: str = "configs/local-1p2d.toml", etcd: bool = True,
                 tls: str = KV_TLS) -> dict[str, Any]:
    """The one cluster file of every host (a dict, written as TOML per host)."""
    data = read_toml(REPO / base)
    ctl = net.hosts["ctl"].address
    c = data["cluster"]
    c.update(host="0.0.0.0", scheduler_host=ctl, scheduler_port=SCHEDULER_PORT,
             scheduler_metrics_port=SCHEDULER_METRICS_PORT,
             data_dir="state", storage_root=str(net.mount_point / "dualpath"))
    c["nodes"] = [{"id": nid, "role": role, "host": net.hosts[nid].address,
                   "gateway_port": GATEWAY_PORT, "rpc_port": RPC_PORT,
                   "metrics_port": NODE_METRICS_PORT, "gateway_metrics_port": GATEWAY_METRICS_PORT}
                  for nid, role in NODES.items()]
    data.setdefault("transport", {})["traffic_classes"] = {
        "kv": {"options": {"TLS": tls, "NET_DEVICES": "all"}}}
    data.setdefault("logging", {})["json"] = True
    if etcd:
        data["etcd"] = {"endpoints": [f"{ctl}:{ETCD_PORT}"]}
    return data


def write_host_files(net: HostNet, data: dict[str, Any],
                     per_host: dict[str, dict[str, Any]] | None = None) -> None:
    """``etc/cluster.toml`` + ``etc/env`` on every host (``per_host``: a host's own changes),
    and the storage directory on the shared file system (made once, as an operator would)."""
    (net.store / "dualpath").mkdir(exist_ok=True)
    for name, host in net.hosts.items():
        text = dumps_toml(_deep_merge(data, (per_host or {}).get(name, {})))
        (host.etc / "cluster.toml").write_text(text)
        # RNDV_THRESH: over TCP ucxx's 8 KiB default makes every Layer Block a rendezvous
        # handshake (measured: dualpath 0.57x basic at 8 KiB, 1.30x at 1 MiB; docs/deploy.md)
        env = [f"DUALPATH_SCHEDULER={net.hosts['ctl'].address}:{SCHEDULER_PORT}",
               "UCX_LOG_LEVEL=info", "UCX_RNDV_THRESH=1048576"]
        (host.etc / "env").write_text("\n".join(env) + "\n")
        (host.root / "var").mkdir(exist_ok=True)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k),
                                                                                dict) else v
    return out


def node_moved(data: dict[str, Any], node: str, address: str, **options: str
               ) -> dict[str, Any]:
    """``data`` with ``node`` placed at ``address`` (a new node when it is not in the file);
    ``options`` replace the KV traffic class's UCX options."""
    out = _deep_merge(data, {})
    nodes = [dict(n) for n in out["cluster"]["nodes"]]
    mine = [n for n in nodes if n["id"] == node]
    if not mine:
        nodes.append({"id": node, "role": "decode", "gateway_port": GATEWAY_PORT,
                      "rpc_port": RPC_PORT})
        mine = nodes[-1:]
    mine[0]["host"] = address
    out["cluster"] = {**out["cluster"], "nodes": nodes}
    if options:
        out["transport"] = _deep_merge(out["transport"], {
            "traffic_classes": {"kv": {"options": options}}})
    return out


def unit_command(unit: str, net: HostNet, host: str, instance: str = "") -> list[str]:
    """The ``ExecStart=`` argv of ``deploy/systemd/<unit>`` for ``host`` (paths mapped)."""
    text = (UNITS / unit).read_text()
    match = re.search(r"^ExecStart=(.+)$", text, re.M)
    if match is None:
        raise DualpathError(f"{unit}: no ExecStart=")
    line = match.group(1).replace("%i", instance)
    line = line.replace("/opt/dualpath/.venv/bin/", str(Path(sys.executable).parent) + "/")
    line = line.replace("/etc/dualpath/", str(net.hosts[host].etc) + "/")
    return shlex.split(line)


def unit_env(net: HostNet, host: str) -> dict[str, str]:
    """The process environment systemd would give the unit: ours + ``EnvironmentFile``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "DUALPATH"))}
    env["PYTHONPATH"] = str(REPO)
    for line in (net.hosts[host].etc / "env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def start_etcd(net: HostNet) -> None:
    """One etcd member on ``ctl`` (Debian etcd-server; ``make etcd``)."""
    ip = net.hosts["ctl"].address
    net.spawn("ctl", ["etcd", "--name", "ctl", "--data-dir", str(net.hosts["ctl"].root / "etcd"),
                      "--listen-client-urls", f"http://{ip}:{ETCD_PORT}",
                      "--advertise-client-urls", f"http://{ip}:{ETCD_PORT}",
                      "--listen-peer-urls", f"http://{ip}:{ETCD_PORT + 1}",
                      "--initial-advertise-peer-urls", f"http://{ip}:{ETCD_PORT + 1}",
                      "--initial-cluster", f"ctl=http://{ip}:{ETCD_PORT + 1}"],
              log_name="etcd")
    wait_for(net, "ctl", lambda: net.run("ctl", ["etcdctl", "--endpoints", f"{ip}:{ETCD_PORT}",
                                                 "--dial-timeout=1s", "endpoint", "health"],
                                         timeout=10).returncode == 0, "etcd")


def start_service(net: HostNet, host: str, unit: str, instance: str = "",
                  log_name: str | None = None) -> subprocess.Popen[bytes]:
    """Start one unit's ExecStart on ``host`` from its working directory (``var/``)."""
    argv = unit_command(unit, net, host, instance)
    name = log_name or unit.replace("@.service", f"@{instance}").replace(".service", "")
    return net.spawn(host, argv, env=unit_env(net, host), log_name=name,
                     cwd=str(net.hosts[host].root / "var"))


PROBE_LIMIT_S = 15.0    # one probe's process: ~0.4 s idle, its Ping bounded at 2 s + 2 s close


def health(net: HostNet, on_host: str, addr: str) -> bool:
    """The units' own readiness probe, run on ``on_host``: one try, judged as a kubelet does
    (a try that outlasts its limit is a failed try, not an error: on a loaded host a whole
    Python process start can be held up for seconds)."""
    try:
        return net.run(on_host, [sys.executable, "-m", "tools.cluster.health", addr],
                       env=unit_env(net, on_host), timeout=PROBE_LIMIT_S,
                       cwd=str(REPO)).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def answers(net: HostNet, on_host: str, addr: str, deadline_s: float = 60.0) -> bool:
    """Whether ``addr`` passes the probe from ``on_host`` within ``deadline_s``: the service is
    up, and a try lost to a stalled host is tried again (failureThreshold, as ``wait_for``)."""
    try:
        wait_for(net, on_host, lambda: health(net, on_host, addr), f"probe of {addr}",
                 deadline_s=deadline_s)
        return True
    except DualpathError:
        return False


def wait_for(net: HostNet, host: str, ready: Any, what: str,
             proc: subprocess.Popen[bytes] | None = None,
             deadline_s: float = READY_DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not _passes(ready):
        if proc is not None and proc.poll() is not None:
            raise DualpathError(f"{what} on {host} exited {proc.returncode}: "
                                f"{net.log_text(host, what)[-2000:]}")
        if time.monotonic() > end:
            raise DualpathError(f"{what} on {host} not ready in {deadline_s}s")
        time.sleep(0.3)


def _passes(ready: Any) -> bool:
    """One readiness try; a probe process that outlasted its limit is a failed try."""
    try:
        return bool(ready())
    except subprocess.TimeoutExpired:
        return False


def start_cluster(net: HostNet, *, etcd: bool = True) -> None:
    """etcd and the scheduler on ``ctl``, then each node's gateway and node service."""
    if etcd:
        start_etcd(net)
    ctl = f"{net.hosts['ctl'].address}:{SCHEDULER_PORT}"
    proc = start_service(net, "ctl", "dualpath-scheduler.service")
    wait_for(net, "ctl", lambda: health(net, "ctl", ctl), "dualpath-scheduler", proc)
    for unit, port in (("dualpath-gateway@.service", GATEWAY_PORT),
                       ("dualpath-node@.service", RPC_PORT)):   # gateways first (After=)
        procs = {nid: start_service(net, nid, unit, nid) for nid in NODES}
        for nid, proc in procs.items():
            addr = f"{net.hosts[nid].address}:{port}"
            wait_for(net, nid, lambda n=nid, a=addr: health(net, n, a),
                     unit.replace("@.service", f"@{nid}"), proc)


def replay(net: HostNet, *args: str, host: str = "cli",
           timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """``dualpath replay -c <host's cluster.toml> --static ARGS`` on ``host``."""
    argv = [*replay_argv(net, host), *args]
    env = unit_env(net, host)
    env.pop("UCX_LOG_LEVEL", None)
    return net.run(host, argv, env=env, timeout=timeout, cwd=str(net.hosts[host].root / "var"))


def replay_argv(net: HostNet, host: str = "cli") -> list[str]:
    """The static replay against the cluster, as docs/deploy.md step 5 runs it."""
    return [str(Path(sys.executable).parent / "dualpath"), "replay",
            "-c", str(net.hosts[host].etc / "cluster.toml"), "--static", "--no-progress",
            "--no-plots"]
