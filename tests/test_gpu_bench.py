"""``dualpath bench gpu``'s plumbing without a GPU: ``--host-dry-run`` runs every phase with
host arrays (two processes, the transport, the byte check, the JSON), and without cupy or a
device the benchmark says so and exits 2 instead of measuring nothing as if it had."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.transport.plan import cuda_available

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", "bench", "gpu", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_host_dry_run_moves_and_verifies_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    done = bench("--host-dry-run", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["results"]["rows"]
    assert [r["row"] for r in rows] == ["gpu->gpu", "host->gpu", "pinned->gpu", "gpu->host",
                                        "host->gpu unstaged", "gpu->gpu runs", "host->gpu runs"]
    assert [r["slot_gap_bytes"] > 0 for r in rows] == [True] * 5 + [False] * 2
    assert all(r["verified_bytes"] == r["bytes"] > 0 and r["gbps_best"] > 0 for r in rows)
    # the staged rows come from the sender that says host memory, the others from the one
    # that says device memory; host arenas (all of a dry run's) never stage
    assert [r["sender"] for r in rows] == ["device", "host", "host", "device", "device",
                                           "device", "host"]
    assert all(r["staged_messages"] == 0 for r in rows)
    assert doc["results"]["dry_run"] and doc["headline"]["metric"] == "gpu_to_gpu_vs_memcpy"


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is here: the benchmark would run")
def test_without_a_gpu_it_says_so_and_exits_2():
    done = bench("--quick")
    assert done.returncode == 2 and "no CUDA device" in done.stderr
