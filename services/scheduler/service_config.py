"""Settings of the live scheduler service: ``[scheduler_service]`` in a config file.

The placement constants (α, β, Z, policy, ``max_replans``) are ``[scheduler]``
(:class:`services.scheduler.config.SchedulerConfig`); this section holds what only the running
service needs: its port, leases, the fetch interval it tells group leaders, and the bounds on
what one frontend or node may send (CONVENTIONS §5: bounded everything, explicit OVERLOADED).
"""

from __future__ import annotations

import math

from common.config import Section


class SchedulerServiceConfig(Section):
    """Port, leases, fetch interval and input bounds of the scheduler service."""

    host: str | None = None                # bind address; None: rpc.host
    port: int = 0                          # 0: any free port (logged and printed at start)
    lease_s: float = 5.0                   # a node service silent this long is dead
    heartbeat_s: float = 1.0               # told to node services at registration
    fetch_interval_s: float = 0.02         # told to group leaders (paper §6.1: periodic pull)
    fetch_wait_s: float = 1.0              # idle group's empty fetch held up to this (0: off;
                                           # never more than lease_s / 4)
    lease_check_s: float = 0.1             # how often leases are swept
    gateway_service: str = "storage_gateway"   # service name whose endpoint serves reads
    max_queued_requests: int = 10_000      # waiting for placement; above → OVERLOADED
    max_active_requests: int = 100_000     # not yet finished or failed; above → OVERLOADED
    overload_retry_after_s: float = 0.5
    max_prompt_tokens: int = 524_288       # token_ids must fit rpc.max_frame_bytes too
    max_gen_tokens: int = 1_048_576
    max_block_keys: int = 8_192            # = max_prompt_tokens / 64-token blocks
    max_id_chars: int = 256                # request / session / node / engine ids
    max_engines_per_node: int = 64
    max_plans_per_fetch: int = 256
    max_bindings_per_fetch: int = 1_024
    max_revocations_per_fetch: int = 1_024
    fetch_reply_budget_bytes: int = 2 * 1024 * 1024   # plans stop here (one always goes)
    hit_lookup_timeout_s: float = 1.0      # a slow storage index → hit 0, never a stuck request
    max_sessions: int = 100_000            # sessions remembered by the in-memory prefix index
    recent_requests: int = 10_000          # ended ids remembered (late cancels/reports answer)
    drain_grace_s: float = 2.0             # stop: open calls get this long after requests fail

    @property
    def fetch_hold_s(self) -> float:
        """The long-poll bound in force: ``fetch_wait_s`` capped well inside the lease."""
        return min(self.fetch_wait_s, self.lease_s / 4)

    def __post_init__(self) -> None:
        # ValueError: build_config turns it into a ConfigError naming the section.
        for name in ("lease_s", "heartbeat_s", "fetch_interval_s", "lease_check_s",
                     "overload_retry_after_s", "hit_lookup_timeout_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"scheduler_service.{name} must be positive, got {v}")
        if not (0 <= self.fetch_wait_s and math.isfinite(self.fetch_wait_s)):
            raise ValueError(f"scheduler_service.fetch_wait_s must be >= 0, got "
                             f"{self.fetch_wait_s}")
        if self.heartbeat_s >= self.lease_s:
            raise ValueError(f"scheduler_service.heartbeat_s ({self.heartbeat_s}) must be below "
                             f"lease_s ({self.lease_s}) or every lease expires")
        for name in ("max_queued_requests", "max_active_requests", "max_prompt_tokens",
                     "max_gen_tokens", "max_block_keys", "max_id_chars", "max_engines_per_node",
                     "max_plans_per_fetch", "max_bindings_per_fetch",
                     "max_revocations_per_fetch", "fetch_reply_budget_bytes", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler_service.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"scheduler_service.port must be in [0, 65535], got {self.port}")
        if self.recent_requests < 0 or self.drain_grace_s < 0:
            raise ValueError("scheduler_service.recent_requests and drain_grace_s must be >= 0")
