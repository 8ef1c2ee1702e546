"""Configuration of the data path's node services: ``[pe_receiver]`` and ``[de_loader]``.

Both sections live in this one module (``services.node.config`` re-exports its class):
``common.config`` imports it while it may itself be mid-import, so it must not import other
section modules.
"""

from __future__ import annotations

from common.config import Device, FiniteNonNegFloat, NonNegInt, PositiveFloat, PositiveInt, Section

KiB, MiB, GiB = 1024, 1024 * 1024, 1024 * 1024 * 1024


class NodeServiceConfig(Section):
    """What a PE receiver and a DE loader share: buffer, engines, peers, bounds."""

    engines: PositiveInt = 2                        # g engines on the node (the group leader serves all)
    buffer_bytes: PositiveInt = 256 * MiB           # the PE / DE buffer, preallocated once
    page_bytes: PositiveInt = 64 * KiB
    device: Device = "host"                         # "host" (numpy) or "cuda" (cupy)
    host: str = "127.0.0.1"                         # control RPC bind / advertised address
    rpc_port: int = 0                               # 0: any free port
    scheduler_host: str = "127.0.0.1"
    scheduler_port: int = 0                         # 0: no scheduler (standalone: plans are submitted)
    gateway_host: str = "127.0.0.1"                 # this node's storage gateway (RPC)
    gateway_port: int = 0                           # 0: none (plans name the read gateway)
    alloc_timeout_s: PositiveFloat = 10.0           # waiting for buffer room (then retryable failure)
    default_deadline_s: PositiveFloat = 120.0       # attempts whose plan carries no deadline
    max_prompt_tokens: PositiveInt = 524_288
    read_batch_bytes: PositiveInt = 8 * MiB         # Full Blocks per gateway ReadBatch
    telemetry_interval_s: PositiveFloat = 0.2       # gateway read-queue watch
    engine_release_timeout_s: PositiveFloat = 30.0  # pages of a dropped request an engine still holds
    control_timeout_s: PositiveFloat = 10.0         # one data-path / report RPC
    engine_socket: str = ""                         # Unix socket engines in other processes
                                                    # attach to (docs/engine-api.md); "": none
    engine_socket_uids: tuple[int, ...] = ()
                                                    # uids allowed to attach (SO_PEERCRED);
                                                    # (): this service's own uid only
    engine_silence_s: FiniteNonNegFloat = 15.0      # detach an attached engine not heard from
                                                    # this long (stopped/frozen); 0: never
    engine_stuck_s: FiniteNonNegFloat = 120.0       # an engine whose step (as its beats report
                                                    # it) runs longer leaves service; 0: never
    finished_keep_s: PositiveFloat = 120.0          # results kept for a restarted scheduler

    @property
    def num_pages(self) -> int:
        return max(1, self.buffer_bytes // self.page_bytes)


class PEReceiverConfig(NodeServiceConfig):
    """``[pe_receiver]``: the PE buffer and the layer-wise feed of the node's prefill engines."""

    lookahead_layers: PositiveInt = 8      # layers loaded ahead of the engine (DE path: pulled)
    layers_per_pull: PositiveInt = 2       # layers per PullLayers call (one transfer)
    pulls_in_flight: PositiveInt = 2       # PullLayers calls outstanding at once
    max_unsent_layers: PositiveInt = 8     # put_layer waits beyond this many unsent layers


class DELoaderConfig(NodeServiceConfig):
    """The DE loader: its buffer, the HBM its engines report, how it persists new KV."""

    hbm_capacity_bytes: NonNegInt = 64 * GiB  # KV HBM per decode engine (telemetry, placement)
    writeback: bool = True                    # persist complete prompt and generated blocks
    writeback_batch_blocks: PositiveInt = 16  # Full Blocks per WriteBlocks call
    finish_after_writeback: bool = True       # report "finished" once write-backs are durable
    writeback_timeout_s: float = 30.0
