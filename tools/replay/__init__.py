"""Workload replay against a running cluster (``dualpath replay``).

* :mod:`.workloads` — agentic trajectories from the paper's Table 2 statistics (32K/48K/64K,
  synthetic first round) and Mooncake trace requests (``hash_ids`` → block keys);
* :mod:`.driver` — the replay client: offline (all agents at once → JCT) and online (Poisson
  agent arrivals at an APS → TTFT/TTST/TPOT percentiles, SLO check), through the scheduler's
  frontend RPC with the prompts' token ids, so hits are what earlier turns wrote back;
* :mod:`.telemetry` — per-node storage-link and data-path counters sampled during a run;
* :mod:`.results` — the results JSON, summary table and checks; :mod:`.plots` — PNGs.
"""
