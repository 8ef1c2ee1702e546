"""``vllm serve`` instances with the DualPathConnector and the OpenAI front, as processes.

What an operator runs by hand (docs/vllm.md "The front"), started from the main venv for
``dualpath demo --engine vllm`` and tests/test_vllm_front.py: each process in its own session
(vLLM's engine core and worker outlive a killed parent otherwise, so stopping kills the group),
its output in a log file. The front prints ``READY <url>`` on stdout once it listens.

The command lines are rendered in one place (``vllm_server_argv``, ``front_argv``), so what an
operator copies is what the tests run: ``python -m tools.vllm_serve`` prints the runbook of
docs/vllm.md (every process of ``configs/vllm-1p1d.toml``), ``--unit-env NODE`` /
``--front-env`` the environment files of the systemd units, and the Kubernetes render
(``tools/cluster/kubernetes_vllm.py``) takes the same argv.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.proc_group import IPC_DIR_PREFIX, end_group, group_files, private_ipc_env
from tools.vllm_engines import CORES, DTYPE, PRESET, REPO, VLLM_PYTHON, omp_bind


def http(method: str, url: str, body: dict | bytes | None = None,
         timeout: float = 300) -> tuple[int, bytes]:
    """One blocking HTTP exchange: ``(status, body)`` (a 4xx/5xx is returned, not raised)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def ahttp(method: str, url: str, body: dict | bytes | None = None,
                timeout: float = 300) -> tuple[int, bytes]:
    return await asyncio.to_thread(http, method, url, body, timeout)


def healthy(url: str) -> bool:
    try:
        return http("GET", f"{url}/health", timeout=5)[0] == 200
    except OSError:
        return False


async def wait_healthy(urls, timeout_s: float = 900.0) -> None:
    """Until every vLLM server answers ``/health`` (a load is 20-40 s here), or TimeoutError."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    for url in urls:
        while not await asyncio.to_thread(healthy, url):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"vLLM at {url} not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(1.0)


# pid -> the IPC socket directory (tools.proc_group.private_ipc_env) of a process start()
# started: stop() removes it even when the process died first (its environment is gone then)
_IPC_DIRS: dict[int, str] = {}


async def start(args: list[str], env: dict, log_path: Path,
                pipe_stdout: bool = False) -> asyncio.subprocess.Process:
    """A process in its own group; its output goes to ``log_path`` (stdout piped for the
    front's READY line only: an unread pipe would block a chatty vLLM server)."""
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *args, cwd=REPO, env=env, stdout=subprocess.PIPE if pipe_stdout else log,
            stderr=log, limit=1 << 20, start_new_session=True)
    if Path(env.get("VLLM_RPC_BASE_PATH", "")).name.startswith(IPC_DIR_PREFIX):
        _IPC_DIRS[proc.pid] = env["VLLM_RPC_BASE_PATH"]
    return proc


# What the runbook's vLLM instances get, whatever the host (the tests' omp_bind drops the
# pinning on a one-core host or when the operator set their own)
KVCACHE_GIB = "1"


def kv_transfer_config(role: str, sock: str, engine_id: str) -> dict:
    """``--kv-transfer-config`` of an instance: kv_producer on a prefill node, kv_consumer on
    a decode node, attached to the node's engine socket as ``engine_id``."""
    return {"kv_connector": "DualPathConnector",
            "kv_connector_module_path": "integrations.vllm.connector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            # prefill "fail", decode "recompute": integrations/vllm/kv_spec.check_failure_policy
            "kv_load_failure_policy": "fail" if role == "prefill" else "recompute",
            "kv_connector_extra_config": {"source": "engine", "engine_socket": sock,
                                          "engine_id": engine_id, "kv_preset": PRESET,
                                          "layer_timeout_s": 30.0}}


