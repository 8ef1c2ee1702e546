"""The transfer state of one (request, attempt) on a DE loader, without I/O (docs/datapath.md).

The paper's DE-side mechanism (§2.4–2.7) as a plain class fed events and returning actions;
:class:`~services.de_loader.attempt.DecodeAttempt` is the asyncio shell that runs them:

* prepare → the DE buffer region ``[L, prompt, B]`` is allocated → PE/none path: one
  :class:`PostReceive` per layer for ``[l, 0:prompt]`` (oracle, "none" with a hit: only
  ``[l, hit:prompt]``, the hit is resident); DE path: :class:`ReadHit` into
  ``[l, 0:hit]`` (fewer blocks found than planned shortens the hit);
* DE path, per ``PullLayers`` once the read is done: post the returns of ``[l, hit:prompt]``
  (the shortened hit) and send ``[l, 0:hit]`` into the PE's slots (:class:`SendLayers`);
* ``PrefillDone`` + every receive completed → :class:`HandToEngine`, and :class:`WritePrompt`
  of the prompt's full blocks past the stored hit;
* engine: took the KV (the region is freed once the write-back read it), generated blocks
  (:class:`WriteGenerated`, then :class:`FreeBlock`), finish (:class:`Report` ``finished``);
* failure (peer, gateway, engine, deadline, revocation): the first error wins, is reported
  when the PE cannot know it, and :class:`Release` starts the shell's unwinding; every page is
  freed exactly once (:meth:`DecodeTransfer.free_all`).

Validation of the PE's calls raises the typed error the RPC handler replies with. Nothing here
imports asyncio, a transport or a service: tests drive every ordering in milliseconds.
"""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping, Sequence
from dataclasses import dataclass

from common.errors import (AlreadyExists, Cancelled, DeadlineExceeded, DualpathError,
                           InternalError, InvalidArgument)
from common.kv import KVSpec
from common.protocol import LayerSlots
from services.engine_api.prompt import PromptInfo, next_block_key
from services.node.actions import Log, Report
from services.node.errors import copy_error, detach_fields, peer_error, with_hop


# ---------------------------------------------------------------------- actions
# Report and Log are the actions both cores share (services/node/actions.py).

@dataclass(frozen=True)
class ReadHit:
    """DE path: read the hit's leading ``blocks`` Full Blocks from storage into ``[l, 0:hit]``."""

    blocks: int


@dataclass(frozen=True)
class PostReceive:
    """Post the receive of ``[layer, first:prompt]`` from the PE."""

    layer: int
    first: int


@dataclass(frozen=True)
class SendLayers:
    """Send ``[l, 0:tokens]`` of ``layers`` into the PE's ``slots``, as one transfer."""

    transfer_id: int
    layers: tuple[int, ...]
    slots: tuple[tuple[int, int], ...]
    tokens: int


@dataclass(frozen=True)
class HandToEngine:
    """The full prompt KV is in the region: queue the request for the decode engine."""

    hit_tokens: int
    first_token_id: int | None


@dataclass(frozen=True)
class WritePrompt:
    """Persist the prompt's full blocks ``first, first+1, …`` under ``keys``."""

    first: int
    keys: tuple[str, ...]

    def batches(self, per: int) -> list[tuple[int, tuple[str, ...]]]:
        """(first block index, keys) of each ``WriteBlocks`` of at most ``per`` blocks."""
        return [(self.first + i, self.keys[i:i + per]) for i in range(0, len(self.keys), per)]


@dataclass(frozen=True)
class WriteGenerated:
    """Persist a generated block's page under ``key`` (answer with ``block_written``)."""

    block: Hashable
    key: str


@dataclass(frozen=True)
class FreeRegion:
    """Give the prompt's region back to the DE buffer."""


@dataclass(frozen=True)
class FreeBlock:
    """Give a generated block's page back to the DE buffer."""

    block: Hashable


@dataclass(frozen=True)
class Release:
    """The attempt ended: cancel its I/O, wait for the engine, free its pages."""


@dataclass(frozen=True)
class AwaitEngine:
    """The engine may still read the pages: wait (bounded) until it lets go."""


Action = (ReadHit | PostReceive | SendLayers | HandToEngine | WritePrompt | WriteGenerated
          | FreeRegion | FreeBlock | Report | Log | Release | AwaitEngine)


@dataclass(frozen=True)
class PullPlan:
    """A validated ``PullLayers``: its layers, grouped into transfers."""

    layers: tuple[int, ...]
    transfers: tuple[tuple[int, tuple[LayerSlots, ...]], ...]


