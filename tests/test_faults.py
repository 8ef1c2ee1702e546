"""Failpoints (common.faults): parsing, firing on the N-th hit, and a no-op when unarmed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from common import faults
from common.errors import ConfigError, Unavailable


@pytest.fixture(autouse=True)
def _disarm():
    yield
    faults.arm("")


def test_unarmed_is_a_noop():
    faults.arm("")
    for _ in range(1000):
        faults.failpoint("de.read.batch")
    assert faults.fired("de.read.batch") == 0


def test_parse_actions_and_hits():
    pts = faults.parse("de.read.batch=kill@2; pe.handoff.send=stop ;gw.read=delay:0.25@3;"
                       "de.writeback=error")
    assert {n: (p.action, p.at) for n, p in pts.items()} == {
        "de.read.batch": ("kill", 2), "pe.handoff.send": ("stop", 1),
        "gw.read": ("delay", 3), "de.writeback": ("error", 1)}
    assert pts["gw.read"].delay_s == 0.25


@pytest.mark.parametrize("spec, words", [
    ("de.read.batch", "NAME=ACTION"),
    ("no.such.point=kill", "unknown failpoint"),
    ("de.read.batch=explode", "unknown action"),
    ("de.read.batch=kill@0", "@N"),
    ("de.read.batch=kill@x", "@N"),
    ("de.read.batch=delay:abc", "delay needs seconds"),
    ("de.read.batch=kill:3", "takes no argument"),
    ("de.read.batch=kill;de.read.batch=stop", "armed twice"),
])
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(ConfigError, match=words):
        faults.parse(spec)


def test_error_fires_once_on_the_nth_hit():
    faults.arm("de.writeback=error@3")
    faults.failpoint("de.writeback")
    faults.failpoint("de.writeback")
    with pytest.raises(Unavailable) as e:
        faults.failpoint("de.writeback")
    assert e.value.retryable
    faults.failpoint("de.writeback")          # once only
    assert faults.fired("de.writeback") == 1
    faults.failpoint("gw.read")               # other points untouched


def _child(env_spec: str, body: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from common import faults
        faults.check_env()
        {body}
    """)
    env = {**os.environ, faults.ENV: env_spec, **(extra_env or {})}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)


def test_kill_action_sigkills_the_process_at_the_nth_hit():
    r = _child("gw.read=kill@2", "faults.failpoint('gw.read'); print('first', flush=True); "
               "faults.failpoint('gw.read'); print('survived', flush=True)")
    assert r.returncode == -signal.SIGKILL
    assert "first" in r.stdout and "survived" not in r.stdout
    assert "FAILPOINT gw.read kill (hit 2)" in r.stderr


def test_bad_env_is_reported_by_check_env():
    r = _child("gw.read=boom", "print('started')")
    assert r.returncode != 0 and "unknown action" in r.stderr


def test_serve_refuses_a_bad_spec(tmp_path):
    env = {**os.environ, faults.ENV: "nope=kill"}
    r = subprocess.run([sys.executable, "-m", "tools.cluster.serve", "gateway", "--node", "p0"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown failpoint" in r.stderr


def test_sigusr1_rearms_from_the_file(tmp_path):
    spec = tmp_path / "fp"
    spec.write_text("")
    body = textwrap.dedent("""
        import os, signal
        faults.failpoint('de.decode')
        open(os.environ['DUALPATH_FAILPOINTS_FILE'], 'w').write('de.decode=error')
        os.kill(os.getpid(), signal.SIGUSR1)
        try:
            faults.failpoint('de.decode')
        except Exception as e:
            print('raised', type(e).__name__)
    """).replace("\n", "\n        ")
    r = _child("", body, {faults.FILE_ENV: str(spec)})
    assert r.returncode == 0, r.stderr
    assert "raised Unavailable" in r.stdout


def test_partition_fails_every_hit_until_it_heals(monkeypatch):
    now = {"t": 100.0}
    monkeypatch.setattr(faults.time, "monotonic", lambda: now["t"])
    faults.arm("node.sched.call=partition:2@2")
    faults.failpoint("node.sched.call")                  # hit 1: before the partition
    for _ in range(3):                                   # from hit 2, for 2 s: every call fails
        with pytest.raises(Unavailable, match="partitioned"):
            faults.failpoint("node.sched.call")
    now["t"] = 102.5                                     # healed
    faults.failpoint("node.sched.call")
    assert faults.fired("node.sched.call") == 1


async def test_latency_delays_every_awaited_hit_until_disarmed(monkeypatch):
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)
    import asyncio
    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    faults.arm("gw.read=latency:0.3@2")
    for _ in range(4):
        await faults.afailpoint("gw.read")
    assert slept == [0.3, 0.3, 0.3] and faults.fired("gw.read") == 1
    faults.arm("")                                       # the disk is fast again
    await faults.afailpoint("gw.read")
    assert len(slept) == 3


def test_timed_actions_need_seconds():
    with pytest.raises(ConfigError, match="partition needs seconds"):
        faults.parse("node.sched.call=partition")