def step_tokens(cfg: Any, max_model_len: int = 2048) -> int:
    """vLLM's token budget per step for a cluster config: the paper's 300 ms quota mapped by
    ``batching.vllm_budget`` at the scheduler's reference context (docs/vllm.md "The paper's
    300 ms quota as vLLM's budget"), at most ``max_model_len`` (a longer budget only allows
    steps no prompt fills)."""
    from services.compute_model.batching import vllm_budget
    from services.compute_model.cost_model import cost_model

    sched = cfg.scheduler
    budget = vllm_budget(cost_model(sched.model).attention_s, sched.ref_context_tokens)
    return min(budget["max_num_batched_tokens"], max_model_len)


def vllm_server_argv(python: str, model: str, role: str, sock: str, engine_id: str, port: int,
                     max_model_len: int = 2048, host: str = "127.0.0.1",
                     step: int | None = None, prefix_caching: bool = True,
                     kv_transfer: dict | None = None) -> list[str]:
    """The OpenAI server's command line: fp32 (the preset's dtype), vLLM's default prefix
    caching (on; ``prefix_caching`` False turns it off: every hit then comes from dualpath),
    chunked prefill with ``step`` tokens per step and per request's chunk (None:
    ``max_model_len``, one step per prompt; the runbook's: :func:`step_tokens`), the
    DualPathConnector on ``sock`` (``kv_transfer``: another ``--kv-transfer-config``, e.g.
    vLLM's ExampleConnector, the peer row of ``bench engine``)."""
    step = max_model_len if step is None else step
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            *([] if prefix_caching else ["--no-enable-prefix-caching"]),
            "--port", str(port), "--host", host, "--max-model-len", str(max_model_len),
            "--enforce-eager", "--dtype", DTYPE, "--enable-chunked-prefill",
            "--max-num-batched-tokens", str(step), "--long-prefill-token-threshold", str(step),
            "--gpu-memory-utilization", "0.2",
            "--kv-transfer-config",
            json.dumps(kv_transfer or kv_transfer_config(role, sock, engine_id))]


# a prompt the front takes leaves this many of the instances' --max-model-len to generate
PROMPT_HEADROOM = 48


def front_argv(python: str, model: str, scheduler: str, urls: dict[str, str],
               model_name: str = "smollm2", timeout_s: float = 900.0,
               port: int | None = None, host: str | None = None,
               max_model_len: int = 2048, etcd: Sequence[str] = (),
               etcd_prefix: str = "/dualpath") -> list[str]:
    """The front's command line over the scheduler and each engine's URL (``port`` None:
    any free port, printed on its READY line; ``host`` None: loopback); prompts up to the
    instances' ``max_model_len`` less :data:`PROMPT_HEADROOM` (the front's default at 2048).
    With ``etcd`` endpoints the front follows the elected scheduler leader there
    (``scheduler`` is then only the first address it knows)."""
    longer = max_model_len != 2048
    return [python, "-m", "integrations.vllm.front", "--model-name", model_name,
            "--tokenizer", model, "--scheduler", scheduler, "--request-timeout-s",
            str(timeout_s), *[a for e, u in urls.items() for a in ("--engine", f"{e}={u}")],
            *(["--port", str(port)] if port is not None else []),
            *(["--host", host] if host is not None else []),
            *(["--max-prompt-tokens", str(max_model_len - PROMPT_HEADROOM)] if longer else []),
            *(["--etcd", ",".join(etcd), "--etcd-prefix", etcd_prefix] if etcd else [])]


async def vllm_server(model: Path, role: str, sock: str, engine_id: str, port: int,
                      log_dir: Path, max_model_len: int = 2048,
                      step: int | None = None) -> asyncio.subprocess.Process:
    """``vllm serve`` (the OpenAI server) with the DualPathConnector attached to a node's
    engine socket: kv_producer on a prefill node, kv_consumer on a decode node."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=KVCACHE_GIB, PYTHONPATH=str(REPO),
               **omp_bind(role), **private_ipc_env())        # removed by stop()
    return await start(vllm_server_argv(str(VLLM_PYTHON), str(model), role, sock, engine_id,
                                        port, max_model_len, step=step), env,
                       log_dir / f"vllm-{role}-{engine_id}.log")


async def front(model: Path, scheduler_port: int, urls: dict[str, str], log_dir: Path,
                model_name: str = "smollm2", timeout_s: float = 900.0
                ) -> tuple[asyncio.subprocess.Process, str]:
    """The front (``python -m integrations.vllm.front``) over the scheduler and the engines'
    URLs; ``(process, its URL)`` once it printed READY."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = await start(front_argv(str(VLLM_PYTHON), str(model), f"127.0.0.1:{scheduler_port}",
                                  urls, model_name, timeout_s), env,
                       log_dir / "front.log", pipe_stdout=True)
    try:
        return proc, await ready_line(proc)
    except BaseException:
        await stop(proc)
        raise


