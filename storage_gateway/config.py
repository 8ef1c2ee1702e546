"""Configuration of one node's storage gateway (the ``[gateway]`` section)."""

from __future__ import annotations

from typing import Literal

import msgspec

from common.config import CommonConfig, NonNegFloat, NonNegInt, PositiveInt, Section

KiB, MiB = 1024, 1024 * 1024
GiB = 1024 * MiB


class GatewayConfig(Section, frozen=True):
    """Backend, capacity, I/O threads, read-queue limits and storage-link emulation.

    ``root`` is the block directory for the ``fs`` backend: local, or a distributed file system
    mounted on every node (all gateways then see the same blocks; set ``probe_on_miss``).
    """

    backend: Literal["fs", "memory"] = "fs"      # "fs" (default) | "memory" (tests, dev)
    root: str = "data/storage"                   # relative paths are taken from the cwd
    capacity_bytes: NonNegInt = 0                # on-media bytes; 0 = unlimited, else LRU eviction
    io_threads: PositiveInt = 8                  # bounded pool for every file operation
    o_direct: bool = False                       # reads bypass the page cache (falls back if refused)
    # buffered reads through the compiled GIL-free read (storage_gateway/native, built by the
    # install where a C compiler is present; docs/storage.md): false, or not built → Python path
    native_reads: bool = True
    verify_headers_on_scan: bool = True          # read each header at start (bad → quarantine)
    temp_max_age_s: NonNegFloat = 3600.0         # other hosts' leftover temp files older than this are removed
    probe_on_miss: bool = False                  # shared FS: look on disk for blocks other nodes wrote
    max_keys_per_request: PositiveInt = 16384    # 1M tokens at 64-token blocks
    max_bytes_per_request: PositiveInt = 16 * GiB
    max_concurrent_reads: PositiveInt = 4        # read requests served at once (FIFO beyond)
    max_queued_requests: NonNegInt = 1024        # waiting read requests; above → OVERLOADED
    max_concurrent_writes: PositiveInt = 4       # leaves I/O threads for reads while writes fsync
    read_batch_bytes: PositiveInt = 4 * MiB      # blocks per thread job / link charge (≥ 1 block)
    # who the link and the I/O jobs serve next (docs/storage.md, "Read order"): "arrival" = the
    # earliest request first, so they end one after another and each hit reaches its engine
    # after one hit's read; "shared" = every running request a turn in round robin, so requests
    # admitted together end together (pair it with link_duplex = "half", where a write-back
    # must not wait behind every read queued before it)
    read_order: Literal["arrival", "shared"] = "arrival"
    overloaded_retry_after_s: NonNegFloat = 0.05
    link_rate_bytes_per_s: NonNegFloat = 0.0     # emulated SNIC; 0 = unlimited (real hardware)
    link_burst_bytes: NonNegInt = 4 * MiB
    link_chunk_bytes: PositiveInt = 1 * MiB      # large transfers are charged in chunks (fair interleave)
    # "full": one bucket per direction, each at link_rate_bytes_per_s, like a real NIC, where a
    # write-back never delays a read; "half": one bucket carries the reads (storage -> node) and
    # the writes (node -> storage), as storage whose disks serve both (docs/storage.md "Link
    # emulation"; set [scheduler] write_weight = 1 and read_order = "shared" with it)
    link_duplex: Literal["half", "full"] = "full"
    # Same-host shared memory (docs/storage.md): the node's PE receiver / DE loader keep their
    # buffer in /dev/shm/dualpath-* and the gateway preads straight into it (one copy, no UCX);
    # the gateway serves such reads. false: requesters keep private buffers, all reads over UCX.
    shm: bool = True
    shm_max_mappings: PositiveInt = 16           # requester segments a gateway keeps mapped (LRU)


class GatewayServiceConfig(Section, frozen=True):
    """The gateway's network side (``[gateway_service]``): staging and per-request bounds."""

    staging_bytes: PositiveInt = 256 * MiB  # preallocated once; every batch / write is staged here
    staging_page_bytes: PositiveInt = 64 * KiB
    pipeline_depth: PositiveInt = 3         # batches staged per read: reading, queued, sending
    max_batch_bytes: PositiveInt = 64 * MiB  # one ReadBatch, or one WriteBlocks' new blocks
    max_slots_per_batch: PositiveInt = 65_536  # bounds the planning work one batch can ask for
    telemetry_min_interval_s: float = 0.05

    def __post_init__(self) -> None:
        # cross-field; the per-field bounds are declared above and checked at decode
        if self.max_batch_bytes > self.staging_bytes:
            raise ValueError("gateway_service.max_batch_bytes must not exceed staging_bytes")


class GatewayNodeConfig(CommonConfig, frozen=True):
    """Config root of a gateway process: the shared sections plus ``[gateway]`` and
    ``[gateway_service]`` (``services.config.ServicesConfig`` extends it)."""

    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    gateway_service: GatewayServiceConfig = msgspec.field(default_factory=GatewayServiceConfig)
