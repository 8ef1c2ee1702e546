"""Cluster config: one TOML file for a whole PD cluster, validated before anything starts.

A cluster file is a normal service config (every section of ``common.config.DualpathConfig``
plus ``[gateway_service]``) with one more section, ``[cluster]``, and its node list::

    [cluster]
    name = "local-1p2d"
    time_scale = 1.0                    # × every cost-model second (engine emulators)
    storage_link_bytes_per_s = 24e6     # emulated SNIC per node (gateway token bucket)
    compute_link_bytes_per_s = 192e6    # emulated CNIC egress per node (KV arbiter)
    engines_per_node = 2

    [[cluster.nodes]]
    id = "p0"
    role = "prefill"                    # prefill → PE receiver, decode → DE loader
    [[cluster.nodes]]
    id = "d0"
    role = "decode"
    storage_link_bytes_per_s = 20e6     # per-node override

Unknown keys fail with their path (``unknown field `rol` at $.cluster.nodes[1]``). The per-service
configs are *rendered* from it (:func:`service_config`): the node's link rates go to its
gateway (``gateway.link_rate_bytes_per_s``) and arbiter (``arbiter.link_rate_bytes_per_s``),
``time_scale`` to the engine emulators, α/β of the scheduler follow the links and the time
scale, every gateway shares ``storage_root`` (a directory here, a distributed file system on
real nodes). Ablation modes (:data:`MODES`, ``services.scheduler.core.modes``) switch scheduler policy
and engine mode only.
"""

from __future__ import annotations

import collections
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from common.config import build_config, env_overlay, read_toml
from tools.config import DualpathConfig
from common.errors import ConfigError
from services.scheduler.core.modes import MODE_SPECS, ModeSpec, mode_spec

from .schema import ClusterSection, NodeSpec, Role  # noqa: F401  (re-exported)

SERVICES = ("scheduler", "gateway", "pe_receiver", "de_loader")
ROLE_SERVICE = {"prefill": "pe_receiver", "decode": "de_loader"}
GiB = 1024 ** 3


# The ablation modes: one table, the scheduler's (shared with the simulator), by name.
MODES: dict[str, ModeSpec] = MODE_SPECS


def _cluster_root() -> type:
    # The gateway's root adds [gateway_service]; a cluster file carries every section.
    class ClusterConfig(DualpathConfig):
        """Root of a cluster file: every service section plus ``[cluster]``."""

        cluster: ClusterSection = msgspec.field(default_factory=ClusterSection)

    return ClusterConfig


_ROOT: type | None = None


def cluster_root() -> type:
    global _ROOT
    if _ROOT is None:
        _ROOT = _cluster_root()
    return _ROOT


@dataclass(frozen=True)
class Cluster:
    """A validated cluster config: the typed struct, the raw data it came from, its mode."""

    cfg: Any                      # ClusterConfig
    data: dict[str, Any]          # after the environment overlay
    source: str
    mode: str | None = None

    @property
    def spec(self) -> ClusterSection:
        return self.cfg.cluster

    def with_mode(self, mode: str | None) -> Cluster:
        return load_data(self.data, self.source, mode=mode, environ={})

    def with_overrides(self, **sections: dict[str, Any]) -> Cluster:
        data = _merge(self.data, sections)
        return Cluster(build_config(data, cluster_root(), self.source, environ={}), data,
                       self.source, self.mode)


# --------------------------------------------------------------------------- loading

def default_data() -> dict[str, Any]:
    """The embedded defaults: the local storage-bound 1P2D emulation (``configs/local-1p2d``)."""
    return {
        "kv": {"preset": "test-small"},
        "cluster": {"name": "local-1p2d", "engines_per_node": 2, "time_scale": 1.0,
                    "storage_link_bytes_per_s": 24e6, "compute_link_bytes_per_s": 192e6,
                    "nodes": [{"id": "p0", "role": "prefill"}, {"id": "d0", "role": "decode"},
                              {"id": "d1", "role": "decode"}]},
        "transport": {"staging_bytes": 16 * 2**20},
        "gateway": {"io_threads": 2},
        "gateway_service": {"staging_bytes": 16 * 2**20, "max_batch_bytes": 4 * 2**20},
        "pe_receiver": {"buffer_bytes": 64 * 2**20},
        "de_loader": {"buffer_bytes": 64 * 2**20, "hbm_capacity_bytes": 256 * 2**20},
        "engine_sim": {"decode_max_batch": 256},
        "scheduler_service": {"fetch_interval_s": 0.01, "heartbeat_s": 0.5, "lease_s": 5.0},
        "logging": {"level": "warning"},
    }


