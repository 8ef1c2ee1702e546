"""``DualPathConnector``: vLLM 0.32's KV connector API driven by dualpath (docs/vllm.md).

Load it with::

    --kv-transfer-config '{"kv_connector": "DualPathConnector",
      "kv_connector_module_path": "integrations.vllm.connector", "kv_role": "kv_producer",
      "kv_load_failure_policy": "fail", "kv_connector_extra_config": {...}}'

A request takes part when its ``kv_transfer_params`` hold ``{"dualpath": {...}}`` (the front
puts the plan there); others run as plain vLLM. A decode instance (``kv_consumer``) runs
``kv_load_failure_policy`` ``"recompute"``, a prefill instance ``"fail"``
(:func:`integrations.vllm.kv_spec.check_failure_policy` says why).

vLLM builds the connector once in its scheduler (engine-core) process and once in its worker
process; on CPU they are always separate processes and share only per-step plain data
(:mod:`integrations.vllm.metadata`). This class is the hook table: the scheduler hooks go to
:class:`~integrations.vllm.scheduler_half.SchedulerHalf` (when a request may run: held back
until its claim is known, decode loads asynchronous), the worker hooks to
:class:`~integrations.vllm.worker_half.WorkerHalf` (claims and decode loads off the step,
prefill loads layer-wise inside the forward, saves, finishes). Waiting for dualpath never
stalls the running batch (docs/vllm.md "Asynchronous loads"). The worker half's counters
(load bytes and seconds, load errors, recompute fallbacks, claim waits, hit tokens by read
side) reach vLLM's ``/metrics`` through vLLM's connector stats (:mod:`integrations.vllm.stats`).

Tensor parallelism 1 only: a TP > 1 vLLM would announce its collectives to the node
(``collective_begin`` / ``collective_end`` on the engine client) so KV egress stays below
them; not supported yet (docs/vllm.md, "Collectives").
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from common import faults
from common.kv import PRESETS
from integrations.vllm.kv_spec import (check_failure_policy, check_same_layout, check_supported,
                                       spec_from_vllm)
from integrations.vllm.local_store import LocalKVStore
from integrations.vllm.scheduler_half import PARAMS_KEY, SchedulerHalf
from integrations.vllm.sessions import KVSource
from integrations.vllm.stats import DualPathPromMetrics, DualPathStats
from integrations.vllm.worker_half import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PARAMS_KEY", "DualPathConnector"]


def _make_source(extra: dict[str, Any], vllm_config: VllmConfig) -> KVSource:
    """The KV source ``kv_connector_extra_config`` names, after the KV-spec check."""
    model_spec = spec_from_vllm(vllm_config)
    preset = extra.get("kv_preset")
    if preset is not None:
        check_same_layout(model_spec, PRESETS[preset], f"the cluster's preset {preset!r}")
    kind = extra.get("source", "local")
    if kind == "local":
        return LocalKVStore(extra["store_dir"], model_spec)
    if kind == "engine":
        from integrations.vllm.engine_source import EngineSource

        role = "decode" if vllm_config.kv_transfer_config.kv_role == "kv_consumer" else "prefill"
        spec = PRESETS[preset] if preset is not None else model_spec
        return EngineSource(extra["engine_socket"], extra["engine_id"], role, spec,
                            float(extra.get("connect_timeout_s", 10.0)))
    raise ValueError(f"DualPathConnector: unknown source {kind!r} (known: local, engine)")


def _rearm_failpoints_on_sigusr1() -> None:
    """Fault tests arm failpoints (``common.faults``) in a running instance's worker process
    over SIGUSR1 when ``DUALPATH_FAILPOINTS_FILE`` is set, as in every service: in the worker
    process (where ``vllm.step`` sits) and in the engine core (the scheduler side, so a
    signal sent there is no kill). Only a process's main thread, where vLLM makes its
    connectors, may install the handler."""
    if os.environ.get(faults.FILE_ENV) and threading.current_thread() is threading.main_thread():
        faults.check_env()


class DualPathConnector(KVConnectorBase_V1):
    """vLLM KV connector whose hits and new KV go through dualpath (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        decode = ktc.kv_role == "kv_consumer"
        check_failure_policy(decode, ktc.kv_load_failure_policy,
                             bool(vllm_config.cache_config.enable_prefix_caching))
        check_supported(vllm_config)
        extra = dict(ktc.kv_connector_extra_config)
        if decode and extra.get("source") != "engine":
            raise ValueError("DualPathConnector: kv_consumer (decode) needs source='engine'")
        self._source = _make_source(extra, vllm_config)
        self._decode = decode
        self._sched = SchedulerHalf(self._source, decode)
        # a claim waits for the node to have the request: on the decode side that is the whole
        # prefill (the prompt KV assembled), so it gets its own, longer deadline; it waits off
        # the step, one pool thread per request waiting (open_threads at once)
        self._worker = WorkerHalf(
            vllm_config, self._source, self._get_connector_metadata, decode=decode,
            layer_timeout_s=float(extra.get("layer_timeout_s", 10.0)),
            claim_timeout_s=float(extra.get("claim_timeout_s", 300.0)),
            open_threads=int(extra.get("open_threads", 64)))
        self._worker_meta: KVConnectorWorkerMetadata | None = None
        _rearm_failpoints_on_sigusr1()

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.worker_output(connector_output)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's ``prompt_tokens_cached_by_source``: a prefill hit was read from storage
        (disk); a decode instance's prompt KV came from the prefill instance (p2p)."""
        if num_external_tokens == 0:
            return {}
        return {CacheHitSource.P2P if self._decode else CacheHitSource.DISK: num_external_tokens}

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.finished(request)

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.step_began()       # a step's first connector call, forward or not
        faults.failpoint("vllm.step")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.load_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return (res.finished_sending or None), (res.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, received, failed, self._worker_meta = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=done, finished_recving=received,
                                          failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta, self._worker_meta = self._worker_meta, None
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's counter deltas since the last step (None when nothing happened, or
        in the scheduler process, whose worker half never counts)."""
        data = self._worker.counters.take()
        return DualPathStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return DualPathStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return DualPathPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._worker.shutdown()
