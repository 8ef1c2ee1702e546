"""The ``[cluster]`` section: nodes, roles, emulated links, where state and storage live.

Imports only ``common.config.Section`` (like every section module), so the shared config root
may import it while it is itself being imported. Loading, validation across sections and
rendering per service: :mod:`tools.cluster.config`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from common.config import NonNegFloat, Port, PositiveFloat, PositiveInt, Section
from common.errors import ConfigError

Role = Literal["prefill", "decode"]
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class NodeSpec(Section):
    """One node: a storage gateway plus a PE receiver (prefill) or DE loader (decode)."""

    id: str
    role: Role
    engines: PositiveInt | None = None                   # None: cluster.engines_per_node
    host: str | None = None                              # None: cluster.host
    storage_link_bytes_per_s: NonNegFloat | None = None  # None: cluster default
    compute_link_bytes_per_s: NonNegFloat | None = None
    gateway_port: Port = 0                               # 0: any free port (local launcher)
    rpc_port: Port = 0                                   # the PE receiver's / DE loader's port
    metrics_port: Port | None = None                     # node service's Prometheus endpoint
    gateway_metrics_port: Port | None = None
    engine_port: Port = 0                                # [cluster] engine = "vllm": engine i's
                                                         # OpenAI server on engine_port + i (0: free)


class ClusterSection(Section):
    """``[cluster]``: shape, emulated hardware, where state and storage live."""

    name: str = "local-1p2d"
    host: str = "127.0.0.1"                      # bind + advertised address of every service
    data_dir: str = "data/cluster"               # <data_dir>/<name>/: state file, logs
    storage_root: str = ""                       # "": data/storage/<name> (shared by all gateways)
    engines_per_node: PositiveInt = 2
    remote_engines: bool = False                 # engines in their own processes, attached over
                                                 # <state_dir>/<node>.engine.sock (engine-api.md)
    time_scale: PositiveFloat = 1.0              # engine emulators: × every cost-model second
    slo_scale: PositiveFloat | None = None       # SLO thresholds × this (None: time_scale)
    storage_link_bytes_per_s: NonNegFloat = 0.0  # emulated SNIC per node; 0 = unlimited
    compute_link_bytes_per_s: NonNegFloat = 0.0  # emulated CNIC egress per node; 0 = unlimited
    scheduler_host: str | None = None            # None: host
    scheduler_port: int = 0
    scheduler_metrics_port: int | None = None
    metrics: bool = False                        # Prometheus endpoint per service (free ports)
    start_timeout_s: PositiveFloat = 60.0
    stop_grace_s: NonNegFloat = 5.0
    sim_config: str | None = None                # simulator config mirroring this cluster
    engine: Literal["emulator", "vllm"] = "emulator"  # vllm: `cluster up` starts a vLLM OpenAI
                                                 # server per engine socket + the front
                                                 # (tools/cluster/real_engines.py; docs/vllm.md)
    model: str = ""                              # engine = "vllm": "" = what make vllm-model made
    front_port: Port = 0                         # engine = "vllm": the OpenAI front (0: free)
    engine_start_timeout_s: PositiveFloat = 900.0  # a vLLM instance's load (1-2 min on 2 cores)
    vllm_prefix_caching: bool = True             # false: --no-enable-prefix-caching, every hit
                                                 # comes from dualpath's storage (HBM holds no
                                                 # context between turns: bench engine_agents)
    vllm_max_model_len: Annotated[int, msgspec.Meta(ge=256, le=131072)] = 2048
                                                 # each vLLM instance's --max-model-len; the
                                                 # front takes prompts up to 48 tokens less
    nodes: list[NodeSpec] = msgspec.field(default_factory=lambda: [
        NodeSpec(id="p0", role="prefill"), NodeSpec(id="d0", role="decode"),
        NodeSpec(id="d1", role="decode")])

    def __post_init__(self) -> None:
        # names, uniqueness and the cluster's shape; the per-field bounds are declared above
        # (and on NodeSpec) and checked at decode
        if not _ID_RE.fullmatch(self.name):
            raise ValueError(f"cluster.name {self.name!r} must be 1-64 characters of "
                             "letters, digits, '_', '.', '-'")
        self._check_nodes()
        if self.engine == "vllm" and not self.remote_engines:
            raise ValueError("cluster.engine = \"vllm\" needs cluster.remote_engines = true: "
                             "each vLLM instance attaches to its node's engine socket")

    def _check_nodes(self) -> None:
        seen: set[str] = set()
        for i, n in enumerate(self.nodes):
            where = f"cluster.nodes[{i}]"
            if not _ID_RE.fullmatch(n.id):
                raise ValueError(f"{where}.id {n.id!r} must be 1-64 characters of letters, "
                                 "digits, '_', '.', '-'")
            if n.id in seen or n.id == "scheduler":
                raise ValueError(f"{where}.id {n.id!r} is used twice (or reserved)")
            seen.add(n.id)
        roles = [n.role for n in self.nodes]
        if "prefill" not in roles or "decode" not in roles:
            raise ValueError(f"cluster.nodes needs at least one prefill and one decode node "
                             f"(got {roles.count('prefill')}P{roles.count('decode')}D): "
                             "the data path moves KV from a PE to a DE")

    # ------------------------------------------------------------------ helpers
    @property
    def prefill(self) -> list[NodeSpec]:
        return [n for n in self.nodes if n.role == "prefill"]

    @property
    def decode(self) -> list[NodeSpec]:
        return [n for n in self.nodes if n.role == "decode"]

    def node(self, node_id: str) -> NodeSpec:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise ConfigError(f"no node {node_id!r} in cluster {self.name!r}; nodes: "
                          f"{', '.join(n.id for n in self.nodes)}")

    def engines(self, n: NodeSpec) -> int:
        return n.engines if n.engines is not None else self.engines_per_node

    def node_host(self, n: NodeSpec) -> str:
        return n.host or self.host

    def storage_link(self, n: NodeSpec) -> float:
        return self.storage_link_bytes_per_s if n.storage_link_bytes_per_s is None \
            else n.storage_link_bytes_per_s

    def compute_link(self, n: NodeSpec) -> float:
        return self.compute_link_bytes_per_s if n.compute_link_bytes_per_s is None \
            else n.compute_link_bytes_per_s

    def metrics_port(self, service: str, node_id: str | None) -> int | None:
        """The fixed Prometheus port of ``service`` (on ``node_id``); None: none configured."""
        if service == "scheduler":
            return self.scheduler_metrics_port
        n = self.node(node_id or "")
        return n.gateway_metrics_port if service == "gateway" else n.metrics_port

    def rpc_port(self, service: str, node_id: str | None) -> int | None:
        """The fixed control port of ``service`` (on ``node_id``); None: none configured."""
        if service == "scheduler":
            return self.scheduler_port or None
        n = self.node(node_id or "")
        return (n.gateway_port if service == "gateway" else n.rpc_port) or None

    def service_host(self, service: str, node_id: str | None) -> str:
        """The address ``service`` (on ``node_id``) binds and is reached at."""
        if service == "scheduler":
            return self.scheduler_host or self.host
        return self.node_host(self.node(node_id or ""))

    @property
    def slo(self) -> float:
        return self.slo_scale if self.slo_scale is not None else self.time_scale

    @property
    def shape(self) -> str:
        return f"{len(self.prefill)}P{len(self.decode)}D"

    def state_dir(self) -> Path:
        return Path(self.data_dir) / self.name

    def storage_dir(self) -> Path:
        return Path(self.storage_root) if self.storage_root else Path("data/storage") / self.name
