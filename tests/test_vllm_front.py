"""The OpenAI-compatible front over a real dualpath cluster and real vLLM servers.

An in-process dualpath cluster with its scheduler (policy ``dualpath``: the scheduler chooses
the read side), two ``vllm serve`` processes with the DualPathConnector (prefill attached to
the PE receiver, decode to the DE loader) and the front (``python -m integrations.vllm.front``),
all from .venv-vllm. A multi-turn agent conversation over HTTP: greedy output of every turn
equals the prefill server's own output for the same prompt without dualpath (a request without
``kv_transfer_params`` runs as plain vLLM there: prefix caching off, connector idle — the
strictly separate plain instance is tests/test_vllm_dualpath.py's reference); from turn 2 the
dualpath hit is >= 90 % of the prompt. Bad requests get OpenAI-shaped 4xx errors and the front
keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.helpers import until
from tests.test_engine_ipc import sockets
from bench.vllm_engines import DTYPE, PRESET, kill_group, omp_bind
from tests.vllm_env import REPO, require_vllm
from tools.cluster.inprocess import local_datapath

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

MiB = 1 << 20
TURNS = 6
GEN = 16
# an agent's turns: a long context, short appends (tool results); from turn 2 the hit is every
# full block of the previous prompt + output, >= 90 % of the prompt once appends stay < ~60
# tokens; turn 6 reaches 1,250 + 5 x (16 + 40) + 16 = 1,546 tokens of context
FIRST = 1250
APPEND = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | bytes | None = None, timeout: float = 300):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def ahttp(method: str, url: str, body=None, timeout: float = 300):
    return await asyncio.to_thread(http, method, url, body, timeout)


async def start(args: list[str], env: dict, log_path, pipe_stdout: bool = False
                ) -> asyncio.subprocess.Process:
    """A process in its own group; its output goes to ``log_path`` (stdout piped for the
    front's READY line only: an unread pipe would block a chatty vLLM server)."""
    with open(log_path, "wb") as log:
        return await asyncio.create_subprocess_exec(
            *args, cwd=REPO, env=env, stdout=subprocess.PIPE if pipe_stdout else log,
            stderr=log, limit=1 << 20, start_new_session=True)


async def vllm_server(python, model, role: str, sock: str, engine_id: str, port: int, log_dir):
    ktc = {"kv_connector": "DualPathConnector",
           "kv_connector_module_path": "integrations.vllm.connector",
           "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"source": "engine", "engine_socket": sock,
                                         "engine_id": engine_id, "kv_preset": PRESET,
                                         "layer_timeout_s": 30.0}}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO), **omp_bind(role))
    return await start([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                        str(model), "--port", str(port), "--host", "127.0.0.1",
                        "--max-model-len", "2048", "--enforce-eager", "--dtype", DTYPE,
                        "--no-enable-prefix-caching", "--max-num-batched-tokens", "2048",
                        "--gpu-memory-utilization", "0.2",
                        "--kv-transfer-config", json.dumps(ktc)], env,
                       log_dir / f"vllm-{role}.log")


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 60)
    kill_group(proc.pid)                  # vLLM's engine processes outlive their parent otherwise
    await proc.wait()


async def ready_line(proc) -> str:
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), 300)
        if not line:
            raise AssertionError("front exited before READY")
        if line.startswith(b"READY "):
            return line.decode().split()[1]