def load_cluster(path: str | os.PathLike[str] | None, mode: str | None = None,
                 environ: dict[str, str] | None = None) -> Cluster:
    """Load a cluster file (``None``: the embedded defaults), apply ``mode``, validate."""
    if path is None:
        return load_data(default_data(), "embedded defaults", mode=mode, environ=environ)
    return load_data(read_toml(path, "cluster config"), str(path), mode=mode, environ=environ)


def load_data(data: dict[str, Any], source: str, *, mode: str | None = None,
              environ: dict[str, str] | None = None) -> Cluster:
    data = env_overlay(data, environ)
    if mode is not None:
        data = apply_mode(data, mode)
    cfg = build_config(data, cluster_root(), source, environ={})
    _check_cross(cfg, data, source)
    return Cluster(cfg, data, source, mode)


def apply_mode(data: dict[str, Any], mode: str) -> dict[str, Any]:
    """``data`` with the scheduler policy and the engine mode of ablation ``mode``."""
    try:
        m = mode_spec(mode)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return _merge(data, {"scheduler": {"policy": m.policy, "placement": m.placement,
                                       "oracle": m.oracle, "read_side": m.read_side},
                         "engine_sim": {"mode": m.engine_mode}})


def _check_cross(cfg: Any, data: dict[str, Any], source: str) -> None:
    """Checks that need more than one section."""
    c = cfg.cluster
    from common.kv import spec_from_config
    from services.compute_model.cost_model import PRESETS as COSTS

    try:
        spec = spec_from_config(cfg.kv)
    except Exception as e:   # InvalidArgument naming the preset
        raise ConfigError(f"{source}: kv: {e}") from None
    model = cfg.engine_sim.model or spec.name
    if model not in COSTS:
        raise ConfigError(f"{source}: engine_sim.model / kv.preset {model!r} has no cost model; "
                          f"known: {sorted(COSTS)}")
    limit = cfg.scheduler_service.max_engines_per_node
    for i, n in enumerate(c.nodes):
        if c.engines(n) > limit:
            raise ConfigError(f"{source}: cluster.nodes[{i}] ({n.id}) has {c.engines(n)} engines, "
                              f"above scheduler_service.max_engines_per_node = {limit}")
    ts = data.get("engine_sim", {}).get("time_scale")
    if ts is not None and ts != c.time_scale:
        raise ConfigError(f"{source}: engine_sim.time_scale = {ts} and cluster.time_scale = "
                          f"{c.time_scale} disagree; set cluster.time_scale only")
    _check_ports(c, source)
    _check_tls(cfg, source)


def _check_tls(cfg: Any, source: str) -> None:
    """Every traffic class's UCX transport list must let listener connections form: they need
    ``tcp`` (docs/performance.md, 'UCX facts'; measured: ``TLS = "rc,sm,self"`` never connects —
    issue #17)."""
    for name, tc in cfg.transport.traffic_classes.items():
        tls = tc.options.get("TLS")
        if not tls or tls.startswith("^"):
            continue
        names = {t.strip() for t in tls.split(",")}
        if not names & {"tcp", "all"}:
            raise ConfigError(f"{source}: transport.traffic_classes.{name}.options.TLS = "
                              f"{tls!r} has no tcp: UCX listener connections need it (keep "
                              f"rc/ud for the data, e.g. \"rc,tcp,sm,self\")")


def _check_ports(c: ClusterSection, source: str) -> None:
    fixed: dict[tuple[str, int], str] = {}
    def claim(host: str, port: int | None, what: str) -> None:
        if not port:
            return
        key = (host, port)
        if key in fixed:
            raise ConfigError(f"{source}: port {port} on {host} is given to both {fixed[key]} "
                              f"and {what}")
        fixed[key] = what
    sched_host = c.scheduler_host or c.host
    claim(sched_host, c.scheduler_port, "cluster.scheduler_port")
    claim(sched_host, c.scheduler_metrics_port, "cluster.scheduler_metrics_port")
    for i, n in enumerate(c.nodes):
        h = c.node_host(n)
        for f in ("gateway_port", "rpc_port", "metrics_port", "gateway_metrics_port"):
            claim(h, getattr(n, f), f"cluster.nodes[{i}].{f} ({n.id})")


# --------------------------------------------------------------------------- preflight