async def stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the server, then its whole group, the ``/dev/shm`` it left and its IPC
    socket directory (``tools.proc_group.end_group``)."""
    own_dir = _IPC_DIRS.pop(proc.pid, None)
    left_files = group_files(proc.pid) | ({own_dir} if own_dir else set())
    if proc.returncode is None:
        proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 60)
    await end_group(proc.pid, left_files)
    await proc.wait()


async def ready_line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), 300)
        if not line:
            raise RuntimeError("front exited before READY")
        if line.startswith(b"READY "):
            return line.decode().split()[1]


async def tokenize(url: str, model: str, text: str) -> list[int]:
    """Token ids of ``text`` by a vLLM server's own tokenizer (``/tokenize``)."""
    status, raw = await ahttp("POST", f"{url}/tokenize", {"model": model, "prompt": text})
    if status != 200:
        raise RuntimeError(f"/tokenize at {url} answered {status}: {raw[:200]!r}")
    return list(json.loads(raw)["tokens"])


# ----------------------------------------------------------------------- the operator's runbook

RUNBOOK_CONFIG = "configs/vllm-1p1d.toml"
VLLM_PORTS = {"prefill": 8001, "decode": 8002}   # a node without [[cluster.nodes]] engine_port
FRONT_PORT = 8000
MODEL_VAR = "$MODEL"


def runbook(config: str = RUNBOOK_CONFIG) -> str:
    """Every process of a real-engine cluster, one shell line each, run from the repository
    root: what docs/vllm.md "Runbook" shows (tests/test_vllm_runbook.py holds the two equal).
    The vLLM and front lines are the argv the tests start (``vllm_server_argv``,
    ``front_argv``), with the model directory as ``$MODEL`` and the relative venv path."""
    from tools.cluster.config import load_cluster

    loaded = load_cluster(REPO / config, environ={})
    spec = loaded.spec
    step, max_len = step_tokens(loaded.cfg, spec.vllm_max_model_len), spec.vllm_max_model_len
    py = ".venv-vllm/bin/python"
    lines = [f"dualpath serve scheduler -c {config}"]
    lines += [f"dualpath serve gateway -c {config} --node {n.id}" for n in spec.nodes]
    lines += [f"dualpath serve node -c {config} --node {n.id}" for n in spec.nodes]
    urls: dict[str, str] = {}
    for n in spec.nodes:
        sock = str(spec.state_dir() / f"{n.id}.engine.sock")
        engine, port = f"{n.id}.e0", instance_port(n)
        urls[engine] = f"http://127.0.0.1:{port}"
        env = {"VLLM_CPU_KVCACHE_SPACE": KVCACHE_GIB, "PYTHONPATH": ".",
               "VLLM_CPU_OMP_THREADS_BIND": CORES[n.role], "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        argv = vllm_server_argv(py, MODEL_VAR, n.role, sock, engine, port, max_len,
                                step=step, prefix_caching=spec.vllm_prefix_caching)
        lines.append(" ".join([*(f"{k}={v}" for k, v in env.items()), *map(_quote, argv)]))
    scheduler = f"{spec.scheduler_host or spec.host}:{spec.scheduler_port}"
    lines.append("PYTHONPATH=. " + " ".join(map(_quote, front_argv(py, MODEL_VAR, scheduler,
                                                                     urls, port=FRONT_PORT,
                                                                     max_model_len=max_len))))
    return "\n".join(lines) + "\n"


