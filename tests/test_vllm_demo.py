"""``dualpath demo --engine vllm`` (``make demo-vllm``) end to end, small: two agents, two
turns — real vLLM prefill and decode behind the front, every turn through dualpath and
recomputed; the demo's own checks (outputs equal) decide its exit code, and its JSON says
what it measured. The cluster is ``dualpath cluster up`` of ``configs/vllm-1p1d.toml``
(tools/cluster/real_engines.py): every service, both vLLM instances and the front are separate
processes, and none of the ``/dev/shm`` segments the instances mapped is left after they stop."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.vllm_env import require_vllm
from tools.vllm_engines import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_demo_vllm_runs_agents_through_dualpath_and_compares_with_recompute(tmp_path):
    require_vllm()
    out = subprocess.run([sys.executable, "-m", "tools.cli", "demo", "--engine", "vllm",
                          "--agents", "2", "--turns", "2", "--first-tokens", "600",
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=1100)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    res = json.loads((tmp_path / "demo-vllm.json").read_text())
    s = res["summary"]
    assert s["all_equal"] and s["requests"] == 4
    assert s["hit_rate_from_turn_2"] >= 0.85, s
    assert sum(s["read_sides"].values()) == 2                      # both turn-2 requests hit
    assert [r["hit"] for r in res["turns"] if r["turn"] == 0] == [0, 0]
    assert "TTFT dualpath s" in out.stdout
    procs = s["processes"]
    assert {"scheduler", "gateway:p0", "gateway:d0", "pe_receiver:p0", "de_loader:d0",
            "vllm:p0.e0", "vllm:d0.e0", "front"} <= set(procs), procs
    assert len(set(procs.values())) == len(procs)                  # one process each
    held = s["files_of_instances"]       # vLLM's /dev/shm queues and ZeroMQ IPC socket files
    assert any(f.startswith("/dev/shm/") for f in held), held
    assert any(not f.startswith("/dev/shm/") for f in held), held
    assert s["files_left_after_stop"] == []
