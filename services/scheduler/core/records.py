"""Inputs and outputs of the scheduling core: frozen msgspec Structs, free of any I/O.

Token units (paper §6: token count stands in for GPU, disk-read and network load):

* a PE's load of a request is its **prompt tokens** (hit + new) — what it must read and prefill —
  weighted by prefill cost (``SchedulerConfig.pe_load = "cost"``, the default: a cold token
  counts as the reference-shape tokens that cost as much, ``cost_model.PrefillLoad``);
* a DE's load of a request is **prompt + generated tokens** — the KV it holds when decode ends;
* a node's read queue grows by the request's **hit tokens** when it is chosen as read side.
"""

from __future__ import annotations

import enum

import msgspec

from common.errors import InvalidArgument


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class ReadSide(enum.StrEnum):
    """Where a request's hit KV is read from storage (paper §2.4/§2.5); ``none`` in oracle mode;
    ``split``: the DE's node reads the hit's leading ``split_tokens``, the PE's node the rest."""

    PE = "pe"
    DE = "de"
    SPLIT = "split"
    NONE = "none"


def prompt_kv_bytes(hbm_bytes: int, prompt_tokens: int, gen_tokens: int) -> int:
    """The prompt's share of a request's ``hbm_bytes`` (its KV with the generated tokens'):
    what a PE stages in its node's buffer."""
    return hbm_bytes * prompt_tokens // (prompt_tokens + gen_tokens)


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One turn to place. ``hbm_bytes`` is the DE HBM it reserves until it completes."""

    request_id: str
    session_id: str
    hit_tokens: int
    new_tokens: int
    gen_tokens: int
    hbm_bytes: int

    def __post_init__(self) -> None:
        if (self.hit_tokens < 0 or self.new_tokens < 0 or self.gen_tokens < 0
                or self.hbm_bytes < 0):
            raise InvalidArgument(f"request {self.request_id!r}: lengths and hbm_bytes must be >= 0")
        if self.hit_tokens + self.new_tokens <= 0:
            raise InvalidArgument(f"request {self.request_id!r}: empty prompt")

    @property
    def prompt_tokens(self) -> int:
        return self.hit_tokens + self.new_tokens

    @property
    def prompt_kv_bytes(self) -> int:
        """The KV a PE stages in its node's buffer: :func:`prompt_kv_bytes` of this request."""
        return prompt_kv_bytes(self.hbm_bytes, self.prompt_tokens, self.gen_tokens)

    @classmethod
    def sized(cls, request_id: str, session_id: str, hit_tokens: int, new_tokens: int,
              gen_tokens: int, kv_bytes_per_token: int) -> Request:
        """A request whose HBM need is its full KV (prompt + generated) at ``kv_bytes_per_token``."""
        hbm = (hit_tokens + new_tokens + gen_tokens) * kv_bytes_per_token
        return cls(request_id, session_id, hit_tokens, new_tokens, gen_tokens, hbm)


class EngineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine to register. ``group_id`` defaults to the node: one group per role per node."""

    engine_id: str
    role: Role
    node_id: str
    group_id: str | None = None
    # DEs: HBM for request KV; PEs: their node's KV buffer, shared by the node's PEs (every
    # attempt stages its whole prompt's KV there). 0 = unknown until telemetry reports it
    # (PEs: not checked)
    hbm_capacity_bytes: int = 0


class EngineReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine's figures in a group fetch: seq_e, tok_e and (DEs) free HBM and their node's
    free DE buffer."""

    engine_id: str
    seq: int
    tok: int
    free_hbm_bytes: int | None = None
    buffer_free_bytes: int | None = None


class Telemetry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a group leader reports with its fetch; it replaces the scheduler's own accounting."""

    engines: tuple[EngineReport, ...] = ()
    read_q: dict[str, int] = {}   # node id -> tokens waiting in its disk-read queue


class DEBinding(msgspec.Struct, frozen=True):
    """Phase-2 result: the request's decode engine and the HBM reserved on it."""

    request_id: str
    de_engine: str
    de_node: str
    hbm_bytes: int


class Assignment(msgspec.Struct, frozen=True):
    """A complete plan: (PE, DE) pair and the read side, returned by a PE group fetch.

    ``read_node`` is the node whose storage link reads the hit KV (``None`` when nothing is read;
    on a split read the PE's node, which reads the part after ``split_tokens``; the DE's node
    reads the leading ``split_tokens``). ``attempt`` counts re-plans (0 for the first plan).
    """

    request_id: str
    session_id: str
    pe_engine: str
    pe_node: str
    de_engine: str
    de_node: str
    read_side: ReadSide
    read_node: str | None
    hit_tokens: int
    new_tokens: int
    gen_tokens: int
    attempt: int = 0
    split_tokens: int = 0


class ReplanResult(msgspec.Struct, frozen=True):
    """Requests put back in a queue after a failure, and those failed for good (over the bound)."""

    requeued: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


class Phase(enum.StrEnum):
    """Where a request stands inside the scheduler."""

    QUEUED = "queued"       # waiting for a DE (global or group-private queue)
    BOUND = "bound"         # DE bound, waiting in the PE FIFO queue
    PLACED = "placed"       # PE + DE + read side chosen; reading / prefilling
    DECODING = "decoding"   # prefill done; only the DE holds it
