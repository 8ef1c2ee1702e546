"""The transfer state of one PE receiver attempt, sans I/O (paper §4–5; docs/datapath.md).

Which layer of the hit is loaded, what may be forwarded to the DE loader, how far pulls run
ahead of the engine, what a shortened hit changes and when the pages may go back: a plain
class fed events (replies, layers received, engine calls, failures) that returns small action
objects. The asyncio shell (:class:`services.pe_receiver.attempt.PrefillAttempt`) runs them.
No asyncio, no UCX, no clock: times come with the events, so every ordering and failure is a
millisecond unit test (``tests/test_pe_transfer_core.py``).

Event methods raise the typed error of a bad input (a malformed reply, an engine call out of
order) and change nothing the caller could observe half-done; a failure of the attempt itself
goes through :meth:`PrefillTransfer.failed`, which answers :class:`Abort` once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from common.errors import (Cancelled, DeadlineExceeded, DualpathError, InternalError,
                           InvalidArgument, PeerFailed, ProtocolError, Unavailable)
from common.protocol import Endpoint, LayerSlots, PrepareDecode
from services.engine_api.prompt import PromptInfo
from services.node.actions import Count, Log, Report
from services.node.errors import copy_error, detach_fields, with_hop


# ---------------------------------------------------------------------------- actions
# Report, Log and Count are the actions both cores share (services/node/actions.py).

@dataclass(frozen=True, slots=True)
class MarkReady:
    """These layers' hit KV is in the PE buffer: the engine may read them."""

    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadLayer:
    """PE path with a paced H2D link: charge ``nbytes`` for ``layer``, then :meth:`layer_loaded`."""

    layer: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PostPull:
    """DE path (and a split read's DE part): post one receive for ``layers``
    (``[l, 0:hit_tokens]`` each), then pull them."""

    layers: tuple[int, ...]
    hit_tokens: int


@dataclass(frozen=True, slots=True)
class HandOff:
    """The usable hit is known: give the request to its engine."""


@dataclass(frozen=True, slots=True)
class SendLayer:
    """Forward tokens ``[first_token, last_token)`` of ``layer`` into the DE's ``slots``."""

    layer: int
    slots: LayerSlots
    first_token: int
    last_token: int


@dataclass(frozen=True, slots=True)
class Abort:
    """The attempt failed (``error``): stop its work; the release follows."""

    error: DualpathError


@dataclass(frozen=True, slots=True)
class AwaitEngineRelease:
    """Release: the engine still holds the request; wait (bounded) until it lets go."""


@dataclass(frozen=True, slots=True)
class AbortDE:
    """Release: tell the DE loader to drop its side now (``reason`` is the error message)."""

    reason: str


@dataclass(frozen=True, slots=True)
class FreePages:
    """Release: give the request's PE buffer region back (answered at most once)."""


Action = Union[Report, Count, Log, MarkReady, LoadLayer, PostPull, HandOff, SendLayer, Abort,
               AwaitEngineRelease, AbortDE, FreePages]


@dataclass(frozen=True, slots=True)
class Lookahead:
    """The look-ahead bounds (``[pe_receiver]`` settings of the same names)."""

    lookahead_layers: int = 8       # layers loaded/pulled ahead of the engine's consumption
    layers_per_pull: int = 2        # layers per PullLayers call (one transfer)
    pulls_in_flight: int = 2        # PullLayers calls outstanding at once
    max_unsent_layers: int = 8      # put_layer waits beyond this many unsent layers