def check_ports_free(cluster: Cluster, hosts: set[str] | None = None) -> None:
    """Every fixed port this machine would bind must be free (one message naming them all)."""
    c = cluster.spec
    want: list[tuple[str, int, str]] = []
    sched_host = c.scheduler_host or c.host
    if c.scheduler_port:
        want.append((sched_host, c.scheduler_port, "cluster.scheduler_port"))
    if c.scheduler_metrics_port:
        want.append((sched_host, c.scheduler_metrics_port, "cluster.scheduler_metrics_port"))
    if c.engine == "vllm" and c.front_port:
        want.append((c.host, c.front_port, "cluster.front_port"))
    for i, n in enumerate(c.nodes):
        for f in ("gateway_port", "rpc_port", "metrics_port", "gateway_metrics_port"):
            port = getattr(n, f)
            if port:
                want.append((c.node_host(n), port, f"cluster.nodes[{i}].{f} ({n.id})"))
        if c.engine == "vllm" and n.engine_port:
            want += [(c.node_host(n), n.engine_port + e,
                      f"cluster.nodes[{i}].engine_port + {e} ({n.id}.e{e})")
                     for e in range(c.engines(n))]
    taken = [f"{what} = {port} on {host}" for host, port, what in want
             if (hosts is None or host in hosts) and not port_free(host, port)]
    if taken:
        raise ConfigError(f"{cluster.source}: port(s) already in use: {'; '.join(taken)} — "
                          "stop what holds them (`dualpath cluster down`?) or use port 0")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_RNG = random.Random()
_HANDED: collections.deque[int] = collections.deque(maxlen=4096)   # recent picks, never repeated


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999             # Linux's default


