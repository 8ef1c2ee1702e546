"""What the connector's two halves tell each other, as plain data (docs/vllm.md).

On the CPU backend vLLM runs its scheduler (engine-core process) and its worker in separate
processes; the halves share nothing but these objects. Scheduler → worker, once per step:
:class:`DualPathMetadata` (claims to start, asynchronous loads to run, this step's work per
request, finished requests). Worker → scheduler, once per step: :class:`DualPathWorkerMeta`
(the claims that completed, with the hit each can load).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class OpenRequest:
    """Claim this request off the step; the scheduler holds it back until the answer."""

    req_id: str
    dualpath_id: str
    token_ids: list[int]
    planned_hit: int
    attempt: int | None = None       # the plan's attempt (the front sends it with the plan)


@dataclass
class AsyncLoad:
    """Decode: copy hit tokens ``[start, stop)`` into these blocks off the step; reported
    through ``get_finished`` (finished receiving) when done or failed."""

    req_id: str
    block_ids: list[int]
    start: int
    stop: int


@dataclass
class ReqStep:
    """One request's work in one step: hit rows to load, prompt rows to gather, its blocks
    (the arithmetic: :func:`integrations.vllm.rows.step_rows`)."""

    req_id: str
    block_ids: list[int]
    load: tuple[int, int]          # [start, stop) of hit rows to load in this forward
    save: tuple[int, int]          # [start, stop) of prompt rows to gather after it (prefill)
    ask_hit: bool                  # first forward, nothing to load: ask each hit layer anyway
    prompt_tokens: int


@dataclass
class Finish:
    """A finished request: its output ids (None: it ended before a first token, or never
    ran) and whether the worker reports it in ``get_finished`` (vLLM keeps its blocks until
    then); a request that never ran a step is not reported (vLLM freed or frees its blocks
    itself)."""

    output_ids: list[int] | None
    report: bool


@dataclass
class DualPathMetadata(KVConnectorMetadata):
    opens: list[OpenRequest] = field(default_factory=list)
    loads: list[AsyncLoad] = field(default_factory=list)
    steps: list[ReqStep] = field(default_factory=list)
    finishes: dict[str, Finish] = field(default_factory=dict)


@dataclass
class DualPathWorkerMeta(KVConnectorWorkerMetadata):
    """Claims answered since the last step: request id → usable hit tokens, or None when the
    request could not be opened (vLLM computes it without dualpath)."""

    opened: dict[str, int | None] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, DualPathWorkerMeta):
            self.opened.update(other.opened)
        return self
