"""Configuration of the data path's node services: ``[pe_receiver]`` and ``[de_loader]``.

Both sections live in this one module (``services.node.config`` re-exports its class):
``common.config`` imports it while it may itself be mid-import, so it must not import other
section modules.
"""

from __future__ import annotations

from common.config import Section

KiB, MiB, GiB = 1024, 1024 * 1024, 1024 * 1024 * 1024


class NodeServiceConfig(Section):
    """What a PE receiver and a DE loader share: buffer, engines, peers, bounds."""

    engines: int = 2                       # g engines on the node (the group leader serves all)
    buffer_bytes: int = 256 * MiB          # the PE / DE buffer, preallocated once
    page_bytes: int = 64 * KiB
    device: str = "host"                   # "host" (numpy) or "cuda" (cupy)
    host: str = "127.0.0.1"                # control RPC bind / advertised address
    rpc_port: int = 0                      # 0: any free port
    scheduler_host: str = "127.0.0.1"
    scheduler_port: int = 0                # 0: no scheduler (standalone: plans are submitted)
    gateway_host: str = "127.0.0.1"        # this node's storage gateway (RPC)
    gateway_port: int = 0                  # 0: none (plans name the read gateway)
    alloc_timeout_s: float = 10.0          # waiting for buffer room (then retryable failure)
    default_deadline_s: float = 120.0      # attempts whose plan carries no deadline
    max_prompt_tokens: int = 524_288
    read_batch_bytes: int = 8 * MiB        # Full Blocks per gateway ReadBatch
    telemetry_interval_s: float = 0.2      # gateway read-queue watch
    engine_release_timeout_s: float = 30.0 # pages of a dropped request an engine still holds
    control_timeout_s: float = 10.0        # one data-path / report RPC

    def __post_init__(self) -> None:
        for name in ("engines", "buffer_bytes", "page_bytes", "max_prompt_tokens",
                     "read_batch_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("alloc_timeout_s", "default_deadline_s", "telemetry_interval_s",
                     "engine_release_timeout_s", "control_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.device not in ("host", "cuda"):
            raise ValueError(f"device must be 'host' or 'cuda', got {self.device!r}")

    @property
    def num_pages(self) -> int:
        return max(1, self.buffer_bytes // self.page_bytes)


class PEReceiverConfig(NodeServiceConfig):
    """``[pe_receiver]``: the PE buffer and the layer-wise feed of the node's prefill engines."""

    lookahead_layers: int = 8              # layers loaded ahead of the engine (DE path: pulled)
    layers_per_pull: int = 2               # layers per PullLayers call (one transfer)
    pulls_in_flight: int = 2               # PullLayers calls outstanding at once
    max_unsent_layers: int = 8             # put_layer waits beyond this many unsent layers

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("lookahead_layers", "layers_per_pull", "pulls_in_flight",
                     "max_unsent_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"pe_receiver.{name} must be positive, got {getattr(self, name)}")


class DELoaderConfig(NodeServiceConfig):
    """The DE loader: its buffer, the HBM its engines report, how it persists new KV."""

    hbm_capacity_bytes: int = 64 * GiB     # KV HBM per decode engine (telemetry, placement)
    writeback: bool = True                 # persist complete prompt and generated blocks
    writeback_batch_blocks: int = 16       # Full Blocks per WriteBlocks call
    finish_after_writeback: bool = True    # report "finished" once write-backs are durable
    writeback_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hbm_capacity_bytes < 0 or self.writeback_batch_blocks <= 0:
            raise ValueError("de_loader.hbm_capacity_bytes must be >= 0 and "
                             "writeback_batch_blocks > 0")
