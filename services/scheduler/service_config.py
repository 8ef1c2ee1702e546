"""Settings of the live scheduler service: ``[scheduler_service]`` in a config file.

The placement constants (α, β, Z, policy, ``max_replans``) are ``[scheduler]``
(:class:`services.scheduler.core.config.SchedulerConfig`); this section holds what only the running
service needs: its port, leases, the fetch interval it tells group leaders, and the bounds on
what one frontend or node may send (docs/contributing.md, 'Bounded queues and deadlines').
"""

from __future__ import annotations

from common.config import (FiniteNonNegFloat, FinitePositiveFloat, NonNegFloat, NonNegInt, Port,
                           PositiveInt, Section)


class EtcdConfig(Section):
    """``[etcd]``: with ``endpoints`` set, scheduler replicas elect a leader there and frontends
    and nodes find it there (``services.scheduler.etcd.election``); empty: the static address."""

    endpoints: list[str] = []                  # "host:port" of etcd members (client URLs)
    prefix: str = "/dualpath"                  # key prefix: <prefix>/scheduler/leader
    lease_s: PositiveInt = 2                   # leader lease (etcd TTLs are whole seconds)
    poll_s: FinitePositiveFloat = 0.2          # a standby looks for a vacant leader key this often
    dial_timeout_s: FinitePositiveFloat = 2.0  # one etcd call (then the next endpoint)
    step_down_s: FinitePositiveFloat = 10.0    # a leader unconfirmed this long steps down (>= lease_s)
    # a starting process (the scheduler's start check, a node's first registration) retries an
    # unanswered etcd this long, then exits naming the endpoints: a host stall or an etcd
    # started beside it costs a wait, not a restart
    start_timeout_s: FinitePositiveFloat = 10.0

    def __post_init__(self) -> None:
        if self.step_down_s < self.lease_s:
            raise ValueError(f"etcd.step_down_s ({self.step_down_s}) must be at least lease_s "
                             f"({self.lease_s}): a leader stops serving after one lease "
                             f"without renewal and steps down after step_down_s")


class SchedulerServiceConfig(Section):
    """Port, leases, fetch interval and input bounds of the scheduler service."""

    host: str | None = None                                # bind address; None: rpc.host
    port: Port = 0                                         # 0: any free port (logged and printed at start)
    lease_s: FinitePositiveFloat = 5.0                     # a node service silent this long is dead
    heartbeat_s: FinitePositiveFloat = 1.0                 # told to node services at registration
    fetch_interval_s: FinitePositiveFloat = 0.02           # told to group leaders (paper §6.1: periodic pull)
    fetch_wait_s: FiniteNonNegFloat = 1.0                  # idle group's empty fetch held up to this (0: off;
                                                           # never more than lease_s / 4)
    lease_check_s: FinitePositiveFloat = 0.1               # how often leases are swept
    gateway_service: str = "storage_gateway"               # service name whose endpoint serves reads
    max_queued_requests: PositiveInt = 10_000              # waiting for placement; above → OVERLOADED
    max_active_requests: PositiveInt = 100_000             # not yet finished or failed; above → OVERLOADED
    overload_retry_after_s: FinitePositiveFloat = 0.5
    max_prompt_tokens: PositiveInt = 524_288               # token_ids must fit rpc.max_frame_bytes too
    max_gen_tokens: PositiveInt = 1_048_576
    max_block_keys: PositiveInt = 8_192                    # = max_prompt_tokens / 64-token blocks
    max_id_chars: PositiveInt = 256                        # request / session / node / engine ids
    max_engines_per_node: PositiveInt = 64
    max_plans_per_fetch: PositiveInt = 256
    max_bindings_per_fetch: PositiveInt = 1_024
    max_revocations_per_fetch: PositiveInt = 1_024
    fetch_reply_budget_bytes: PositiveInt = 2 * 1024 * 1024  # plans stop here (one always goes)
    hit_lookup_timeout_s: FinitePositiveFloat = 1.0        # a slow storage index → hit 0, never a stuck request
    max_sessions: PositiveInt = 100_000                    # sessions remembered by the in-memory prefix index
    recent_requests: NonNegInt = 10_000                    # ended ids remembered (late cancels/reports answer)
    drain_grace_s: NonNegFloat = 2.0                       # stop: open calls get this long after requests fail
    reattach_grace_s: FiniteNonNegFloat = 5.0              # a frontend whose connection dropped may resubmit
                                                           # (same id) this long before its requests are cancelled
    kept_results: PositiveInt = 10_000                     # results redelivered from an earlier scheduler
    kept_result_s: FinitePositiveFloat = 120.0             # ... kept this long for their frontend's resubmit

    @property
    def fetch_hold_s(self) -> float:
        """The long-poll bound in force: ``fetch_wait_s`` capped well inside the lease."""
        return min(self.fetch_wait_s, self.lease_s / 4)

    def __post_init__(self) -> None:
        # cross-field; the per-field bounds are declared above and checked at decode.
        # ValueError: build_config turns it into a ConfigError naming the section.
        if self.heartbeat_s >= self.lease_s:
            raise ValueError(f"scheduler_service.heartbeat_s ({self.heartbeat_s}) must be below "
                             f"lease_s ({self.lease_s}) or every lease expires")