def _band(start: int, stop: int) -> tuple[int, int]:
    """This process's share of ``[start, stop)``: ``DUALPATH_PORT_BAND=k/n`` (band k of n, as
    ``make test`` gives each of the pytest processes it runs at once) keeps two processes from
    handing out one port; unset, the whole range."""
    band = os.environ.get("DUALPATH_PORT_BAND", "")
    try:
        k, n = (int(x) for x in band.split("/"))
    except ValueError:
        return start, stop
    if not 0 <= k < n:
        return start, stop
    width = (stop - start) // n
    return start + k * width, start + (k + 1) * width


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a service that must be told its port (a fixed
    port in a cluster file, etcd): picked *below* the kernel's ephemeral range, so no socket
    bound to port 0 meanwhile (a UCX listener, another service's ``--metrics-port 0``) can take
    it before its service binds it — an ephemeral pick collided so (``Address already in
    use`` at start, seen in CI). Falls back to an ephemeral port if none is free below."""
    low, _ = _ephemeral_range()
    start, stop = _band(max(1024, low - 12000), low)
    for _ in range(64):
        port = _RNG.randrange(start, stop) if low > 2048 else 0
        if port in _HANDED:             # two picks in a row must not name one port
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _HANDED.append(s.getsockname()[1])
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def memory_estimate(cluster: Cluster) -> dict[str, int]:
    """Bytes each service preallocates (buffers, staging pools): what a local run must fit."""
    cfg = cluster.cfg
    staging = cfg.transport.staging_bytes
    out: dict[str, int] = {}
    for n in cluster.spec.nodes:
        out[f"gateway:{n.id}"] = cfg.gateway_service.staging_bytes + staging
        section = cfg.pe_receiver if n.role == "prefill" else cfg.de_loader
        out[f"{ROLE_SERVICE[n.role]}:{n.id}"] = section.buffer_bytes + 2 * staging
    return out


def check_local_resources(cluster: Cluster) -> None:
    """The services' preallocated memory must fit this machine (one clear message if not)."""
    need = sum(memory_estimate(cluster).values())
    avail = _mem_available()
    if avail is not None and need > 0.8 * avail:
        raise ConfigError(
            f"{cluster.source}: the {cluster.spec.shape} cluster preallocates "
            f"{need / GiB:.1f} GiB (buffers + staging of {len(cluster.spec.nodes)} nodes), this "
            f"machine has {avail / GiB:.1f} GiB available — lower pe_receiver/de_loader."
            "buffer_bytes, gateway_service.staging_bytes or transport.staging_bytes")


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pd_warning(cluster: Cluster) -> str | None:
    """Paper eq. (9): a line when P/D is outside the no-bottleneck window (simulator's check)."""
    c = cluster.spec
    snic = [c.storage_link(n) for n in c.nodes]
    cnic = [c.compute_link(n) for n in c.nodes]
    if not all(snic) or not all(cnic):
        return None
    try:
        from sim.bandwidth import pd_window_warning
    except ImportError:
        return None
    g = max(c.engines(n) for n in c.nodes)
    try:
        # CNIC here is per node; eq. (9) counts one CNIC per GPU. DRAM: M ≈ 10 × SNIC (§9).
        return pd_window_warning(len(c.prefill), len(c.decode), g, max(snic), max(cnic) / g,
                                 10 * max(snic))
    except Exception:       # a check, never a reason not to start
        return None


# --------------------------------------------------------------------------- rendering

def service_config(cluster: Cluster, service: str, node_id: str | None = None, *,
                   scheduler: tuple[str, int] | None = None,
                   gateway_port: int | None = None, resolve: bool = False) -> Any:
    """The config struct one service of the cluster runs with.

    ``scheduler`` / ``gateway_port`` override the addresses a node service dials (the local
    launcher learns them at start); by default they come from the cluster file. ``resolve``
    turns host names into IP addresses for binding and advertising (UCX peers dial the
    advertised address; names are fine everywhere else).
    """
    if service not in SERVICES:
        raise ConfigError(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}")
    if resolve:
        cluster = _resolved(cluster, service, node_id)
    c, cfg = cluster.spec, cluster.cfg
    data = {k: v for k, v in msgspec.to_builtins(cfg).items() if k != "cluster"}
    data = _merge(data, _shared_overrides(cluster))
    if service == "scheduler":
        data = _merge(data, {"scheduler_service": {"host": c.scheduler_host or c.host,
                                                   "port": c.scheduler_port}})
    else:
        if node_id is None:
            raise ConfigError(f"service {service} needs --node (one of "
                              f"{', '.join(n.id for n in c.nodes)})")
        node = c.node(node_id)
        want = ROLE_SERVICE[node.role]
        if service != "gateway" and service != want:
            raise ConfigError(f"node {node_id!r} is a {node.role} node: it runs {want}, "
                              f"not {service}")
        data = _merge(data, _node_overrides(cluster, node, service, scheduler, gateway_port))
    return build_config(_drop_none(data), DualpathConfig, cluster.source, environ={})


def _resolved(cluster: Cluster, service: str, node_id: str | None) -> Cluster:
    """``cluster`` with this service's own bind/advertise host as an IP address."""
    c = cluster.spec
    if service == "scheduler":
        return cluster.with_overrides(cluster={"scheduler_host": ip_of(c.scheduler_host or c.host)})
    nodes = [msgspec.to_builtins(n) for n in c.nodes]
    for n in nodes:
        if n["id"] == node_id:
            n["host"] = ip_of(n.get("host") or c.host)
    return cluster.with_overrides(cluster={"nodes": nodes})


def ip_of(host: str) -> str:
    """``host`` as an IPv4 address (unchanged when it already is one or cannot resolve)."""
    try:
        socket.inet_aton(host)
        return host
    except OSError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _shared_overrides(cluster: Cluster) -> dict[str, Any]:
    c, cfg, raw = cluster.spec, cluster.cfg, cluster.data
    from common.kv import spec_from_config
    from services.compute_model.cost_model import cost_model

    spec = spec_from_config(cfg.kv)
    sched: dict[str, Any] = {}
    if "model" not in raw.get("scheduler", {}):
        sched["model"] = cfg.engine_sim.model or spec.name
    links = [c.storage_link(n) for n in c.nodes]
    if "snic_bytes_per_s" not in raw.get("scheduler", {}) and all(links):
        sched["snic_bytes_per_s"] = sum(links) / len(links)
    s = cfg.scheduler
    if c.time_scale != 1.0 and s.pe_tokens_per_s is None and s.beta_tokens is None:
        model = sched.get("model", s.model)
        rate = cost_model(model).prompt_tokens_per_s(s.ref_context_tokens, s.ref_append_tokens)
        sched["pe_tokens_per_s"] = rate / c.time_scale     # β follows the emulated GPU speed
    return {"scheduler": sched, "engine_sim": {"time_scale": c.time_scale},
            "rpc": {"host": c.host}, "transport": {"host": c.host},
            "gateway": {"root": str(c.storage_dir()),
                        "probe_on_miss": len(c.nodes) > 1 or cfg.gateway.probe_on_miss}}


def _node_overrides(cluster: Cluster, node: NodeSpec, service: str,
                    scheduler: tuple[str, int] | None, gateway_port: int | None) -> dict:
    c = cluster.spec
    host = c.node_host(node)
    out: dict[str, Any] = {"rpc": {"host": host}, "transport": {"host": host}}
    link = c.storage_link(node)
    if link:
        out["gateway"] = {"link_rate_bytes_per_s": link}
    cnic = c.compute_link(node)
    if cnic:
        out["arbiter"] = {"link_rate_bytes_per_s": cnic}
    if service != "gateway":
        sh, sp = scheduler or (c.scheduler_host or c.host, c.scheduler_port)
        out[service] = {"engines": c.engines(node), "host": host, "rpc_port": node.rpc_port,
                        "scheduler_host": sh, "scheduler_port": sp, "gateway_host": host,
                        "gateway_port": node.gateway_port if gateway_port is None
                        else gateway_port}
        if c.remote_engines:
            out[service]["engine_socket"] = engine_socket_path(cluster, node.id)
    return out


def engine_socket_path(cluster: Cluster, node_id: str) -> str:
    """Where node ``node_id`` serves its engines when ``[cluster] remote_engines`` is set."""
    return str((cluster.spec.state_dir() / f"{node_id}.engine.sock").resolve())


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _drop_none(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    if isinstance(d, list):
        return [_drop_none(v) for v in d]
    return d
