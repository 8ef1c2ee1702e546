"""The CI host sampler (``tools.host_sampler``): it reads real PSI and per-process CPU, stops
on SIGTERM, and its summary keeps the worst ticks in time order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import wait_until
from tools import host_sampler

REPO = Path(__file__).resolve().parents[1]


def test_reads_this_process_and_the_pressure_totals():
    procs = host_sampler.process_cpu()
    name, ticks, majflt = procs[os.getpid()]
    assert name.startswith("python") or "pytest" in name
    assert ticks >= 0 and majflt >= 0
    assert "python" in host_sampler.command(os.getpid(), name)
    assert host_sampler.vm_counters()["pgmajfault"] >= 0
    cpu = host_sampler.cpu_times()
    assert cpu["user"] > 0 and "steal" in cpu
    psi = host_sampler.pressure_totals()
    if Path("/proc/pressure/cpu").exists():          # kernels without PSI: nothing to read
        assert psi["cpu_some"] >= 0 and "io_full" in psi


def test_summary_keeps_the_worst_ticks_in_time_order(tmp_path):
    rows = [{"t": f"10:00:{i:02d}", "late_s": 0.0, "span_s": 0.5, "load": 1.0,
             "stall_share": {"io_full": i / 100}, "top": [["etcd", 7, 0.1]]}
            for i in range(20)]
    rows[3]["late_s"] = 2.0                            # the sampler itself stalled
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = host_sampler.summary(path, 3).splitlines()
    assert lines[0].startswith("host sampler: 20 stalled-looking ticks; the 3 worst")
    assert [json.loads(x)["t"] for x in lines[1:]] == ["10:00:03", "10:00:18", "10:00:19"]
    assert "no samples" in host_sampler.summary(tmp_path / "missing", 3)


def test_runs_until_sigterm(tmp_path):
    out = tmp_path / "s.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tools.host_sampler", "--out", str(out),
                             "--interval", "0.05"], cwd=REPO)
    try:
        wait_until(lambda: out.exists(), timeout=30, what="sampler opened its file")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for line in out.read_text().splitlines():      # whatever it kept is well-formed
            assert set(json.loads(line)) >= {"t", "late_s", "stall_share", "top"}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = subprocess.run([sys.executable, "-m", "tools.host_sampler"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--out FILE" in bad.stderr
