"""The operations view against a real Prometheus (issue #17 item 5).

A 1P2D cluster of real processes on loopback (``dualpath cluster up``, every metrics port fixed
in the file), Debian's ``prometheus`` scraping every service with the scrape config the
Kubernetes manifests use (:mod:`tools.cluster.observability`), a dualpath-mode replay with
``--check`` through it; then every query of the Grafana dashboard is run against Prometheus's
HTTP API and must return data. Skips loudly without a ``prometheus`` binary (``make
prometheus``), fails under CI=true.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import reap, skip_or_fail, wait_until
from tests.test_cluster_launcher import small_cluster
from tools.cluster import cli
from tools.cluster.config import free_port, load_cluster
from tools.cluster.observability import (dashboard_queries, engine_queries, load_dashboard,
                                         metrics_targets, prometheus_config)
from tools.cluster.toml_write import dumps

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("keep_logging")]

# what must be above 0 after a replay with hits on both sides: the dashboard's series, over a
# window that holds the whole test (the panels' own rate()[1m] is 0 once the last read is over
# a minute old, as it was once on a loaded host; those queries are checked for data below)
MUST_BE_POSITIVE = ('sum by (role) (increase(dualpath_storage_bytes_total{direction="read"}[15m]))',
                    "sum by (side) (increase(dualpath_read_side_tokens_total[15m]))",
                    "dualpath_read_side_de_fraction")


def positive(port: int, expr: str) -> bool:
    values = [float(r["value"][1]) for r in query(port, expr)]
    return bool(values) and max(values) > 0


def require_prometheus() -> str:
    """The ``prometheus`` binary; a loud skip without it, a failure under CI=true."""
    found = shutil.which("prometheus")
    if found:
        return found
    skip_or_fail("prometheus not installed (`make prometheus`: Debian's prometheus package)")


def ops_cluster(tmp: Path) -> dict[str, Any]:
    """1P2D, dualpath policy, storage links emulated, every port fixed (Prometheus targets)."""
    d = small_cluster(tmp)
    c = d["cluster"]
    c.update(name="ops1p2d", metrics=False, scheduler_port=free_port(),
             scheduler_metrics_port=free_port())
    c["nodes"] = [{"id": i, "role": r, "engines": 1, "gateway_port": free_port(),
                   "rpc_port": free_port(), "metrics_port": free_port(),
                   "gateway_metrics_port": free_port()}
                  for i, r in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))]
    return d


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as r:     # a deadline, not a speed check
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def targets_up(port: int, want: int) -> bool:
    active = api(port, "targets", state="active")["activeTargets"]
    return len(active) == want and all(t["health"] == "up" for t in active)


def query(port: int, expr: str) -> list[dict[str, Any]]:
    return api(port, "query", query=expr, time=f"{time.time():.3f}")["result"]


def test_prometheus_scrapes_every_service_and_each_dashboard_query_returns_data(tmp_path):
    binary = require_prometheus()
    cfg = tmp_path / "c.toml"
    cfg.write_text(dumps(ops_cluster(tmp_path)))
    cluster = load_cluster(cfg, mode="dualpath")
    groups = metrics_targets(cluster)
    assert len(groups) == 1 + 2 * 3                     # scheduler + gateway and node service ×3
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(groups, 0.5)))
    prom_port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
         "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=log)
    try:
        run_with_cluster(cfg, cluster, groups, prom_port)
    finally:
        prom.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            prom.wait(10)
        reap(prom)
        log.close()


def run_with_cluster(cfg: Path, cluster: Any, groups: list[dict[str, Any]], prom_port: int
                     ) -> None:
    assert cli.main(["up", "-c", str(cfg), "--mode", "dualpath"]) == 0
    try:
        wait_until(lambda: ready(prom_port), timeout=60, what="prometheus to be ready")
        wait_until(lambda: targets_up(prom_port, len(groups)), timeout=60,
                   what="every service's target to be scraped and up")
        run = subprocess.run(
            [sys.executable, "-m", "tools.cli", "replay", "-c", str(cfg), "--static",
             "--agents", "4", "--max-turns", "3", "--check",
             "--no-plots", "--no-progress", "--out", str(cfg.parent / "replay")],
            capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        # every service was scraped: `up` is 1 for each target
        up = query(prom_port, "up")
        assert sorted(r["metric"]["dualpath_service"] for r in up if r["value"][1] == "1") == \
            sorted(g["labels"]["dualpath_service"] for g in groups)
        # the scrape after the replay carries its reads: wait for it, then every query
        wait_until(lambda: all(positive(prom_port, e) for e in MUST_BE_POSITIVE), timeout=30,
                   what="a scrape that saw the replay's reads")
        queries = dashboard_queries(load_dashboard())
        assert len(queries) >= 8
        # the vLLM connector's panels read the vLLM instances' /metrics: none here
        engine = engine_queries(queries)
        assert {t for t, _ in engine} == {t for t, _ in queries if t.startswith("vLLM")}
        empty = [(title, e) for title, e in queries
                 if (title, e) not in engine and not query(prom_port, e)]
        assert not empty, f"dashboard queries without data: {empty}"
        for expr in MUST_BE_POSITIVE:
            values = [float(r["value"][1]) for r in query(prom_port, expr)]
            assert max(values) > 0, (expr, values)
        sides = {r["metric"]["side"] for r in query(prom_port, "dualpath_read_side_tokens_total")}
        assert sides == {"pe", "de"}
        snic = {r["metric"]["window"]: float(r["value"][1])
                for r in query(prom_port, "dualpath_snic_max_avg")}
        assert set(snic) == {"run", "recent"} and snic["run"] >= 1.0
        roles = {r["metric"]["role"] for r in query(prom_port, MUST_BE_POSITIVE[0])}
        assert roles == {"prefill", "decode"}
    finally:
        assert cli.main(["down", "-c", str(cfg)]) == 0