# ---------------------------------------------------------------------------- the core
class PrefillTransfer:
    """Per-request transfer state of one PE attempt: events in, actions out."""

    def __init__(self, info: PromptInfo, num_layers: int, row_bytes: int,
                 limits: Lookahead | None = None, engine_id: str = "") -> None:
        self.info, self.num_layers, self.row_bytes = info, num_layers, row_bytes
        self.limits, self.engine_id = limits or Lookahead(), engine_id
        self.hit_tokens = info.hit_tokens   # usable hit; final once hit_final
        self.hit_final = False
        self.phase = "pe_receiver"          # the hop a deadline or untagged error names
        self.error: DualpathError | None = None
        self.dropped_reason: str | None = None
        self.ready = [False] * num_layers
        self.fwd: list[LayerSlots | None] = [None] * num_layers
        self.consumed = self.put = self.sent = 0
        self.loaded, self.loading, self.paced = 0, False, False
        self.next_pull, self.pulls, self.pulling = 0, 0, False
        self.sending = False
        self.first_token_id: int | None = None
        self.region_allocated = self.pages_freed = False
        self.engine_holds = self.engine_done = self.prefill_done = False
        self.t_pull_start: float | None = None
        self.layer_requested: list[float | None] = [None] * num_layers
        self.layer_arrival: list[float | None] = [None] * num_layers
        self._read_hit = info.hit_tokens
        # A split read: the DE's usable part, known with its first pull reply (None before).
        self.de_hit: int | None = None
        # Storage bytes this attempt read (reported when it fails: a retry reads them again,
        # and the replay's storage check counts both reads).
        self.read_bytes = 0
        self._pe_read_bytes = 0

    # ------------------------------------------------------------------ queries
    @property
    def put_blocked(self) -> bool:
        """put_layer waits: too many put layers are not sent yet (``max_unsent_layers``)."""
        return self.put - self.sent > self.limits.max_unsent_layers

    @property
    def all_sent(self) -> bool:
        return self.sent >= self.num_layers

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument(f"layer {layer} out of range [0, {self.num_layers})")

    def raise_if_failed(self) -> None:
        """Raise (a copy of) the attempt's error, if it failed."""
        if self.error is not None:
            raise copy_error(self.error)

    def output_range(self, layer: int) -> tuple[int, int]:
        """Token range of ``layer`` the engine writes; only once its hit KV is loaded, since
        the load may still overwrite part of it."""
        self.check_layer(layer)
        self.raise_if_failed()
        if not self.ready[layer]:
            raise InvalidArgument(f"output({layer}) before its hit KV was loaded: await "
                                  f"layer({layer}) first")
        return self.hit_tokens, self.info.prompt_tokens

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        """The attempt's task runs; an attempt dropped before it started raises."""
        self.raise_if_failed()
        self.phase = "pe_buffer"

    def allocated(self) -> list[Action]:
        self.region_allocated = True
        self.phase = "de_loader"
        return [Report("allocated")]

    def prepare_sent(self, de_engine: str, pe_node: str, ucx: tuple[str, int],
                     read_gateway: Endpoint | None, budget_s: float) -> PrepareDecode:
        """The PrepareDecode to send (the DE reads the hit only on the DE path, its leading
        ``split_tokens`` on a split read, through ``read_gateway``); on the PE path and a split
        read this node's gateway read runs beside it."""
        info, side = self.info, self.info.read_side
        if side in ("pe", "split"):
            self.phase = "gateway"
        n = info.hit_blocks
        return PrepareDecode(
            info.request_id, info.attempt, info.session_id, de_engine, pe_node, side,
            info.prompt_tokens, info.hit_tokens, info.gen_tokens, list(info.keys[:n]),
            list(info.keys[n:]), ucx[0], ucx[1],
            list(info.tail_token_ids) if info.tail_token_ids is not None else None,
            read_gateway if side in ("de", "split") else None, budget_s, info.split_tokens)

    def pe_read_done(self, prefix_blocks: int | None, nbytes: int | None = None) -> list[Action]:
        """The gateway found the first ``prefix_blocks`` of the hit blocks it was asked for
        (from ``info.split_blocks``: 0 but on a split read; None: nothing was read) and read ``nbytes`` (its
        own count, which includes found blocks past a gap; None: the prefix's bytes).

        The hit takes effect with the PrepareDecode reply (:meth:`prepare_replied`), on a
        split read with the DE's first pull reply (:meth:`pull_replied`).
        """
        info, first = self.info, self.info.split_tokens
        if prefix_blocks is None:
            self._read_hit = first
            return []
        self.read_bytes = self._pe_read_bytes = (
            nbytes if nbytes is not None
            else prefix_blocks * info.block_tokens * self._token_bytes)
        n, acts = info.hit_blocks - info.split_blocks, []
        if prefix_blocks < n:
            acts = self._shortened(planned_blocks=n, found_blocks=prefix_blocks, side="pe")
        self._read_hit = min(info.hit_tokens, first + prefix_blocks * info.block_tokens)
        return acts

    def prepare_replied(self, forward: Sequence[LayerSlots], *, pace_loads: bool = False,
                        now: float = 0.0) -> list[Action]:
        """The DE loader allocated its side; ``forward`` says where layers go (PE/none path).

        ``pace_loads``: each layer's H2D load is charged on the emulated CNIC (§5.2).
        """
        side = self.info.read_side
        if side == "pe":
            self.hit_tokens = self._read_hit
        self._check_forward(forward)
        if side in ("de", "split"):
            self.pulling, self.t_pull_start = True, now
            return self._next_pulls()
        # "none" with a hit is the oracle bound (paper §9): the hit's KV is assumed resident
        # on both engines, so nothing is read, loaded or sent for it and only the new tokens
        # are prefilled; hit_tokens stays the planned hit (docs/datapath.md "Oracle")
        for ls in forward:
            self.fwd[ls.layer] = ls
        self.hit_final = True
        return self._start_loads(pace_loads) + self._hand_off()

    @property
    def _token_bytes(self) -> int:
        return self.row_bytes * self.num_layers

    def _check_forward(self, forward: Sequence[LayerSlots]) -> None:
        want = [] if self.info.read_side in ("de", "split") else list(range(self.num_layers))
        row = (self.info.prompt_tokens - self._forward_first()) * self.row_bytes
        got = [ls.layer for ls in forward]
        if got != want or any(sum(n for _, n in ls.slots) != row for ls in forward):
            raise with_hop(ProtocolError(
                f"DE loader answered PrepareDecode with forward slots for layers "
                f"{got[:8]}..., expected {len(want)} layers of {row} B"), "de_loader")

    def _forward_first(self) -> int:
        """First token forwarded to the DE: 0 on the PE path (the DE lacks the hit), the hit
        on the DE path (the DE read it) and in the oracle (the DE holds it already), the DE's
        usable part on a split read (the rest of the hit, read here, goes with the new KV)."""
        side = self.info.read_side
        if side == "split":                 # known before any send: sends follow the reply
            return self.info.split_tokens if self.de_hit is None else self.de_hit
        return 0 if side == "pe" else self.hit_tokens

    def _hand_off(self) -> list[Action]:
        self.engine_holds, self.phase = True, "engine"
        return [Report("read_done"), HandOff()]

    def _shortened(self, **fields: object) -> list[Action]:
        return [Count("hit_shortened"),
                Log("info", "hit_shortened", {"request_id": self.info.request_id, **fields})]

    # ------------------------------------------------------------------ PE path: load
    def _start_loads(self, pace: bool) -> list[Action]:
        if not (self.hit_tokens * self.row_bytes and pace) or self.info.read_side == "none":
            self.loaded = self.num_layers
            self.ready = [True] * self.num_layers
            return [MarkReady(tuple(range(self.num_layers)))]
        self.paced = True
        return self._next_load()

    def _next_load(self) -> list[Action]:
        """One paced load at a time, never more than ``lookahead_layers`` ahead."""
        layer = self.loaded
        if (not self.paced or self.loading or self.error is not None
                or layer >= min(self.num_layers, self.consumed + self.limits.lookahead_layers)):
            return []
        self.loading = True
        return [LoadLayer(layer, self.hit_tokens * self.row_bytes)]

    def layer_loaded(self, layer: int) -> list[Action]:
        self.loading, self.loaded, self.ready[layer] = False, layer + 1, True
        return [MarkReady((layer,)), *self._next_load()]

    # ------------------------------------------------------------------ DE path: pull
    def _may_pull(self) -> bool:
        nxt, lim = self.next_pull, self.limits
        # Layer 0 alone on the wire first: its reply (the usable hit) hands the request to
        # the engine, so nothing else competes with it. In-flight calls are bounded too:
        # concurrent transfers interleave on the wire, and fewer at once make layers arrive
        # in the order the engine needs them.
        return (self.pulling and self.error is None and nxt < self.num_layers
                and nxt < self.consumed + lim.lookahead_layers
                and self.pulls < lim.pulls_in_flight and (nxt == 0 or self.hit_final))

    def _next_pulls(self) -> list[Action]:
        acts: list[Action] = []
        while self._may_pull():
            nxt = self.next_pull
            # Calls ramp up 1, 1, 2, 4, ... layers (capped by layers_per_pull) so the next
            # layers follow the first closely.
            end = min(self.num_layers, nxt + min(self.limits.layers_per_pull, max(1, nxt)),
                      self.consumed + self.limits.lookahead_layers)
            self.next_pull, self.pulls = end, self.pulls + 1
            acts.append(PostPull(tuple(range(nxt, end)), self.info.de_read_tokens))
        return acts

    def pull_posted(self, layers: Sequence[int], now: float) -> None:
        """The receive of one pull is posted (timings for benchmarks)."""
        for layer in layers:
            self.layer_requested[layer] = now

    def pull_replied(self, layers: Sequence[int], hit: int,
                     returns: Sequence[LayerSlots]) -> list[Action]:
        """The DE loader sent ``layers``; ``hit`` is its usable hit, ``returns`` where the
        computed part of each layer goes back. Raises ProtocolError on a bad reply."""
        self._check_pull_reply(list(layers), hit, returns)
        acts: list[Action] = []
        if not self.hit_final:
            planned = self.info.de_read_tokens
            if hit < planned:
                acts = self._shortened(planned=planned, hit=hit, side="de")
            self.de_hit, self.hit_final = hit, True
            # A split read's own part counts only behind a whole DE part (a gap ends the hit).
            self.hit_tokens = self._read_hit if self.info.read_side == "split" \
                and hit == planned else hit
            # The DE loader read at least the usable hit before it answered; its own failure
            # report carries the gateway's exact count (the scheduler keeps the larger).
            self.read_bytes = hit * self._token_bytes + self._pe_read_bytes
            acts += self._hand_off() + self._next_pulls()
        for r in returns:
            self.fwd[r.layer] = r
        return acts + self._next_send()

    def _check_pull_reply(self, layers: list[int], hit: int,
                          returns: Sequence[LayerSlots]) -> None:
        planned, bt = self.info.de_read_tokens, self.info.block_tokens
        if not 0 <= hit <= planned or hit % bt:
            raise ProtocolError(f"DE loader reported hit {hit} for a planned hit of {planned}")
        if self.de_hit is not None and hit != self.de_hit:
            raise ProtocolError(f"DE loader changed the hit from {self.de_hit} to {hit}")
        row = (self.info.prompt_tokens - hit) * self.row_bytes
        if [r.layer for r in returns] != layers or any(
                sum(n for _, n in r.slots) != row for r in returns):
            raise ProtocolError(f"DE loader's return slots do not match layers {layers}")

    def layers_received(self, layers: Sequence[int], now: float) -> list[Action]:
        """The pulled layers landed in the PE buffer: that pull is no longer in flight."""
        for layer in layers:
            self.layer_arrival[layer], self.ready[layer] = now, True
        self.pulls -= 1
        return [MarkReady(tuple(layers)), *self._next_pulls()]

    # ------------------------------------------------------------------ engine side
    def engine_wants(self, layer: int) -> list[Action]:
        """The engine awaits ``layer``: consumption moves the look-ahead window."""
        self.check_layer(layer)
        if layer + 1 <= self.consumed:
            return []
        self.consumed = layer + 1
        return self._next_pulls() + self._next_load()

    def engine_put(self, layer: int) -> list[Action]:
        """The engine wrote ``layer``'s new KV (layers are put in order)."""
        self.raise_if_failed()
        if layer != self.put:
            raise InvalidArgument(f"put_layer({layer}): layers are put in order, next is "
                                  f"{self.put}")
        self.put += 1
        return self._next_send()

    def engine_finished(self, first_token_id: int | None) -> list[Action]:
        self.engine_holds, self.engine_done = False, True
        acts: list[Action] = []
        if self.put != self.num_layers and self.error is None:
            acts = self.failed(InvalidArgument(
                f"engine finished after putting {self.put} of {self.num_layers} layers"),
                "engine")
        self.first_token_id, self.phase = first_token_id, "de_loader"
        return acts

    def engine_failed(self, error: BaseException | None) -> list[Action]:
        # an engine whose process may still run (silent, stuck, replaced) may still write
        # into the pages: they stay held until the release's bounded wait for it ends
        self.engine_holds = self.engine_holds and getattr(error, "alive", False) is True
        if self.error is not None:
            return []
        err = error if isinstance(error, DualpathError) else InternalError(
            f"prefill engine {self.engine_id} gave up: {error!r}")
        return self.failed(err, "engine")

    def engine_discarded(self) -> None:
        """The request was taken back from the engine's queue: the engine never saw it."""
        self.engine_holds = False

    # ------------------------------------------------------------------ forwarding
    def _next_send(self) -> list[Action]:
        """One layer on the wire at a time, in order, once put and its slots are known."""
        layer = self.sent
        if self.sending or self.error is not None or layer >= min(self.put, self.num_layers):
            return []
        slots = self.fwd[layer]
        if slots is None:
            return []
        self.sending = True
        return [SendLayer(layer, slots, self._forward_first(), self.info.prompt_tokens)]

    def layer_sent(self, layer: int) -> list[Action]:
        self.sent, self.sending = layer + 1, False
        return self._next_send()

    def prefill_done_acked(self) -> list[Action]:
        """The DE loader holds the full prompt KV."""
        self.prefill_done = True
        return [Report("prefill_done")]

    # ------------------------------------------------------------------ failures
    def failed(self, error: DualpathError, hop: str | None = None) -> list[Action]:
        """The attempt fails with ``error`` (tagged ``hop`` unless it names one); first wins."""
        if self.error is not None:
            return []
        self.error = with_hop(error, hop) if hop is not None else error
        return [Abort(self.error)]

    def dropped(self, reason: str) -> list[Action]:
        """Revoked (or the service stops): end without reporting."""
        if self.error is not None:
            return []
        self.dropped_reason = reason
        return self.failed(Cancelled(f"attempt dropped: {reason}"), "scheduler")

    def deadline(self) -> list[Action]:
        info = self.info
        return self.failed(DeadlineExceeded(
            f"request {info.request_id} attempt {info.attempt}: deadline passed during "
            f"{self.phase}"), self.phase)

    def cancelled(self) -> list[Action]:
        """The attempt's task was cancelled from outside (the service stops)."""
        if self.error is not None:
            return []
        self.dropped_reason = self.dropped_reason or "cancelled"
        return self.failed(Cancelled("attempt cancelled (service stopping)"), "pe_receiver")

    # ------------------------------------------------------------------ the end
    def finished_ok(self) -> list[Action]:
        return [Count("attempts_ok")]

    def finished_failed(self) -> list[Action]:
        """The attempt ended with its error: count it, and report it unless it was dropped."""
        err = self.error
        if err is None:
            raise InternalError("finished_failed() of an attempt without an error")
        reads = {"read_bytes": self.read_bytes, "pe_read_bytes": self._pe_read_bytes}
        if self.dropped_reason is not None:
            # the scheduler or the DE ended it; what was read still counts (a retry re-reads)
            acts: list[Action] = [Count("attempts_dropped")]
            if self.read_bytes:
                acts.append(Report("dropped", reads))
            return acts
        hop = getattr(err, "hop", None)
        return [Count("attempts_failed"),
                Log("warning", "prefill_attempt_failed", {
                    "request_id": self.info.request_id, "attempt": self.info.attempt,
                    "hop": hop, "code": err.code.value, "error": err.message}),
                Report("failed", {"code": err.code.value, "message": err.message[:500],
                                  "retryable": err.retryable, "hop": hop, **reads,
                                  **detach_fields(err)})]

    def release(self) -> list[Action]:
        """What the release does once the attempt's tasks ended, in order: wait for the
        engine to let go (it may still write into the pages), abort the DE side, free."""
        acts: list[Action] = []
        if self.engine_holds:
            acts.append(AwaitEngineRelease())
        err = self.error
        if err is not None and self.dropped_reason is None and self.region_allocated \
                and _de_may_hold(err):
            acts.append(AbortDE(err.message[:300]))
        if self.region_allocated and not self.pages_freed:
            self.pages_freed = True
            acts.append(FreePages())
        return acts


def _de_may_hold(err: DualpathError) -> bool:
    """A DE loader that failed or is unreachable holds nothing to abort."""
    return not (getattr(err, "hop", "") == "de_loader"
                and isinstance(err, (PeerFailed, Unavailable)))
