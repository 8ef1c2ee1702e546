"""Overload (issue 8, item 4): 10,000 concurrent submissions against a subprocess cluster.

The burst runs over four frontend connections with thousands of concurrent streaming calls
each (``bench/overload_bench.py``, which ``dualpath bench overload`` also runs); the
scheduler admits at most 128 queued / 256 live requests. What must hold:

* nothing lost — every submission ends in ``RequestFinished`` with its full output, or a typed
  error the scheduler sent (``OVERLOADED`` carries a ``retry_after_s``); no stream ends without
  an outcome, no connection drops, no client deadline runs out;
* the answers add up with the scheduler's own counters (admitted = finished, refusals =
  ``rejected_overload`` plus the per-connection call cap's refusals);
* the scheduler's memory stays bounded: peak RSS (``VmHWM``) − RSS before the burst < 200 MB,
  a generous bound: 10,000 calls in flight at once cost a few KB each in the RPC layer, and at
  most 256 requests hold state (token ids, keys, events) beyond that;
* the cluster recovers: a fresh agentic replay afterwards finishes with every byte verified.
"""

from __future__ import annotations

import pytest

from bench.overload_bench import N_DEFAULT, cluster_data, run

pytestmark = [pytest.mark.slow, pytest.mark.reliability, pytest.mark.usefixtures("keep_logging")]

RSS_BOUND_MB = 200.0


async def test_ten_thousand_concurrent_submissions(tmp_path, reliability):
    data = cluster_data(tmp_path, max_queued=128, max_active=256, inflight=4096)
    res = await run(tmp_path, n=N_DEFAULT, connections=4, data=data, echo=lambda m: None)
    assert res["submitted"] == N_DEFAULT
    assert res["answered"] == N_DEFAULT and res["lost"] == 0, res["lost_by_kind"]
    assert res["finished"] > 0 and res["overloaded"] > 0
    assert res["overloaded_without_retry_after"] == 0
    assert res["finished"] + res["overloaded"] + sum(res["other"].values()) == N_DEFAULT
    assert all(k.startswith(("failed:", "DEADLINE", "UNAVAILABLE")) for k in res["other"]), \
        res["other"]
    sc = res["scheduler_counters"]
    assert sc["submitted"] == res["finished"] + sum(res["other"].values())
    assert sc["finished"] == res["finished"]
    # every OVERLOADED came from the scheduler's admission or the per-connection call cap
    assert sc["rejected_overload"] + res["rpc_calls_rejected"] == res["overloaded"]
    # the burst's connections and calls are all gone: left are the two node services' and
    # the monitor's own connection, and at most one call each
    assert res["rpc_connections_open"] <= 3 and res["rpc_calls_inflight"] <= 3, res
    growth = res["rss_peak_mb"] - res["rss_before_mb"]
    assert 0 < res["rss_before_mb"] <= res["rss_peak_mb"]
    assert growth < RSS_BOUND_MB, res
    assert res["recovered"], res
    reliability.record(
        "load", f"{N_DEFAULT} concurrent submissions over 4 connections (max_queued 128, "
                "max_active 256)",
        f"{res['finished']} finished, {res['overloaded']} OVERLOADED (all with retry-after), "
        f"{sum(res['other'].values())} other typed; recovered (replay of "
        f"{res['recovery_requests']} requests verified)",
        lost=res["lost"], recovery_s=res["recovery_s"],
        rss_before_mb=res["rss_before_mb"], rss_peak_mb=res["rss_peak_mb"],
        rss_after_mb=res["rss_after_mb"], rss_growth_mb=round(growth, 1),
        burst_s=res["burst_s"])
