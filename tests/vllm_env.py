"""Finding the vLLM venv and the converted model for the real-engine tests.

The main venv has neither torch nor vLLM: the tests start ``.venv-vllm/bin/python`` processes
(``make vllm-env vllm-model``). Without them a test SKIPS with the command that installs them —
and FAILS under ``CI=true``, so a green CI run means the real engine really ran.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import NoReturn

from tools.proc_group import end_group_blocking, group_files, private_ipc_env
from tools.vllm_engines import REPO, VLLM_PYTHON, model_dir
from tests import helpers


def skip_or_fail(reason: str) -> NoReturn:
    """The real engine is missing: the shared rule (tests.helpers), with the command to run."""
    helpers.skip_or_fail(f"real engine not tested: {reason} (run `make vllm-env vllm-model`)")


def require_vllm() -> tuple[Path, Path]:
    """``(python of .venv-vllm, converted model dir)``, or skip/fail with the reason."""
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} missing")
    model = model_dir()
    if model is None:
        skip_or_fail("the converted model is missing")
    assert model is not None
    return VLLM_PYTHON, model


def run_check(python: Path, *args: str, timeout: float = 1500,
              script: str = "geometry_check.py", with_log: bool = False) -> dict:
    """Run ``tests/vllm_checks/<script>`` in the vLLM venv; its RESULT line as a dict
    (``with_log``: plus its last warnings and errors under ``"log_tail"``, for a caller's
    failure message)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO), **private_ipc_env())
    proc = subprocess.Popen([str(python), str(REPO / "tests" / "vllm_checks" / script), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:                           # vLLM's engine processes outlive their parent otherwise
        end_group_blocking(proc.pid, group_files(proc.pid) | {env["VLLM_RPC_BASE_PATH"]},
                           grace_s=10.0)
        proc.wait()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"check {args[0]} failed (rc {proc.returncode}):\n{(stdout + stderr)[-4000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    if with_log:      # vLLM logs "WARNING", the connector's structlog "[warning  ]" (stdout)
        result["log_tail"] = [ln for ln in (stdout + stderr).splitlines()
                              if "warning" in ln.lower() or "error" in ln.lower()][-40:]
    return result
