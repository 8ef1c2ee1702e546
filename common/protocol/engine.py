"""Engine channel: an engine in its own process ↔ its node's PE receiver / DE loader
(docs/engine-api.md "Cross-process").

The engine connects to the node's Unix socket (the RPC hello checks the protocol version),
attaches as one of the node's engines (:class:`AttachEngine`: engine id, role, its KV spec —
a layout mismatch is refused naming both specs) and learns the node's buffer arena: a
``/dev/shm`` segment it maps once. From then on messages name *slots* of that arena
(:class:`ArenaSlot`, byte offset + length), never carry KV bytes.

Prefill: ``NextRequest`` / ``ClaimRequest`` → :class:`PrefillAssigned`; per layer
``WaitLayer`` → :class:`LayerReady` (hit slot to copy from, output slot to write the new
tokens' KV into), ``PutLayer``; then ``FinishPrefill`` or ``FailRequest``.

Decode: ``NextRequest`` / ``ClaimRequest`` → :class:`DecodeAssigned` (one slot per layer of
the full prompt KV); ``TookKV``; ``SecondToken``; per generated Full Block ``NewBlock`` →
:class:`BlockOpened` (its ``[L, block_tokens, B]`` page) and ``PutBlock``; then
``FinishDecode`` or ``FailRequest``.

Either role, before a claim: ``AbandonRequest`` — the engine could not open the request and
computes it alone; the node fails the attempt at once instead of at its deadline.

Either role: ``CollectiveBegin`` / ``CollectiveEnd`` around the engine's own collectives, so
the node's egress arbiter keeps KV below them (docs/qos.md, "Collectives tell the arbiter").

Every request-scoped message names ``(request_id, attempt)``; the node refuses one its caller
does not hold with NOT_FOUND (another engine's, finished, or never handed out).
"""

from __future__ import annotations

from typing import Literal, Union

from common.kv import KVSpec
from common.protocol.base import ErrorReply, Message, ReadSide

ENGINE_API_VERSION = 2          # 2: EngineAlive, EngineAttached.heartbeat_s / silence_s
EngineRole = Literal["prefill", "decode"]


class ArenaSlot(Message, tag="engine.slot", frozen=True, array_like=True):
    """``nbytes`` bytes at byte ``offset`` of the node's arena (one contiguous run)."""

    offset: int
    nbytes: int


class EnginePrompt(Message, tag="engine.prompt", frozen=True):
    """The request's prompt as the engine sees it (``services.engine_api.prompt.PromptInfo``)."""

    request_id: str
    attempt: int
    session_id: str
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int
    keys: list[str]
    tail_token_ids: list[int] | None
    block_tokens: int
    read_side: ReadSide
    block_keys: list[str]
    tail_key: str | None


# --------------------------------------------------------------------------- attach

class AttachEngine(Message, tag="engine.attach", frozen=True):
    """Bind this connection to engine ``engine_id`` of the node.

    ``replace``: take the id over from a live attachment (its requests fail as retryable and
    its connection is closed); without it a second attach of a held id is ALREADY_EXISTS.
    """

    engine_id: str
    role: EngineRole
    kv_spec: KVSpec
    api_version: int = ENGINE_API_VERSION
    replace: bool = False


class EngineAttached(Message, tag="engine.attached", frozen=True):
    """The node's side: its KV spec and the arena segment to map (``/dev/shm/<arena_name>``)."""

    node_id: str
    engine_id: str
    kv_spec: KVSpec
    arena_name: str
    arena_bytes: int
    max_wait_s: float            # the longest a NextRequest/ClaimRequest/WaitLayer may block
    # the engine sends EngineAlive every heartbeat_s; after silence_s without a word from it
    # the node detaches it (a stopped or frozen process). 0: the node watches for neither
    heartbeat_s: float = 0.0
    silence_s: float = 0.0


# --------------------------------------------------------------------------- getting requests

class NextRequest(Message, tag="engine.next", frozen=True):
    """The next request(s) assigned to this engine, FIFO; waits up to ``timeout_s`` for the
    first (0: do not wait), then returns up to ``max_items`` already queued."""

    timeout_s: float
    max_items: int = 1


class ClaimRequest(Message, tag="engine.claim", frozen=True):
    """The request ``request_id`` once it is assigned here (waits up to ``timeout_s``;
    NOT_FOUND after that, INVALID_ARGUMENT at once if another engine holds it). With
    ``attempt``, only that attempt: a frontend re-plans by sending the request to the engine
    again, and the engine's request of an earlier attempt (still ending) must not take the new
    one — a claim of a superseded attempt is CANCELLED at once."""

    request_id: str
    timeout_s: float
    attempt: int | None = None


class PrefillAssigned(Message, tag="engine.prefill", frozen=True):
    """A prefill request: the usable hit is final; layers come with ``WaitLayer``."""

    prompt: EnginePrompt
    hit_tokens: int


class DecodeAssigned(Message, tag="engine.decode", frozen=True):
    """A decode request whose full prompt KV is in the DE buffer: ``layers[l]`` is
    ``[prompt_tokens, B]`` of layer ``l``."""

    prompt: EnginePrompt
    hit_tokens: int
    first_token_id: int | None
    layers: list[ArenaSlot]


