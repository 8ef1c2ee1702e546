"""Cluster-scale discrete-event simulator of a DualPath PD cluster, and the deployment check.

* ``sim.cluster.Cluster`` — nodes, links and engines driven by ``services.scheduler`` (imported,
  never copied): the same placement, read-side choice and PE batching as the live service.
* ``sim.flows`` — max-min fair bandwidth sharing over SNIC / CNIC / DRAM links.
* ``sim.engines`` — prefill units (layer-wise or whole-prompt, exact or aggregated per-layer
  transfers) and fluid decode engines.
* ``sim.workload`` — lazy Table 2 trajectories, offline and Poisson online agents.
* ``sim.bandwidth`` — paper §3: per-link loads and eq. (9)'s no-bottleneck P/D window.
* Entry points (``main(argv) -> int``): ``sim.cli`` (``dualpath simulate``), ``sim.check``
  (``dualpath check-config``), ``sim.reproduce`` (``docs/reproduction.md``).

* ``sim.accel`` — the optional compiled (mypyc) build of the hot modules; loaded here, before
  anything imports them, when one exists for these exact sources.

Design notes, approximations and their checks: ``docs/simulator.md``.
"""

from . import accel

accel.enable()

from .bandwidth import check, link_loads, pd_range, pd_window_warning
from .run import predict_speedups, simulate

__all__ = ["check", "link_loads", "pd_range", "pd_window_warning", "predict_speedups", "simulate"]