async def test_front_multi_turn_agent_over_http(tmp_path):
    python, model = require_vllm()
    overrides = {**sockets(tmp_path), "kv": {"preset": PRESET},
                 "scheduler": {"model": PRESET, "policy": "dualpath"},
                 "pe_receiver": {"buffer_bytes": 192 * MiB, "engines": 1,
                                 "engine_socket": str(tmp_path / "p0.sock")},
                 "de_loader": {"buffer_bytes": 192 * MiB, "engines": 1,
                               "engine_socket": str(tmp_path / "d0.sock")},
                 "gateway_service": {"staging_bytes": 32 * MiB, "max_batch_bytes": 8 * MiB}}
    async with local_datapath(tmp_path, engines=False, overrides=overrides) as c:
        ports = {"p0.e0": free_port(), "d0.e0": free_port()}
        procs = [await vllm_server(python, model, "prefill", str(tmp_path / "p0.sock"), "p0.e0",
                                   ports["p0.e0"], tmp_path),
                 await vllm_server(python, model, "decode", str(tmp_path / "d0.sock"), "d0.e0",
                                   ports["d0.e0"], tmp_path)]
        try:
            urls = {e: f"http://127.0.0.1:{p}" for e, p in ports.items()}
            for url in urls.values():
                await until(lambda url=url: _healthy(url), timeout=900, interval=1.0,
                            what=f"vLLM at {url} healthy")
            env = dict(os.environ, PYTHONPATH=str(REPO))
            front_proc = await start(
                [str(python), "-m", "integrations.vllm.front", "--model-name", "smollm2",
                 "--tokenizer", str(model), "--scheduler", f"127.0.0.1:{c.scheduler.port}",
                 "--request-timeout-s", "900",
                 *[a for e, u in urls.items() for a in ("--engine", f"{e}={u}")]], env,
                tmp_path / "front.log", pipe_stdout=True)
            procs.append(front_proc)
            front = await ready_line(front_proc)
            await check_plain_endpoints(front)
            await check_bad_requests(front)
            await conversation(front, urls["p0.e0"], str(model))
        finally:
            for p in procs:
                await stop(p)


def _healthy(url: str) -> bool:
    try:
        return http("GET", f"{url}/health", timeout=5)[0] == 200
    except OSError:
        return False


async def check_plain_endpoints(front: str) -> None:
    status, body = await ahttp("GET", f"{front}/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "smollm2"
    assert (await ahttp("GET", f"{front}/health"))[0] == 200
    status, body = await ahttp("GET", f"{front}/metrics")
    assert status == 200 and b"dualpath_front_requests" in body


async def check_bad_requests(front: str) -> None:
    cases = [(b"{not json", 400, "invalid_body"),
             ({"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
             ({"model": "smollm2", "prompt": list(range(2500))}, 400, "prompt_too_long"),
             ({"model": "smollm2", "prompt": [10**9]}, 400, "invalid_body"),
             ({"model": "smollm2", "prompt": "hi", "max_tokens": 0}, 400, "invalid_max_tokens")]
    for body, status, code in cases:
        got, raw = await ahttp("POST", f"{front}/v1/completions", body)
        assert (got, json.loads(raw)["error"]["code"]) == (status, code), raw


async def conversation(front: str, plain_url: str, model: str) -> None:
    text = " ".join(f"Observation {i}: ls src/{i} shows {i * 3} files; grep finds TODO in "
                    f"item_{i}.py line {i * 11}." for i in range(160))
    ids = await tokenize(plain_url, model, text)
    assert len(ids) > FIRST + TURNS * APPEND
    head = text[:400]                               # a text prompt, tokenized by the front
    status, raw = await ahttp("POST", f"{front}/v1/completions",
                              {"model": "smollm2", "prompt": head, "max_tokens": 4})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["prompt_tokens"] == len(await tokenize(plain_url, model, head))
    prompt, cursor = ids[:FIRST], FIRST
    for turn in range(TURNS):
        status, raw = await ahttp("POST", f"{front}/v1/completions",
                                  {"model": "smollm2", "prompt": prompt, "max_tokens": GEN,
                                   "session_id": "agent-1"})
        assert status == 200, raw
        got = json.loads(raw)
        status, raw = await ahttp("POST", f"{plain_url}/v1/completions",
                                  {"model": model, "prompt": prompt, "max_tokens": GEN,
                                   "temperature": 0.0, "return_token_ids": True})
        ref = json.loads(raw)["choices"][0]["token_ids"]
        dp = got["dualpath"]
        assert dp["token_ids"] == ref, f"turn {turn}: front output != plain vLLM"
        if turn > 0:
            assert dp["hit_tokens"] >= 0.9 * len(prompt), f"turn {turn}: {dp}"
            assert dp["read_side"] in ("pe", "de")
        prompt = prompt + dp["token_ids"] + ids[cursor:cursor + APPEND]
        cursor += APPEND


async def tokenize(url: str, model: str, text: str) -> list[int]:
    status, raw = await ahttp("POST", f"{url}/tokenize", {"model": model, "prompt": text})
    assert status == 200, raw
    return json.loads(raw)["tokens"]
