"""Configuration of one node's storage gateway (the ``[gateway]`` section)."""

from __future__ import annotations

import msgspec

from common.config import CommonConfig, Section

KiB, MiB = 1024, 1024 * 1024
GiB = 1024 * MiB

BACKENDS = ("fs", "memory")


class GatewayConfig(Section):
    """Backend, capacity, I/O threads, read-queue limits and storage-link emulation.

    ``root`` is the block directory for the ``fs`` backend: local, or a distributed file system
    mounted on every node (all gateways then see the same blocks; set ``probe_on_miss``).
    """

    backend: str = "fs"                          # "fs" (default) | "memory" (tests, dev)
    root: str = "data/storage"                   # relative paths are taken from the cwd
    capacity_bytes: int = 0                      # on-media bytes; 0 = unlimited, else LRU eviction
    io_threads: int = 8                          # bounded pool for every file operation
    o_direct: bool = False                       # reads bypass the page cache (falls back if refused)
    verify_headers_on_scan: bool = True          # read each header at start (bad → quarantine)
    temp_max_age_s: float = 3600.0               # other hosts' leftover temp files older than this are removed
    probe_on_miss: bool = False                  # shared FS: look on disk for blocks other nodes wrote
    max_keys_per_request: int = 16384            # 1M tokens at 64-token blocks
    max_bytes_per_request: int = 16 * GiB
    max_concurrent_reads: int = 4                # read requests served at once (FIFO beyond)
    max_queued_requests: int = 1024              # waiting read requests; above → OVERLOADED
    max_concurrent_writes: int = 4               # leaves I/O threads for reads while writes fsync
    read_batch_bytes: int = 4 * MiB              # blocks per thread job / link charge (≥ 1 block)
    overloaded_retry_after_s: float = 0.05
    link_rate_bytes_per_s: float = 0.0           # emulated SNIC; 0 = unlimited (real hardware)
    link_burst_bytes: int = 4 * MiB
    link_chunk_bytes: int = 1 * MiB              # large transfers are charged in chunks (fair interleave)
    # Same-host shared memory (docs/storage.md): the node's PE receiver / DE loader keep their
    # buffer in /dev/shm/dualpath-* and the gateway preads straight into it (one copy, no UCX);
    # the gateway serves such reads. false: requesters keep private buffers, all reads over UCX.
    shm: bool = True
    shm_max_mappings: int = 16                   # requester segments a gateway keeps mapped (LRU)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"gateway.backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("io_threads", "max_keys_per_request", "max_bytes_per_request",
                     "max_concurrent_reads", "max_concurrent_writes", "read_batch_bytes",
                     "link_chunk_bytes", "shm_max_mappings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"gateway.{name} must be positive, got {getattr(self, name)}")
        for name in ("capacity_bytes", "max_queued_requests", "link_rate_bytes_per_s",
                     "link_burst_bytes", "temp_max_age_s", "overloaded_retry_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"gateway.{name} must be >= 0, got {getattr(self, name)}")


class GatewayServiceConfig(Section):
    """The gateway's network side (``[gateway_service]``): staging and per-request bounds."""

    staging_bytes: int = 256 * MiB          # preallocated once; every batch / write is staged here
    staging_page_bytes: int = 64 * KiB
    pipeline_depth: int = 3                 # batches staged per read: reading, queued, sending
    max_batch_bytes: int = 64 * MiB         # one ReadBatch, or one WriteBlocks' new blocks
    max_slots_per_batch: int = 65_536       # bounds the planning work one batch can ask for
    telemetry_min_interval_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("staging_bytes", "staging_page_bytes", "pipeline_depth", "max_batch_bytes",
                     "max_slots_per_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"gateway_service.{name} must be positive, got {getattr(self, name)}")
        if self.max_batch_bytes > self.staging_bytes:
            raise ValueError("gateway_service.max_batch_bytes must not exceed staging_bytes")


class GatewayNodeConfig(CommonConfig):
    """Config root of a gateway process: the shared sections plus ``[gateway]`` and
    ``[gateway_service]`` (``services.config.ServicesConfig`` extends it)."""

    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    gateway_service: GatewayServiceConfig = msgspec.field(default_factory=GatewayServiceConfig)