class Assigned(Message, tag="engine.assigned", frozen=True):
    """Reply to NextRequest / ClaimRequest: zero or more requests (one kind per role)."""

    prefill: list[PrefillAssigned] = []
    decode: list[DecodeAssigned] = []


# --------------------------------------------------------------------------- prefill

class WaitLayer(Message, tag="engine.wait_layer", frozen=True):
    request_id: str
    attempt: int
    layer: int
    timeout_s: float


class LayerReady(Message, tag="engine.layer_ready", frozen=True):
    """Layer ``layer``'s hit KV ``[hit_tokens, B]`` is at ``hit``; write ``[new_tokens, B]``
    of new KV into ``output`` (``prompt`` is the whole ``[prompt_tokens, B]`` layer)."""

    request_id: str
    layer: int
    hit: ArenaSlot
    output: ArenaSlot
    prompt: ArenaSlot


class PutLayer(Message, tag="engine.put_layer", frozen=True):
    request_id: str
    attempt: int
    layer: int


class FinishPrefill(Message, tag="engine.finish_prefill", frozen=True):
    """Every layer was put; the reply comes once the DE loader holds the full prompt KV."""

    request_id: str
    attempt: int
    first_token_id: int | None


# --------------------------------------------------------------------------- decode

class TookKV(Message, tag="engine.took_kv", frozen=True):
    request_id: str
    attempt: int


class SecondToken(Message, tag="engine.second_token", frozen=True):
    request_id: str
    attempt: int


class NewBlock(Message, tag="engine.new_block", frozen=True):
    """A page for the Full Block of ``token_ids`` (rest of the prompt tail, then generated)."""

    request_id: str
    attempt: int
    token_ids: list[int]


class BlockOpened(Message, tag="engine.block", frozen=True):
    """The page ``[L, block_tokens, B]`` at ``slot``; ``key`` is its storage key."""

    request_id: str
    index: int
    key: str
    slot: ArenaSlot


class PutBlock(Message, tag="engine.put_block", frozen=True):
    request_id: str
    attempt: int
    index: int


class FinishDecode(Message, tag="engine.finish_decode", frozen=True):
    request_id: str
    attempt: int
    output_token_ids: list[int]


class FailRequest(Message, tag="engine.fail", frozen=True):
    """Give the request up (or acknowledge an error); the node frees what it holds."""

    request_id: str
    attempt: int
    reason: str = ""


class AbandonRequest(Message, tag="engine.abandon", frozen=True):
    """The engine will not claim ``request_id``: it could not open it (a refused layout, a
    prompt check, a failed claim) and computes it without dualpath. The node fails the
    attempt assigned to this engine now (retryable: the scheduler re-plans it) instead of
    holding it to its deadline; a plan that has not reached the node yet is waited for up to
    ``timeout_s`` (bounded by the node's unknown-id grace)."""

    request_id: str
    reason: str = ""
    timeout_s: float = 30.0
    attempt: int | None = None      # only this attempt (an earlier one's give-up is a no-op)


class ReportCounters(Message, tag="engine.counters", frozen=True):
    """The engine's own counters (e.g. the emulator's byte checks), cumulative: the node
    exposes the latest per engine in its stats as ``engine_<name>``."""

    counters: dict[str, float]


class EngineAlive(Message, tag="engine.alive", frozen=True):
    """The engine's process is running (sent every ``EngineAttached.heartbeat_s``; any call
    counts as well). A node that hears nothing from an attached engine for ``silence_s``
    detaches it: its requests fail retryable and re-plan elsewhere (docs/engine-api.md,
    "A silent engine").

    ``busy_s``: how long the engine's current step has run (0: not in a step, or the engine
    does not report its steps). Past the node's ``engine_stuck_s`` the engine is stuck: its
    requests fail, it leaves placement, and it returns once a beat reports it out of that
    step ("A stuck engine"). ``steps``: how many steps the engine has begun (its node's stats
    show the sum as ``engine_steps``; 0 from an engine that does not report them)."""

    busy_s: float = 0.0
    steps: int = 0


# --------------------------------------------------------------------------- collectives

class CollectiveBegin(Message, tag="engine.collective_begin", frozen=True):
    """This engine enters a collective (TP/EP communication on the compute network): its node
    caps KV egress until :class:`CollectiveEnd` — or until the node's
    ``arbiter.collective_max_s``, so a hung engine cannot hold the cap (docs/qos.md)."""


class CollectiveEnd(Message, tag="engine.collective_end", frozen=True):
    """This engine left the collective it began (one end per begin)."""


class EngineOk(Message, tag="engine.ok", frozen=True):
    """Reply to the calls that return nothing else."""

    request_id: str = ""


EngineRequest = Union[AttachEngine, NextRequest, ClaimRequest, WaitLayer, PutLayer,
                      FinishPrefill, TookKV, SecondToken, NewBlock, PutBlock, FinishDecode,
                      FailRequest, AbandonRequest, ReportCounters, EngineAlive,
                      CollectiveBegin, CollectiveEnd]
EngineReply = Union[EngineAttached, Assigned, LayerReady, BlockOpened, EngineOk, ErrorReply]
