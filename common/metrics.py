"""Prometheus metrics of a dualpath process: one registry, one HTTP endpoint, pull-based.

Services already keep flat counter dicts and publish them as :class:`StatsSource` (``stats()``:
the gateway, the node services; the scheduler's counters); this module turns them into
Prometheus metrics **at scrape time** instead of instrumenting every code path twice:

* :func:`register_source` — ``(service, node, fn)`` where ``fn() -> dict[str, float]``; the
  event loop snapshots every source each ``refresh_s`` (the HTTP thread never touches live
  service state), and a collector maps known keys onto the standard families below; every
  other key is exported as ``dualpath_stat{service, node, name}``.
* :func:`observe_request` — TTFT / TTST / TPOT / end-to-end histograms, fed by the scheduler
  with each ``RequestFinished`` (thread-safe, cheap; a no-op cost when nobody scrapes).
* :func:`observe_failed_attempt` — failed attempts by hop and error code (scheduler).
* :class:`MetricsEndpoint` — ``await start(port, host)`` serves ``/metrics`` (port 0: any free
  port, read ``.port``), ``await stop()``.
* :func:`export_stats` / :func:`serve_metrics` — the same two tied to an exit stack, for the
  services' composition roots (``services/*/app.py``, ``storage_gateway/app.py``).

Standard families (labels):

==========================================  ===================================================
``dualpath_storage_bytes_total``            node, direction = read | write (gateway)
``dualpath_link_bytes_total``               node, link = storage (SNIC bucket) | compute (KV egress)
``dualpath_kv_sent_bytes_total``            node, service: KV bytes a PE receiver / DE loader sent
                                            (PE→DE on prefill nodes; DE→PE + write-back on decode)
``dualpath_read_queue_tokens``              node (the gateway's read queue, paper §5.1)
``dualpath_requests``                       state (scheduler: live requests by state)
``dualpath_requests_ended_total``           outcome = finished | failed | cancelled
``dualpath_buffer_pages``                   node, pool, kind = used | total
``dualpath_ttft_seconds`` / ``_ttst_`` / ``_tpot_`` / ``_e2e_``  histograms (scheduler)
``dualpath_failed_attempts_total``          hop, code: request attempts that failed (scheduler;
                                            re-planned or final — :func:`observe_failed_attempt`)
``dualpath_hit_lookup_failures_total``      (scheduler) lookups that failed: the hit was taken as 0
``dualpath_hit_lookup_retries_total``       (scheduler) lookup tries sent to another gateway
``dualpath_read_planned_tokens_total``      node: hit tokens the scheduler planned onto the node's
                                            storage link (scheduler)
``dualpath_read_side_tokens_total``         side = pe | de: the read-side split (scheduler, §4;
                                           a split read counts each part on its side)
``dualpath_read_side_de_fraction``          share of planned hit tokens read on the DE side
``dualpath_snic_max_avg``                   window = run | recent: max ÷ mean planned reads
                                            across nodes (1.0 = balanced; paper §7.4)
==========================================  ===================================================

The vLLM connector's families (:data:`CONNECTOR_FAMILIES`, :data:`CONNECTOR_HIT_TOKENS`) are
not exported here: vLLM's own stats path carries them from its worker to its API server, which
registers them (``integrations/vllm/stats.py``), so they show on each vLLM instance's
``/metrics`` with vLLM's ``engine`` / ``model_name`` labels (docs/vllm.md "Metrics"). Their names
live here so every dualpath family is listed in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = structlog.get_logger(__name__)

Source = Callable[[], dict[str, float]]


class StatsSource(Protocol):
    """What a service offers the metrics floor: one flat snapshot of its counters.

    Services expose :meth:`stats` themselves so this module never reaches into their state
    (no private attributes, no ``getattr``): what a scrape shows is what the service chose
    to publish.
    """

    def stats(self) -> dict[str, float]: ...

# connector counter key -> (family, help); counters, so Prometheus shows them as ``<family>_total``
CONNECTOR_FAMILIES: dict[str, tuple[str, str]] = {
    "load_bytes": ("dualpath_engine_load_bytes",
                   "KV bytes the dualpath connector loaded into vLLM's paged cache"),
    "load_seconds": ("dualpath_engine_load_seconds",
                     "Seconds those loads took, waits for the KV to arrive included "
                     "(load_bytes / load_seconds = load rate)"),
    "load_errors": ("dualpath_engine_load_errors",
                    "Requests whose dualpath load failed (vLLM recomputed them)"),
    "recompute_fallbacks": ("dualpath_engine_recompute_fallbacks",
                            "Requests sent to dualpath that vLLM computed without its hit: "
                            "not opened (claim failed, refused layout) or their load failed"),
    "claim_waits": ("dualpath_engine_claim_waits",
                    "Claims made: each waits for the node to hand the request over"),
    "claim_wait_seconds": ("dualpath_engine_claim_wait_seconds",
                           "Seconds spent waiting for claims (off vLLM's step)"),
}
# hit tokens by source: ``source`` = the side whose storage NIC read them (pe | de | split:
# both, docs/datapath.md "Split reads")
CONNECTOR_HIT_TOKENS = ("dualpath_engine_hit_tokens",
                        "Hit tokens the dualpath connector claimed for vLLM to load, by the "
                        "side that read them from storage")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0,
                    8.0, 16.0, 32.0, 64.0, 128.0)


class _Registry:
    """The process's registry, its sources and their last snapshot."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.sources: dict[tuple[str, str], Source] = {}
        self.snapshot: dict[tuple[str, str], dict[str, float]] = {}
        self.failing: set[tuple[str, str]] = set()     # sources whose last snapshot raised
        self.lock = threading.Lock()
        self.registry.register(_StatsCollector(self))
        self.ttft = self._hist("dualpath_ttft_seconds", "Submit to first token")
        self.ttst = self._hist("dualpath_ttst_seconds", "First to second token")
        self.tpot = self._hist("dualpath_tpot_seconds", "Time per output token after the first")
        self.e2e = self._hist("dualpath_e2e_seconds", "Submit to finished")
        self.failed_attempts = Counter(
            "dualpath_failed_attempts", "Request attempts that failed (re-planned or final), "
            "by the hop that failed and the error code", ("hop", "code"), registry=self.registry)

    def _hist(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def refresh(self) -> None:
        """Snapshot every source (call from the thread that owns the services: the loop)."""
        snap = {}
        for key, fn in list(self.sources.items()):
            try:
                snap[key] = {k: float(v) for k, v in fn().items()}
            except Exception:
                # Metrics must never take a service down: the source keeps its previous
                # snapshot. The traceback is logged once per failing streak, not every refresh.
                if key not in self.failing:
                    log.exception("metrics_source_failed", service=key[0], node=key[1])
                    self.failing.add(key)
                snap[key] = self.snapshot.get(key, {})
            else:
                self.failing.discard(key)
        with self.lock:
            self.snapshot = snap


_R: _Registry | None = None


def registry() -> _Registry:
    """The process-wide registry (created on first use)."""
    global _R
    if _R is None:
        _R = _Registry()
    return _R


def register_source(service: str, node: str, fn: Source) -> None:
    """Export ``fn()``'s counters as metrics of ``service`` on ``node``."""
    r = registry()
    r.sources[(service, node)] = fn
    r.refresh()


def unregister_source(service: str, node: str) -> None:
    r = registry()
    r.sources.pop((service, node), None)
    r.failing.discard((service, node))
    with r.lock:
        r.snapshot.pop((service, node), None)


def export_source(stack: contextlib.AsyncExitStack, service: str, node: str, fn: Source
                  ) -> None:
    """Export ``fn``'s counters for as long as ``stack`` is open (unregistered when it
    closes, before the service it reads stops)."""
    register_source(service, node, fn)
    stack.callback(unregister_source, service, node)


def export_stats(stack: contextlib.AsyncExitStack, service: str, node: str,
                 source: StatsSource) -> None:
    """:func:`export_source` of a service's own :meth:`StatsSource.stats`."""
    export_source(stack, service, node, source.stats)


async def serve_metrics(stack: contextlib.AsyncExitStack, port: int | None, host: str
                        ) -> int | None:
    """Serve ``/metrics`` on ``port`` (0: any free one) until ``stack`` closes; the bound
    port, or None when ``port`` is None (no endpoint asked for)."""
    if port is None:
        return None
    ep = MetricsEndpoint()
    bound = await ep.start(port, host)
    stack.push_async_callback(ep.stop)
    return bound


def observe_request(ev: Any) -> None:
    """Record a ``RequestFinished`` in the latency histograms."""
    r = registry()
    r.ttft.observe(ev.ttft_s)
    if getattr(ev, "ttst_s", None) is not None:
        r.ttst.observe(ev.ttst_s)
    if getattr(ev, "tokens", 0) > 1:
        r.tpot.observe(ev.tpot_s)
    r.e2e.observe(ev.e2e_s)


def observe_failed_attempt(hop: str, code: str) -> None:
    """Count one failed attempt (``dualpath_failed_attempts_total{hop, code}``)."""
    registry().failed_attempts.labels(hop=hop or "unknown", code=code or "UNKNOWN").inc()


# --------------------------------------------------------------------------- mapping

_STORAGE = {"bytes_read": "read", "bytes_written": "write"}
_POOLS = ("pe_buffer", "de_buffer", "staging")
_REQUEST_STATE_PREFIX = "requests_state_"
_ENDED = {"finished": "finished", "failed": "failed", "cancelled": "cancelled"}
_HIT_LOOKUP = ("hit_lookup_failures", "hit_lookup_retries")     # scheduler counter = family
_PLANNED_PREFIX = "read_planned_tokens:"      # + node id (scheduler: operations view)
_SIDE_PREFIX = "read_side_tokens:"            # + pe | de
_SNIC = {"snic_max_avg": "run", "snic_max_avg_recent": "recent"}
RECENT_WINDOW_S = 10.0                        # the "recent" SNIC max/avg window


class _StatsCollector:
    """Maps snapshots onto the standard families (see the module docstring)."""

    def __init__(self, r: _Registry) -> None:
        self.r = r

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        with self.r.lock:
            snap = dict(self.r.snapshot)
        fams = {
            "storage": CounterMetricFamily("dualpath_storage_bytes", "Bytes read from / written "
                                           "to storage by the node's gateway",
                                           labels=["node", "direction"]),
            "link": CounterMetricFamily("dualpath_link_bytes", "Bytes charged to the node's "
                                        "emulated links", labels=["node", "link"]),
            "kv": CounterMetricFamily("dualpath_kv_sent_bytes", "KV bytes a node service sent "
                                      "over the compute network", labels=["node", "service"]),
            "rq": GaugeMetricFamily("dualpath_read_queue_tokens", "Tokens waiting to be read "
                                    "on the node's storage link", labels=["node"]),
            "req": GaugeMetricFamily("dualpath_requests", "Live requests by state",
                                     labels=["state"]),
            "ended": CounterMetricFamily("dualpath_requests_ended", "Requests that ended, by "
                                         "outcome", labels=["outcome"]),
            "pages": GaugeMetricFamily("dualpath_buffer_pages", "Pages of the node's page "
                                       "pools", labels=["node", "pool", "kind"]),
            "stat": GaugeMetricFamily("dualpath_stat", "Every other counter of a service",
                                      labels=["service", "node", "name"]),
            "hit_lookup_failures": CounterMetricFamily(
                "dualpath_hit_lookup_failures", "Hit lookups that failed (every gateway); the "
                "request's hit was taken as 0"),
            "hit_lookup_retries": CounterMetricFamily(
                "dualpath_hit_lookup_retries", "Hit lookup tries sent to another gateway after "
                "one failed"),
            **_balance_families(),
        }
        for (service, node), stats in sorted(snap.items()):
            _map(service, node, stats, fams)
        yield from fams.values()


def _map(service: str, node: str, stats: dict[str, float], f: dict[str, Any]) -> None:
    used: set[str] = set()
    for key, direction in _STORAGE.items():
        if service == "storage_gateway" and key in stats:
            f["storage"].add_metric([node, direction], stats[key])
            used.add(key)
    if "link_bytes_charged" in stats:
        f["link"].add_metric([node, "storage"], stats["link_bytes_charged"])
        used.add("link_bytes_charged")
    if "arbiter_kv_bytes" in stats:
        f["link"].add_metric([node, "compute"], stats["arbiter_kv_bytes"])
        used.add("arbiter_kv_bytes")
    if "tx_bytes_sent" in stats:
        f["kv"].add_metric([node, service], stats["tx_bytes_sent"])
        used.add("tx_bytes_sent")
    if "read_q_tokens" in stats:
        f["rq"].add_metric([node], stats["read_q_tokens"])
        used.add("read_q_tokens")
    for pool in _POOLS:
        total, free = stats.get(f"{pool}_pages_total"), stats.get(f"{pool}_pages_free")
        if total is not None and free is not None:
            f["pages"].add_metric([node, pool, "total"], total)
            f["pages"].add_metric([node, pool, "used"], total - free)
            used.update((f"{pool}_pages_total", f"{pool}_pages_free"))
    if service == "scheduler":
        for key, value in stats.items():
            if key.startswith(_REQUEST_STATE_PREFIX):
                f["req"].add_metric([key[len(_REQUEST_STATE_PREFIX):]], value)
                used.add(key)
        for key, outcome in _ENDED.items():
            if key in stats:
                f["ended"].add_metric([outcome], stats[key])
                used.add(key)
        for key in _HIT_LOOKUP:
            if key in stats:
                f[key].add_metric([], stats[key])
                used.add(key)
        used.update(_map_balance(stats, f))
    for key, value in stats.items():
        if key not in used:
            f["stat"].add_metric([service, node, key], value)


# --------------------------------------------------------------------------- endpoint

class MetricsEndpoint:
    """``/metrics`` over HTTP (prometheus-client's threaded server) + a snapshot task."""

    def __init__(self, refresh_s: float = 1.0) -> None:
        self.refresh_s = refresh_s
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> int:
        r = registry()
        r.refresh()
        self._server, self._thread = start_http_server(port, host, r.registry)
        self.port = self._server.server_port
        self._task = asyncio.get_running_loop().create_task(self._refresh_loop(),
                                                            name="metrics-refresh")
        return self.port

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            registry().refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._server is not None:
            server, self._server = self._server, None
            await asyncio.get_running_loop().run_in_executor(None, server.shutdown)
            server.server_close()

    async def __aenter__(self) -> MetricsEndpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def scheduler_stats(svc: StatsSource) -> Source:
    """A source for a ``SchedulerService``: its ``stats()`` (counters, live requests by state,
    nodes, planned reads) plus the read balance computed over the planned reads."""
    def fn() -> dict[str, float]:
        out = svc.stats()
        planned = {k[len(_PLANNED_PREFIX):]: int(v) for k, v in out.items()
                   if k.startswith(_PLANNED_PREFIX)}
        sides = {k[len(_SIDE_PREFIX):]: int(v) for k, v in out.items()
                 if k.startswith(_SIDE_PREFIX)}
        out.update(balance(planned, sides))
        return out
    balance = ReadBalance()
    return fn


class ReadBalance:
    """The operations view's numbers from the scheduler's planned reads (cumulative tokens).

    SNIC max/avg is the simulator's measure (``sim.stats.WindowSeries.max_avg``, paper §7.4)
    over the scheduler's *planned* reads instead of bytes on the wire: ``run`` over everything
    so far, ``recent`` over the last :data:`RECENT_WINDOW_S` (snapshots are ``refresh_s`` apart;
    1.0 while nothing was planned). Every registered node counts in the mean, idle ones too.
    """

    def __init__(self, window_s: float = RECENT_WINDOW_S) -> None:
        self.window_s = window_s
        self.history: deque[tuple[float, dict[str, int]]] = deque()

    def __call__(self, planned: dict[str, int], sides: dict[str, int],
                 now: float | None = None) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        self.history.append((now, dict(planned)))
        while len(self.history) > 2 and self.history[1][0] <= now - self.window_s:
            self.history.popleft()
        old = self.history[0][1]
        recent = {n: v - old.get(n, 0) for n, v in planned.items()}
        out = {f"{_PLANNED_PREFIX}{n}": float(v) for n, v in planned.items()}
        out.update({f"{_SIDE_PREFIX}{s}": float(v) for s, v in sides.items()})
        total = sum(sides.values())
        out["read_side_de_fraction"] = sides.get("de", 0) / total if total else 0.0
        out["snic_max_avg"] = max_avg(planned)
        out["snic_max_avg_recent"] = max_avg(recent)
        return out


def max_avg(per_node: dict[str, int]) -> float:
    """max ÷ mean of the values (1.0 for none or all zero)."""
    vals = list(per_node.values())
    mean = sum(vals) / len(vals) if vals else 0.0
    return max(vals) / mean if mean > 0 else 1.0


def _balance_families() -> dict[str, Any]:
    return {
        "planned": CounterMetricFamily("dualpath_read_planned_tokens", "Hit tokens the "
                                       "scheduler planned onto the node's storage link",
                                       labels=["node"]),
        "side": CounterMetricFamily("dualpath_read_side_tokens", "Planned hit tokens by read "
                                    "side (pe: the PE's node reads, de: the DE's node reads)",
                                    labels=["side"]),
        "de_fraction": GaugeMetricFamily("dualpath_read_side_de_fraction", "Share of planned "
                                         "hit tokens read on the DE side"),
        "snic": GaugeMetricFamily("dualpath_snic_max_avg", "Max / mean planned storage reads "
                                  "across nodes (1.0 = balanced)", labels=["window"]),
    }


def _map_balance(stats: dict[str, float], f: dict[str, Any]) -> set[str]:
    used = set()
    for key, value in stats.items():
        if key.startswith(_PLANNED_PREFIX):
            f["planned"].add_metric([key[len(_PLANNED_PREFIX):]], value)
        elif key.startswith(_SIDE_PREFIX):
            f["side"].add_metric([key[len(_SIDE_PREFIX):]], value)
        elif key in _SNIC:
            f["snic"].add_metric([_SNIC[key]], value)
        elif key == "read_side_de_fraction":
            f["de_fraction"].add_metric([], value)
        else:
            continue
        used.add(key)
    return used