# ---------------------------------------------------------------------- the core
class DecodeTransfer:
    """Per-attempt state of the DE side: which layers are here, what may be sent, which
    pages are held. States: reserved → preparing → assembling → ready → decoding →
    finishing → done (any of them may end in an error)."""

    def __init__(self, request_id: str, attempt: int, engine_id: str, spec: KVSpec, *,
                 writeback: bool, counters: MutableMapping[str, int]) -> None:
        self.request_id, self.attempt, self.engine_id = request_id, attempt, engine_id
        self.name = f"{request_id}#{attempt}"   # for messages: request#attempt
        self.spec, self.writeback, self.counters = spec, writeback, counters
        self.info: PromptInfo | None = None
        self.state = "reserved"
        self.bound = False
        self.hbm_bytes = self.tokens = 0
        self.error: DualpathError | None = None
        self.dropped_reason: str | None = None
        self.hit_tokens = 0
        self.read_bytes = 0     # storage bytes of the DE read, reported if the attempt fails
        self.first_token_id: int | None = None
        self._done_msg: tuple[int, int | None] | None = None
        self.pulled: set[int] = set()
        self.expected_receives = self.received = 0
        self.read_done = self.prompt_written = self.persist = False
        self.engine_holds_kv = self.engine_let_go = False
        self.last_key: str | None = None
        self.blocks_put = 0
        self.open_blocks: dict[Hashable, str] = {}     # handle → key: the engine writes them
        self.writing: set[Hashable] = set()            # put, being persisted
        self.has_region = self.region_freed = False
        self.releasing = self.released = False

    # ------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        return self.released or self.releasing

    @property
    def ending(self) -> bool:
        """Failed or releasing: whatever was just allocated or posted goes back at once."""
        return self.error is not None or self.releasing

    @property
    def all_received(self) -> bool:
        return self.expected_receives > 0 and self.received >= self.expected_receives

    def check(self) -> None:
        """Raise (a copy of) the attempt's error, if it failed."""
        if self.error is not None:
            raise copy_error(self.error)

    def _prepared(self) -> PromptInfo:
        self.check()
        if self.info is None or not self.has_region:
            raise InvalidArgument(f"attempt {self.name} is not prepared (PrepareDecode first)")
        return self.info

    def _info(self) -> PromptInfo:
        if self.info is None:
            raise InternalError(f"attempt {self.name}: event before PrepareDecode")
        return self.info

    # ------------------------------------------------------------------ binding / prepare
    def bind(self, hbm_bytes: int, tokens: int) -> None:
        self.bound, self.hbm_bytes, self.tokens = True, hbm_bytes, tokens

    def prepare(self, info: PromptInfo) -> None:
        """``PrepareDecode`` accepted: the region of ``info.prompt_tokens`` is allocated next."""
        if self.info is not None:
            raise AlreadyExists(f"attempt {self.name} was prepared already")
        self.check()
        self.info, self.state = info, "preparing"
        if not self.bound:
            self.hbm_bytes = self.spec.bytes_per_token * (info.prompt_tokens + info.gen_tokens)
            self.tokens = info.prompt_tokens + info.gen_tokens
        # the DE path reads the hit, a split read its leading part (the PE reads the rest and
        # forwards it with the new tokens); the PE path and the oracle: the plan's hit
        self.hit_tokens = info.de_read_tokens if info.read_side == "split" else info.hit_tokens
        # generated blocks chain on the prompt's keys: only a fully keyed prompt persists them
        self.persist = (self.writeback and info.fully_keyed
                        and (info.tail_token_ids is not None or info.tail_tokens == 0))
        self.last_key = info.last_key()

    def region_allocated(self) -> list[Action]:
        """The region is ours: read the hit (DE path; a split read: its leading part) or receive
        every layer from the PE."""
        info = self._info()
        self.has_region = True
        self.expected_receives = self.spec.num_layers
        if info.read_side in ("de", "split"):
            return [ReadHit(info.de_read_tokens // info.block_tokens)]
        self.read_done = True
        # PE path: the whole prompt comes from the PE; oracle ("none" with a hit): the hit is
        # resident here already (paper §9's bound), only [l, hit:prompt] comes
        first = info.hit_tokens if info.read_side == "none" else 0
        return [PostReceive(layer, first) for layer in range(self.spec.num_layers)]

    # ------------------------------------------------------------------ DE read / receives
    def hit_blocks_read(self, found_blocks: int, nbytes: int | None = None) -> list[Action]:
        """The gateway held the first ``found_blocks`` of the planned hit blocks and read
        ``nbytes`` (its count; None: the prefix's bytes)."""
        info = self._info()
        self.read_bytes = (nbytes if nbytes is not None
                           else found_blocks * info.block_tokens * self.spec.bytes_per_token)
        return self.hit_read(min(info.de_read_tokens, found_blocks * info.block_tokens))

    def hit_read(self, hit_tokens: int) -> list[Action]:
        """The DE read ended with ``hit_tokens`` usable; fewer than planned shortens the hit
        (the PE then returns ``[l, hit:prompt]`` from the shorter hit on)."""
        info = self._info()
        if self.read_done:
            raise InternalError(f"attempt {self.name}: the hit was read twice")
        out: list[Action] = []
        planned = info.de_read_tokens
        hit_tokens = min(hit_tokens, planned)
        if hit_tokens < planned:
            self.counters["hit_shortened"] += 1
            out.append(Log("info", "hit_shortened", {"request_id": self.request_id,
                                                     "planned": planned,
                                                     "hit": hit_tokens, "side": "de"}))
        self.hit_tokens, self.read_done = hit_tokens, True
        return out

    def read_failed(self, err: DualpathError) -> list[Action]:
        return self.abort(with_hop(err, "gateway"), report=True)

    def layer_received(self) -> list[Action]:
        """One posted receive completed."""
        if self.received >= self.expected_receives:
            raise InternalError(f"attempt {self.name}: more receives than posted")
        self.received += 1
        return []

    def peer_failed(self, err: DualpathError) -> list[Action]:
        """A receive from the PE failed: the PE's side (retryable); a deadline the PE sees too."""
        return self.abort(with_hop(peer_error(err), "pe_receiver"),
                          report=not isinstance(err, DeadlineExceeded))

    # ------------------------------------------------------------------ DE path: pulls
    def pull(self, layers: Sequence[LayerSlots]) -> PullPlan:
        """Validate a ``PullLayers``; its layers count as pulled from now on."""
        info = self._prepared()
        if info.read_side not in ("de", "split"):
            raise InvalidArgument(f"PullLayers for {self.request_id}: its read side is "
                                  f"{info.read_side!r}, not 'de' or 'split'")
        row = info.de_read_tokens * self.spec.kv_bytes_per_token_per_layer
        for ls in layers:
            _check_layer(ls, self.spec.num_layers, row)
        ids = [ls.layer for ls in layers]
        if len(set(ids)) != len(ids) or self.pulled & set(ids):
            raise InvalidArgument(f"PullLayers: layers {ids} pulled twice")
        plan = PullPlan(tuple(ids), tuple(_transfers(layers)))
        self.pulled.update(ids)
        return plan

    def pull_ready(self, plan: PullPlan) -> list[Action]:
        """The hit is read: post the returns of ``[l, hit:prompt]``, then send ``[l, 0:hit]``
        (the planned hit's rows: the slots are sized for it)."""
        self.check()
        planned = self._info().de_read_tokens
        out: list[Action] = [PostReceive(layer, self.hit_tokens) for layer in plan.layers]
        for tid, group in plan.transfers:
            out.append(SendLayers(tid, tuple(ls.layer for ls in group),
                                  tuple(s for ls in group for s in ls.slots), planned))
        return out

    def layers_sent(self, plan: PullPlan) -> int:
        """Every send of the pull completed; returns the usable hit the reply carries."""
        self.counters["layers_pulled"] += len(plan.layers)
        return self.hit_tokens

    # ------------------------------------------------------------------ assembly
    def prefill_done(self, hit_tokens: int, first_token_id: int | None) -> None:
        """Validate ``PrefillDone``; the hand-off follows once every receive completed."""
        info = self._prepared()
        if self.state != "preparing":
            raise AlreadyExists(f"PrefillDone for {self.name} twice")
        if info.read_side in ("de", "split"):
            if len(self.pulled) != self.spec.num_layers:
                raise InvalidArgument(f"PrefillDone after pulling {len(self.pulled)} of "
                                      f"{self.spec.num_layers} layers")
            # a split read's hit runs on into the PE's part only behind a whole DE part
            whole = info.read_side == "split" and self.hit_tokens == info.split_tokens
            if whole and not (self.hit_tokens <= hit_tokens <= info.hit_tokens
                              and hit_tokens % info.block_tokens == 0):
                raise InvalidArgument(f"PrefillDone: hit {hit_tokens} outside the split read's "
                                      f"[{self.hit_tokens}, {info.hit_tokens}]")
            if not whole and hit_tokens != self.hit_tokens:
                raise InvalidArgument(f"PrefillDone: hit {hit_tokens}, the DE read "
                                      f"{self.hit_tokens}")
        elif info.read_side == "none":
            if hit_tokens != info.hit_tokens:
                raise InvalidArgument(f"PrefillDone: hit {hit_tokens}, the oracle's resident "
                                      f"hit is {info.hit_tokens}")
        elif not 0 <= hit_tokens <= info.hit_tokens or hit_tokens % info.block_tokens:
            raise InvalidArgument(f"PrefillDone: hit {hit_tokens} outside the plan's "
                                  f"{info.hit_tokens}")
        self.state = "assembling"
        self._done_msg = (hit_tokens, first_token_id)

    def assembled(self) -> list[Action]:
        """Every receive completed: hand the prompt KV over and persist its new full blocks."""
        self.check()
        info = self._info()
        if self._done_msg is None or not self.all_received:
            raise InternalError(f"attempt {self.name}: hand-off before the prompt KV is whole")
        self.hit_tokens, self.first_token_id = self._done_msg
        self.state, self.engine_holds_kv = "ready", True
        self.counters["handed_off"] += 1
        out: list[Action] = [HandToEngine(self.hit_tokens, self.first_token_id)]
        first = self.hit_tokens // info.block_tokens
        keys = info.keys[first:] if self.writeback else ()
        if keys:
            out.append(WritePrompt(first, tuple(keys)))
        else:
            self.prompt_written = True
        return out

    def prompt_write_done(self) -> list[Action]:
        """The prompt's write-back ended (written or given up): it no longer reads the region."""
        self.prompt_written = True
        return self._maybe_free_region()

    def _maybe_free_region(self) -> list[Action]:
        if (self.has_region and not self.region_freed and not self.engine_holds_kv
                and self.prompt_written and self.state in ("decoding", "finishing")):
            self.region_freed = True
            return [FreeRegion()]
        return []

    # ------------------------------------------------------------------ engine side
    def took_kv(self) -> list[Action]:
        """The engine copied the prompt KV: the region goes once the write-back read it."""
        self.engine_holds_kv, self.engine_let_go = False, True
        self.check()
        self.state = "decoding"
        return self._maybe_free_region()

    def second_token(self) -> list[Action]:
        self.check()
        return [Report("second_token")]

    def block_key(self, token_ids: Sequence[int]) -> str:
        """Key of the next generated block (checked before a page is allocated for it)."""
        self.check()
        info = self._info()
        return next_block_key(self.last_key or info.last_key(), token_ids, info.block_tokens)

    @property
    def next_block_index(self) -> int:
        """Sequence index of the next generated block (prompt blocks come first)."""
        return self._info().n_full + len(self.open_blocks) + self.blocks_put

    def block_opened(self, block: Hashable, key: str) -> None:
        """A page for the block keyed ``key`` is allocated; the engine now writes it."""
        self.last_key = key
        self.open_blocks[block] = key

    def put_block(self, block: Hashable, index: int) -> list[Action]:
        """The engine wrote ``block``: persist it, or free it (failed / nothing to persist).
        After a failure the shell raises the error once the page is freed."""
        key = self.open_blocks.pop(block, None)
        if key is None:
            raise InvalidArgument(f"block {index} does not belong to {self.request_id}")
        self.blocks_put += 1
        if self.error is not None or not self.persist:
            return [FreeBlock(block)]
        self.writing.add(block)
        return [WriteGenerated(block, key)]

    def block_written(self, block: Hashable) -> list[Action]:
        """A generated block's write-back ended: its page goes back."""
        if block not in self.writing:
            raise InternalError(f"attempt {self.name}: write-back of a block never put")
        self.writing.discard(block)
        return [FreeBlock(block)]

    def finish(self) -> None:
        """The engine finished decoding (write-backs may still be in flight)."""
        self.check()
        self.state = "finishing"
        self.engine_holds_kv, self.engine_let_go = False, True

    def finished(self, output_token_ids: Sequence[int]) -> list[Action]:
        """Write-backs are durable (or waited for long enough): report the finish."""
        self.check()
        self.counters["finished"] += 1
        self.state = "done"
        return [Report("finished", {"tokens": len(output_token_ids),
                                    "output_token_ids": list(output_token_ids)})]

    def engine_failed(self, error: BaseException | None) -> list[Action]:
        """The engine gave the request up (or acknowledged a cancellation). One whose process
        may still run (silent, stuck, replaced: ``EngineDetached.alive``) may still read the
        prompt pages and write its open blocks: both stay held until the release's bounded
        wait for it ends."""
        out: list[Action] = []
        if getattr(error, "alive", False) is not True:
            self.engine_holds_kv, self.engine_let_go = False, True
            out = [FreeBlock(b) for b in self.open_blocks]
            self.open_blocks.clear()
        if self.error is None:
            err = error if isinstance(error, DualpathError) else InternalError(
                f"decode engine {self.engine_id} gave up: {error!r}")
            out += self.abort(with_hop(err, "engine"), report=True)
        return out

    # ------------------------------------------------------------------ failure / release
    def abort(self, err: DualpathError, report: bool) -> list[Action]:
        """End the attempt with ``err`` (reported when the PE cannot know it)."""
        if self.error is not None or self.done:
            return []
        self.error = err
        out: list[Action] = []
        if report:
            self.counters["attempts_failed"] += 1
            hop = getattr(err, "hop", None)
            out.append(Log("warning", "decode_attempt_failed", {
                "request_id": self.request_id, "attempt": self.attempt, "hop": hop,
                "code": err.code.value, "error": err.message}))
            out.append(Report("failed", {"code": err.code.value, "message": err.message[:500],
                                         "retryable": err.retryable,
                                         "hop": hop or "de_loader",
                                         "read_bytes": self.read_bytes,
                                         "de_read_bytes": self.read_bytes,
                                         **detach_fields(err)}))
        return [*out, Release()]

    def drop(self, reason: str) -> list[Action]:
        """Revocation / ``AbortDecode``: the PE or scheduler knows, so no failure is
        reported — only what this side read, if it read (a retry re-reads it, and the PE's
        own report carries it only once this side answered)."""
        if self.error is not None or self.done:
            return []
        self.dropped_reason = reason
        self.counters["attempts_dropped"] += 1
        return _read_report(self.read_bytes) + self.abort(
            with_hop(Cancelled(f"attempt dropped: {reason}"), "scheduler"), report=False)

    def stale(self, stage: str) -> list[Action]:
        """The scheduler answered a report: this attempt is no longer current."""
        return self.drop(f"scheduler: attempt no longer current (after {stage})")

    def deadline(self) -> list[Action]:
        if self.state == "done" or self.done or self.error is not None:
            return []
        return _read_report(self.read_bytes) + self.abort(with_hop(DeadlineExceeded(
            f"{self.name} passed its deadline on the DE loader ({self.state})"), "de_loader"),
            report=False)

    def begin_release(self) -> bool:
        """False when the release already began (it runs once)."""
        if self.releasing:
            return False
        self.releasing = True
        return True

    def unwound(self, taken_back: bool) -> list[Action]:
        """The attempt's I/O is cancelled; ``taken_back``: the engine never saw the request."""
        if taken_back:
            self.engine_holds_kv = False
        return [AwaitEngine()] if self.engine_holds_kv or self.open_blocks else []

    def free_all(self) -> list[Action]:
        """Every page still held (the engine let go, or was waited for long enough)."""
        out: list[Action] = [FreeBlock(b) for b in self.open_blocks]
        self.open_blocks.clear()
        if self.has_region and not self.region_freed:
            self.region_freed = True
            out.append(FreeRegion())
        return out

    def end(self) -> str:
        """The release completed; returns the outcome for the summary line."""
        self.released = True
        return "ok" if self.error is None else self.error.code.value


def _read_report(read_bytes: int) -> list[Action]:
    """An attempt that ends without a failure report still tells what its read took (the
    ``dropped`` report; nothing when it read nothing)."""
    return [Report("dropped", {"read_bytes": read_bytes, "de_read_bytes": read_bytes})] \
        if read_bytes else []


def _check_layer(ls: LayerSlots, num_layers: int, row: int) -> None:
    if not 0 <= ls.layer < num_layers:
        raise InvalidArgument(f"PullLayers: layer {ls.layer} out of range [0, {num_layers})")
    held = sum(n for _, n in ls.slots)
    if held != row or any(o < 0 or n < 0 for o, n in ls.slots):
        raise InvalidArgument(f"PullLayers: layer {ls.layer} slots hold {held} B, "
                              f"the hit is {row} B")


def _transfers(layers: Sequence[LayerSlots]) -> list[tuple[int, tuple[LayerSlots, ...]]]:
    """Consecutive entries sharing a transfer id form one transfer (protocol.PullLayers)."""
    out: list[tuple[int, list[LayerSlots]]] = []
    for ls in layers:
        if out and out[-1][0] == ls.transfer_id:
            out[-1][1].append(ls)
        elif any(tid == ls.transfer_id for tid, _ in out):
            raise InvalidArgument(f"PullLayers: transfer {ls.transfer_id} is not consecutive")
        else:
            out.append((ls.transfer_id, [ls]))
    return [(tid, tuple(group)) for tid, group in out]