def instance_port(node: Any) -> int:
    """The port of a node's (first) vLLM instance: its ``engine_port``, else the role's."""
    return int(node.engine_port) or VLLM_PORTS[node.role]


def _quote(word: str) -> str:
    """shlex quoting that leaves ``$MODEL`` for the shell to expand."""
    return word if word == MODEL_VAR else shlex.quote(word)


def unit_env(node_id: str, config: str = RUNBOOK_CONFIG, root: str = "/var/lib/dualpath",
             model: str = "/opt/dualpath/models/smollm2-135m-0.1.2") -> str:
    """``/etc/dualpath/vllm-<node>.env`` of ``deploy/systemd/dualpath-vllm@.service``: the
    per-instance values its ``ExecStart`` leaves open (port, connector config on the node's
    socket under the node service's working directory ``root``, core binding) for the
    runbook's instance of ``node_id``."""
    from tools.cluster.config import load_cluster

    spec = load_cluster(REPO / config, environ={}).spec
    node = next((n for n in spec.nodes if n.id == node_id), None)
    if node is None:
        raise SystemExit(f"{config}: no node {node_id!r}")
    sock = str(Path(root) / spec.state_dir() / f"{node.id}.engine.sock")
    ktc = json.dumps(kv_transfer_config(node.role, sock, f"{node.id}.e0"))
    env = {"DUALPATH_MODEL": model, "VLLM_PORT": str(instance_port(node)),
           "KV_TRANSFER_CONFIG": ktc, "VLLM_CPU_KVCACHE_SPACE": KVCACHE_GIB,
           "VLLM_CPU_OMP_THREADS_BIND": CORES[node.role], "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    head = (f"# /etc/dualpath/vllm-{node.id}.env: dualpath-vllm@{node.id}.service "
            f"(`python -m tools.vllm_serve --unit-env {node.id}`)\n")
    # single quotes: systemd's EnvironmentFile parser would strip the JSON's double quotes
    return head + "".join(f"{k}='{v}'\n" if '"' in v else f"{k}={v}\n"
                          for k, v in env.items())


def front_env(config: str = RUNBOOK_CONFIG,
              model: str = "/opt/dualpath/models/smollm2-135m-0.1.2") -> str:
    """``/etc/dualpath/front.env`` of ``deploy/systemd/dualpath-front.service``: the model
    and one ``--engine`` per instance of the runbook (the scheduler's address is
    ``DUALPATH_SCHEDULER`` of /etc/dualpath/env)."""
    from tools.cluster.config import load_cluster

    spec = load_cluster(REPO / config, environ={}).spec
    engines = " ".join(f"--engine {n.id}.e0=http://127.0.0.1:{instance_port(n)}"
                       for n in spec.nodes)
    return ("# /etc/dualpath/front.env: dualpath-front.service "
            "(`python -m tools.vllm_serve --front-env`)\n"
            f"DUALPATH_MODEL={model}\nDUALPATH_FRONT_ENGINES={engines}\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="print the real-engine runbook (docs/vllm.md) "
                                 "or a vLLM / front unit's environment file")
    ap.add_argument("--unit-env", metavar="NODE", help="dualpath-vllm@NODE's env file")
    ap.add_argument("--front-env", action="store_true", help="dualpath-front's env file")
    ap.add_argument("-c", "--config", default=RUNBOOK_CONFIG)
    ap.add_argument("--root", default="/var/lib/dualpath",
                    help="the node service's working directory (its socket's base)")
    ap.add_argument("--model", default="/opt/dualpath/models/smollm2-135m-0.1.2",
                    help="the converted model's directory (model_prep --print-dir)")
    a = ap.parse_args(argv)
    if a.unit_env:
        print(unit_env(a.unit_env, a.config, a.root, a.model), end="")
    elif a.front_env:
        print(front_env(a.config, a.model), end="")
    else:
        print(runbook(a.config), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
