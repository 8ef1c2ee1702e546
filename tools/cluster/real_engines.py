"""Real engines for ``dualpath cluster up``: a vLLM OpenAI server per engine socket, then the
front — separate processes beside the node services (``[cluster] engine = "vllm"``).

The launcher (:mod:`.launcher`) starts the gateways, the scheduler and the node services (each
node serving its engines on ``<state_dir>/<node>.engine.sock``), then asks this module for the
command lines of

1. one vLLM instance per engine of each node (``<node>.e<i>``): the runbook's argv
   (``tools.vllm_serve.vllm_server_argv``: fp32 as the preset, prefix caching on, chunked
   prefill at the config's budget ``step_tokens``), kv_producer on a prefill node, kv_consumer
   on a decode node, on ``engine_port`` (+ i) of the node or any free port;
2. the front (``python -m integrations.vllm.front``) over the scheduler and every instance's
   URL, on ``[cluster] front_port`` (0: any free port; it prints ``READY <url>`` in its log).

Readiness is observable, never a sleep: an instance is ready when ``GET /health`` answers 200,
the front when its log carries the READY line.

Stopping: vLLM runs its engine core in child processes (and the front none), so the launcher
signals the whole process group of these services (each started in its own session). vLLM's
message queues live in ``/dev/shm/psm_*`` segments that a killed instance leaves behind (160–
240 MiB each were found after hand-run clusters), and its ZeroMQ IPC socket files in
``$TMPDIR`` are left even by a clean stop: before stopping, :func:`group_files` notes every
``/dev/shm`` file the group maps and every socket file it is bound to; after,
:func:`remove_files` unlinks those still present that no live process uses — only files our
own processes held, owned by us (:mod:`tools.proc_group`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError

from .config import Cluster, engine_socket_path, free_port

_READY = re.compile(r"^READY (http://\S+)\s*$", re.M)


@dataclass(frozen=True)
class Command:
    """One process to start: its launcher name, service kind, argv, extra env (the vLLM venv's
    python finds our connector on ``PYTHONPATH``), URL (None for the front until its READY
    line)."""

    name: str
    service: str                 # "vllm" | "front"
    node: str
    argv: list[str]
    env: dict[str, str]
    url: str | None


def resolve_model(cluster: Cluster) -> Path:
    """The model the instances serve: ``[cluster] model``, or what ``make vllm-model``
    prepared; ConfigError naming the fix when the vLLM venv or the model is missing."""
    from tools.vllm_engines import VLLM_PYTHON, model_dir

    if not VLLM_PYTHON.exists():
        raise ConfigError(f"{cluster.source}: [cluster] engine = \"vllm\" needs the vLLM venv "
                          f"({VLLM_PYTHON}): run `make vllm-env vllm-model`")
    configured = cluster.spec.model
    model = Path(configured) if configured else model_dir()
    if model is None or not model.is_dir():
        raise ConfigError(f"{cluster.source}: no model directory "
                          f"({configured or 'the prepared SmolLM2'}): run `make vllm-model` or "
                          "set [cluster] model")
    return model.resolve()


def instance_commands(cluster: Cluster, model: Path,
                      ports: dict[str, int] | None = None) -> list[Command]:
    """One vLLM OpenAI server per engine of every node, attached to the node's socket
    (``ports``: engine id -> the port it must have, e.g. the one it had before a restart)."""
    from tools.vllm_engines import REPO, VLLM_PYTHON, omp_bind
    from tools.vllm_serve import KVCACHE_GIB, step_tokens, vllm_server_argv

    spec = cluster.spec
    step = step_tokens(cluster.cfg, spec.vllm_max_model_len)
    out = []
    for n in spec.nodes:
        sock = engine_socket_path(cluster, n.id)
        for i in range(spec.engines(n)):
            engine = f"{n.id}.e{i}"
            port = (ports or {}).get(engine) or (n.engine_port + i if n.engine_port
                                                 else free_port())
            host = spec.node_host(n)
            argv = vllm_server_argv(str(VLLM_PYTHON), str(model), n.role, sock, engine, port,
                                    spec.vllm_max_model_len, host=host, step=step,
                                    prefix_caching=spec.vllm_prefix_caching)
            env = {"VLLM_CPU_KVCACHE_SPACE": KVCACHE_GIB, "PYTHONPATH": str(REPO),
                   **omp_bind(n.role)}
            out.append(Command(f"vllm:{engine}", "vllm", n.id, argv, env,
                               f"http://{host}:{port}"))
    return out


def front_command(cluster: Cluster, model: Path, scheduler: tuple[str, int],
                  instances: dict[str, str], port: int | None = None) -> Command:
    """The OpenAI front over the scheduler and ``instances`` (engine id -> URL), on ``port``
    (None: ``[cluster] front_port``); in etcd mode (``[etcd] endpoints``) it follows the
    elected scheduler leader there, as the node services do."""
    from tools.vllm_engines import REPO, VLLM_PYTHON
    from tools.vllm_serve import front_argv

    spec, etcd = cluster.spec, cluster.cfg.etcd
    argv = front_argv(str(VLLM_PYTHON), str(model), f"{scheduler[0]}:{scheduler[1]}",
                      instances, port=spec.front_port if port is None else port,
                      host=spec.host, max_model_len=spec.vllm_max_model_len,
                      etcd=etcd.endpoints, etcd_prefix=etcd.prefix)
    return Command("front", "front", "front", argv, {"PYTHONPATH": str(REPO)}, None)


def url_port(url: str) -> int:
    """The port of ``http://host:port``."""
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def front_url(log: str | Path) -> str | None:
    """The URL of the front's latest READY line in its log, None before it."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return None
    found = _READY.findall(text.rsplit("\n==== ", 1)[-1])
    return found[-1] if found else None


def on_loopback(config: str | Path, root: Path, mode: str | None = None,
                sections: dict[str, dict[str, Any]] | None = None, **cluster: Any) -> Cluster:
    """``config`` (a real-engine cluster file) with every fixed port made 0 (any free port) and
    its state and storage under ``root``, ``cluster`` set in its ``[cluster]`` section, the
    values of ``sections`` (section -> values) in theirs, and ablation ``mode`` (the
    scheduler's policy, ``dualpath plan``'s modes) applied: the demo's, the tests' and the
    benches' copy, which must not collide with an operator's cluster (or another test) on the
    file's fixed ports."""
    from common.config import read_toml

    from .config import load_data

    data = read_toml(config, "cluster config")
    sect = data.setdefault("cluster", {})
    for key in ("scheduler_port", "scheduler_metrics_port", "front_port"):
        sect.pop(key, None)
    for node in sect.get("nodes", []):
        for key in ("gateway_port", "rpc_port", "metrics_port", "gateway_metrics_port",
                    "engine_port"):
            node.pop(key, None)
    sect["data_dir"], sect["storage_root"] = str(root / "cluster"), str(root / "storage")
    sect.update(cluster)
    for section, values in (sections or {}).items():
        data.setdefault(section, {}).update(values)
    return load_data(data, str(config), mode=mode, environ={})
