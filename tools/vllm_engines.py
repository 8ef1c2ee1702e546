"""vLLM instances in their own processes, driven by JSON lines (tests and ``bench engine``).

Each instance is ``integrations/vllm/engine_worker.py`` run by the vLLM venv's python
(``make vllm-env``); the main venv has no torch or vLLM. stderr goes to a log file whose tail
is shown when an instance dies.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

from tools.proc_group import end_group, group_files, private_ipc_env

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
WORKER = REPO / "integrations" / "vllm" / "engine_worker.py"
# The real-engine tests, the bench and demo-vllm serve the model in float32: in bf16 its greedy
# logits tie exactly (top-2 gap 0.0 measured at 2 of the 6 turns of the tests' conversation),
# so token-for-token equality with a plain instance would be decided by the last bit of any
# reordered computation — docs/vllm.md "Why the equality tests run fp32". The connector itself
# serves bf16 as well (tests/test_vllm_geometry.py checks bf16 KV against the model's own).
DTYPE = "float32"
PRESET = "smollm2-135m-f32"
# vLLM's CPU backend binds its OpenMP threads to core 0 by default ('auto' reserves the last
# core), so every instance would share one core: each role gets its own, where there are two
CORES = {"prefill": "0", "plain": "1", "decode": "1", "example": "1"}


def omp_bind(role: str) -> dict[str, str]:
    """The env that pins a role's vLLM threads (only where the cores exist; an operator's own
    ``VLLM_CPU_OMP_THREADS_BIND`` wins)."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or (os.cpu_count() or 1) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": CORES.get(role, "0"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def model_dir() -> Path | None:
    """The converted model's directory, or None when the venv or the model is missing."""
    if not VLLM_PYTHON.exists():
        return None
    out = subprocess.run([str(VLLM_PYTHON), "-m", "integrations.vllm.model_prep", "--print-dir"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    path = Path(out.stdout.strip()) if out.returncode == 0 else None
    return path if path is not None and (path / ".dualpath-converted").exists() else None


class Engine:
    """One engine_worker.py process: a JSON request line in, a JSON reply line out."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str, log_path: Path,
                 ipc_dir: str = "") -> None:
        self.proc, self.role, self.log_path = proc, role, log_path
        self.ipc_dir = ipc_dir          # its IPC socket directory, removed by stop()

    @classmethod
    async def start(cls, model: Path, role: str, log_dir: Path, *args: str) -> Engine:
        ipc_env = private_ipc_env()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO), **omp_bind(role),
                   **ipc_env)
        log_path = log_dir / f"vllm-{role}.log"
        with open(log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                str(VLLM_PYTHON), str(WORKER), "--role", role, "--model", str(model),
                "--dtype", DTYPE, "--preset", PRESET, *args,
                cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                limit=1 << 24, start_new_session=True)
        engine = cls(proc, role, log_path, ipc_env["VLLM_RPC_BASE_PATH"])
        try:
            await engine._expect_ready()
        except BaseException:
            await engine.stop()
            raise
        return engine

    @classmethod
    async def start_all(cls, specs: list[tuple[Path, str, Path, list[str]]]) -> list[Engine]:
        """Start several at once (loads overlap); on any failure stop the rest and raise."""
        started = await asyncio.gather(*(cls.start(m, r, d, *a) for m, r, d, a in specs),
                                       return_exceptions=True)
        engines = [e for e in started if isinstance(e, Engine)]
        errors = [e for e in started if not isinstance(e, Engine)]
        if errors:
            for e in engines:
                await e.stop()
            raise errors[0]
        return engines

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    async def _expect_ready(self) -> None:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 900)
            if not line:
                raise RuntimeError(f"vLLM {self.role} exited before READY:\n{self.log_tail()}")
            if line.strip() == b"READY":
                return

    async def generate(self, prompt: list[int], max_tokens: int,
                       dualpath: dict | None = None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                           "dualpath": dualpath}) + "\n").encode())
        await self.proc.stdin.drain()
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 300)
            if not line:
                raise RuntimeError(f"vLLM {self.role} died:\n{self.log_tail()}")
            if line.startswith(b"{"):
                return json.loads(line)

    def peak_rss_mb(self) -> float:
        """Peak RSS of the instance's process tree (its engine core and worker included)."""
        return sum(_hwm_kb(pid) for pid in _tree(self.proc.pid)) / 1024

    async def stop(self) -> None:
        """EOF on stdin ends the instance; then its whole process group goes (vLLM's engine
        core and worker outlive a killed parent otherwise) and the ``/dev/shm`` segments it
        left and its IPC socket directory (``tools.proc_group``), whether or not it was still
        running."""
        left_files = group_files(self.proc.pid) | ({self.ipc_dir} if self.ipc_dir else set())
        if self.proc.returncode is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 60)
            except TimeoutError:
                pass
        await end_group(self.proc.pid, left_files)
        await self.proc.wait()


def datapath_overrides(root: Path, buffer_mib: int = 192, **extra: dict) -> dict:
    """Config overrides of the in-process data path a vLLM pair attaches to: the model's KV
    preset, one engine per node on ``root``'s p0.sock / d0.sock, buffers sized for its blocks."""
    mib = 1 << 20
    out: dict = {
        "kv": {"preset": PRESET},
        "pe_receiver": {"buffer_bytes": buffer_mib * mib, "engines": 1,
                        "engine_socket": str(root / "p0.sock")},
        "de_loader": {"buffer_bytes": buffer_mib * mib, "engines": 1,
                      "engine_socket": str(root / "d0.sock")},
        "gateway_service": {"staging_bytes": 32 * mib, "max_batch_bytes": 8 * mib},
        # the in-process cluster shares the test's event loop with its HTTP clients beside
        # vLLM instances on 2 busy cores, where a loop stall can outlast the default 1 s
        # hit-lookup budget (a CI run: 3 lookups timed out and their turns planned hit 0; the
        # cause found there — probes queued behind bulk reads — is fixed in the gateway)
        "scheduler_service": {"hit_lookup_timeout_s": 10.0},
        # a page-transport handshake needs both of its ends progressed, here by that one loop:
        # a 7.5-s stall of it under CI's load (ci37) outlasted the default 5-s connect, and the
        # attempt failed over to a recompute
        "transport": {"connect_timeout_s": 30.0}}
    out.update(extra)
    return out


async def start_pd_plain(model: Path, root: Path) -> list[Engine]:
    """A prefill instance on p0's socket, a decode instance on d0's, and plain vLLM."""
    return await Engine.start_all([
        (model, "prefill", root, ["--socket", str(root / "p0.sock"), "--engine-id", "p0.e0"]),
        (model, "decode", root, ["--socket", str(root / "d0.sock"), "--engine-id", "d0.e0"]),
        (model, "plain", root, [])])


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _hwm_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def agent_text_tokens(model: Path, n_items: int = 90) -> list[int]:
    """Token ids of an agent-like tool-output text, tokenized with the model's tokenizer."""
    code = (
        "import json\nfrom transformers import AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({str(model)!r})\n"
        "text = ' '.join(f'Tool call {i}: read_file(\"src/pkg/mod_{i}.py\") returned {i*13} "
        f"lines; the function parse_{{i}} calls helper_{{i % 7}} with limit {{i*3}}.' "
        f"for i in range({n_items}))\n"
        "print(json.dumps(tok(text)['input_ids']))\n")
    out = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True,
                         timeout=300, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])
