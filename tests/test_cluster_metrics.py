"""common.metrics: sources snapshotted on the loop, standard families, histograms, endpoint."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client import generate_latest

from common import metrics
from common.protocol import RequestFinished
from tests.helpers import until


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


async def test_endpoint_exports_sources_and_latency_histograms():
    stats = {"bytes_read": 10.0, "bytes_written": 4.0, "link_bytes_charged": 14.0,
             "staging_pages_total": 8.0, "staging_pages_free": 6.0, "read_q_tokens": 3.0,
             "reads_ok": 2.0}
    metrics.register_source("storage_gateway", "n9", lambda: dict(stats))
    metrics.register_source("scheduler", "scheduler",
                            lambda: {"finished": 1.0, "requests_state_queued": 2.0})
    metrics.observe_request(RequestFinished("r", 5, 0.2, 0.01, 0.004, 0.3, 128))
    ep = metrics.MetricsEndpoint(refresh_s=0.05)
    port = await ep.start(0)
    try:
        stats["bytes_read"] = 99.0
        await until(lambda: metrics.registry().snapshot[("storage_gateway", "n9")]["bytes_read"]
                    == 99.0, what="the refresh loop to snapshot the new value")
        text = await asyncio.to_thread(fetch, port)
    finally:
        await ep.stop()
        metrics.unregister_source("storage_gateway", "n9")
        metrics.unregister_source("scheduler", "scheduler")
    assert 'dualpath_storage_bytes_total{direction="read",node="n9"} 99.0' in text
    assert 'dualpath_link_bytes_total{link="storage",node="n9"} 14.0' in text
    assert 'dualpath_buffer_pages{kind="used",node="n9",pool="staging"} 2.0' in text
    assert 'dualpath_read_queue_tokens{node="n9"} 3.0' in text
    assert 'dualpath_requests{state="queued"} 2.0' in text
    assert 'dualpath_requests_ended_total{outcome="finished"} 1.0' in text
    assert 'dualpath_stat{name="reads_ok",node="n9",service="storage_gateway"} 2.0' in text
    assert "dualpath_ttft_seconds_count" in text and "dualpath_tpot_seconds_bucket" in text


async def test_a_failing_source_keeps_its_last_snapshot():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("gone")
        return {"tx_bytes_sent": 5.0}
    metrics.register_source("pe_receiver", "p7", flaky)
    try:
        metrics.registry().refresh()
        assert metrics.registry().snapshot[("pe_receiver", "p7")] == {"tx_bytes_sent": 5.0}
    finally:
        metrics.unregister_source("pe_receiver", "p7")


def test_scheduler_read_balance_is_exported_as_the_operations_view_families():
    balance = metrics.ReadBalance(window_s=10.0)
    planned, sides = {"p0": 0, "d0": 0, "d1": 0}, {"pe": 0, "de": 0}
    first = balance(planned, sides, now=0.0)
    assert first["snic_max_avg"] == 1.0 and first["read_side_de_fraction"] == 0.0
    balance({"p0": 300, "d0": 0, "d1": 0}, {"pe": 300, "de": 0}, now=5.0)
    # 20 s later only d0 and d1 read: the run ratio counts everything, "recent" the last 10 s
    out = balance({"p0": 300, "d0": 300, "d1": 300}, {"pe": 300, "de": 600}, now=25.0)
    assert out["snic_max_avg"] == 1.0
    assert out["snic_max_avg_recent"] == 300 / 200            # p0 idle in the window
    assert out["read_side_de_fraction"] == 600 / 900
    metrics.register_source("scheduler", "scheduler", lambda: dict(out))   # snapshots once
    try:
        text = generate_latest(metrics.registry().registry).decode()
    finally:
        metrics.unregister_source("scheduler", "scheduler")
    want = ('dualpath_read_planned_tokens_total{node="d0"} 300.0',
            'dualpath_read_side_tokens_total{side="de"} 600.0',
            'dualpath_snic_max_avg{window="recent"} 1.5', 'dualpath_snic_max_avg{window="run"} 1.0',
            "dualpath_read_side_de_fraction 0.666")
    assert [line for line in want if line not in text] == []
    # mapped onto their families, not repeated as dualpath_stat{name=…}
    assert 'name="read_planned_tokens:' not in text and 'name="snic_max_avg' not in text
