"""The scheduler core: a sans-I/O state machine fed events, returning placement decisions.

One request's way through it (the DE is bound before the KV read is issued, paper §6):

1. ``submit`` puts it in the **global DE queue**.
2. Any DE group fetch (``on_de_group_fetch``) first drains the global queue into the DE groups'
   private queues (phase 1), then places the head of the *fetching* group's private queue on its
   DEs (phase 2, Z threshold, HBM stop). Each placement is a ``DEBinding`` (HBM reserved) and
   moves the request into the **PE FIFO queue**, ordered by arrival.
3. A PE group fetch (``on_pe_group_fetch``) runs Algorithm 1 on the fetching group's engines over
   the PE queue, with β lowered to the cluster's fair share for this fetch
   (``policy.pe_share_limit``; the core keeps Σ tok_e over all PEs and the PE queue's load).
   A request that gets a PE now has both ends, so its read side is chosen at once
   (``reads.ReadLedger``): the node (PE's or DE's) with the shorter read queue plus sent volume
   (``policy.read_side``; with ``split_reads`` both, each reading part of the hit:
   ``policy.split_read``), whose ``read_q`` and ``read_v`` grow by the hit tokens before the
   next request of the same fetch is looked at. The result is an ``Assignment``.
4. ``read_done`` / ``prefill_done`` / ``complete`` release the read queue, the PE and the DE.

Why DE first: the DE read path needs the DE (and its buffer) before the read, and a request that
is on a PE but waiting for DE memory would sit on the PE's tok_e (its β budget) doing nothing;
binding the DE first means the PE queue only holds requests that can start at once.

Driving it. The core never reads a clock, sleeps or does I/O; every method returns at once and
the same calls in the same order give the same decisions (ties go to the earliest registered
engine/group, iteration is over lists and insertion-ordered dicts only).

* A live asyncio service calls ``submit`` from its frontend handler and the fetch methods from
  each group leader's fetch RPC, then sends the returned ``DEBinding``/``Assignment`` records on
  (DE loader, PE receiver, read node's gateway); engine/gateway events map to ``read_done``,
  ``prefill_done``, ``complete``, ``fail``; lease expiry maps to ``remove_engine``/``remove_node``.
  It must call the core from one task (or under one lock): the core is not thread-safe.
* A discrete-event simulator calls the same methods at simulated times: fetch events every
  fetch interval per group, completion events from its cost model.

Telemetry passed to a fetch (or to ``apply_telemetry``) *replaces* the engines' seq_e/tok_e/free
HBM and nodes' read_q; without it the core keeps its own count from its decisions and the events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from common.errors import AlreadyExists, InvalidArgument, NotFound

from . import policy
from .config import ATTEMPT_SPAN, SchedulerConfig
from .pe_queue import PEQueue
from .reads import ReadLedger
from .records import (Assignment, DEBinding, EngineReport, EngineSpec, Phase, ReplanResult,
                      Request, Role, Telemetry)
from .state import Engine, Group, Node, Pending


def attempt_base(epoch: int) -> int:
    """The first attempt number of scheduler epoch ``epoch``: epochs only grow (a plain
    scheduler's is its start time in ns, counted here in ms — a restart takes far longer; an
    elected one's is etcd's revision), so the bases of two epochs never overlap and stay below
    2**53 (exact in every JSON client)."""
    stamp = epoch // 1_000_000 if epoch >= 1 << 50 else epoch
    return max(0, stamp) * ATTEMPT_SPAN


class Scheduler:
    """Inter-engine placement (PE, DE, read side) for one cluster; see the module docstring."""

    def __init__(self, config: SchedulerConfig | None = None,
                 engines: Iterable[EngineSpec] = (), block_tokens: int = 64) -> None:
        self.config = cfg = config if config is not None else SchedulerConfig()
        # a request's first attempt number; its re-plans count on from it. The service sets
        # it per scheduler epoch (attempt_base), so a restarted scheduler never hands out an
        # attempt number its predecessor used for the same request id — an engine request of
        # the old attempt (still ending) can never act on the new one
        self.attempt_base = 0
        self.alpha = cfg.resolved_alpha()
        self.beta = cfg.resolved_beta()
        self._balanced = cfg.placement_mode() == "balanced"
        self.pe_load = cfg.pe_load_counter()    # (hit, new) -> PE load (tok_e, β's unit)
        self._pe_share = cfg.pe_share
        self._pe_tok = 0                     # Σ tok_e over all PEs (policy.pe_share_limit)
        self._n_pe = 0
        self._nodes: dict[str, Node] = {}
        self.reads = ReadLedger(cfg, self._nodes, block_tokens)
        self.read_side_tokens = self.reads.side_tokens      # the operations view's PE/DE split
        self._engines: dict[str, Engine] = {}
        self._groups: dict[Role, dict[str, Group]] = {Role.PREFILL: {}, Role.DECODE: {}}
        self._requests: dict[str, Pending] = {}
        self._global: list[Pending] = []
        self._global_sorted = True
        self._pe_queue = PEQueue()
        self._counter = 0            # registration order
        self._next_seq = 0
        self._rr_groups = 0
        self._max_hbm: int | None = None
        self._max_hbm_known = False
        for spec in engines:
            self.add_engine(spec)

    # ------------------------------------------------------------------ topology
    def add_engine(self, spec: EngineSpec) -> None:
        """Register an engine; its node and group are created on first use."""
        if spec.engine_id in self._engines:
            raise AlreadyExists(f"engine {spec.engine_id!r} is already registered")
        node = self._nodes.get(spec.node_id)
        if node is None:
            # a new node starts level with the others: no backlog of credit to catch up
            node = self._nodes[spec.node_id] = Node(spec.node_id, self.reads.mean())
        groups = self._groups[spec.role]
        gid = spec.group_id if spec.group_id is not None else spec.node_id
        group = groups.get(gid)
        if group is None:
            group = groups[gid] = Group(gid, self._tick(), spec.role)
        engine = Engine(spec.engine_id, self._tick(), spec.role, node, group, spec.hbm_capacity_bytes)
        self._engines[spec.engine_id] = engine
        group.engines.append(engine)
        node.engines.append(engine)
        if spec.role is Role.PREFILL:
            self._n_pe += 1
            if spec.hbm_capacity_bytes > node.buffer_cap:      # the node's whole PE buffer
                node.buffer_free += spec.hbm_capacity_bytes - node.buffer_cap
                node.buffer_cap = spec.hbm_capacity_bytes
        self._max_hbm_known = False

    def remove_engine(self, engine_id: str) -> ReplanResult:
        """Drop a dead engine; its requests are re-planned (up to ``max_replans``) or failed."""
        e = self._engines.pop(engine_id, None)
        if e is None:
            raise NotFound(f"engine {engine_id!r} is not registered")
        g, node = e.group, e.node
        g.engines.remove(e)
        node.engines.remove(e)
        g.rr = 0
        self._max_hbm_known = False
        if e.role is Role.PREFILL:
            self._n_pe -= 1
            self._pe_tok -= e.tok
        affected = sorted(e.requests.values(), key=_by_seq)
        e.requests = {}
        requeued: list[str] = []
        failed: list[str] = []
        for p in affected:
            if e.role is Role.PREFILL:
                p.pe = None                # PE gone: keep the DE, look for another PE
                keep_de = True
            else:
                p.de = None
                keep_de = False
            (requeued if self._replan(p, keep_de) else failed).append(p.request.request_id)
        if not g.engines:
            self._drop_group(g)
        if not node.engines:
            del self._nodes[node.node_id]
            self.reads.forget(node)
        return ReplanResult(tuple(requeued), tuple(failed))

    def remove_node(self, node_id: str) -> ReplanResult:
        """Drop every engine of a node (its lease expired)."""
        node = self._nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered")
        requeued: dict[str, None] = {}
        failed: list[str] = []
        for e in list(node.engines):
            res = self.remove_engine(e.engine_id)
            requeued.update(dict.fromkeys(res.requeued))
            failed.extend(res.failed)
        for rid in failed:
            requeued.pop(rid, None)
        return ReplanResult(tuple(requeued), tuple(failed))

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> None:
        """Queue a request for placement (global DE queue)."""
        rid = request.request_id
        if rid in self._requests:
            raise AlreadyExists(f"request {rid!r} is already queued or running")
        cap = self._max_hbm if self._max_hbm_known else self._max_de_capacity()
        if cap is not None and request.hbm_bytes > cap:
            raise InvalidArgument(f"request {rid!r} needs {request.hbm_bytes} B of DE HBM, more than "
                                  f"any decode engine has ({cap} B: its HBM, or its node's DE "
                                  f"buffer where smaller): shorten it or add memory")
        p = Pending(request, self._next_seq, self.pe_load(request.hit_tokens, request.new_tokens))
        p.attempt = self.attempt_base
        self._next_seq += 1
        self._requests[rid] = p
        p.in_global = True
        self._global.append(p)

    def cancel(self, request_id: str) -> bool:
        """Forget a request wherever it is and release what it holds; False if unknown."""
        p = self._requests.pop(request_id, None)
        if p is None:
            return False
        self._release_all(p)
        return True

    def complete(self, request_id: str) -> None:
        """The request finished decoding: release its DE (and anything still held)."""
        p = self._requests.pop(request_id, None)
        if p is None:
            raise NotFound(f"request {request_id!r} is not known to the scheduler")
        self._release_all(p)

    def fail(self, request_id: str) -> ReplanResult:
        """A retryable failure of a placed request: plan it again from the start (bounded)."""
        p = self._get(request_id)
        self._release_all(p)
        ok = self._replan(p, keep_de=False)
        return ReplanResult((request_id,), ()) if ok else ReplanResult((), (request_id,))

    def read_done(self, request_id: str) -> None:
        """The hit KV has been read: take its tokens off the reading nodes' queues (two on a
        split read)."""
        self.reads.release(self._get(request_id))

    def prefill_done(self, request_id: str) -> None:
        """Prefill finished: the PE's load drops; the request now lives on its DE only."""
        p = self._get(request_id)
        if p.pe is None:
            raise InvalidArgument(f"request {request_id!r} has no prefill engine yet")
        self.reads.release(p)
        if not p.prefilled:
            p.prefilled = True
            self._release_pe(p)

    # ------------------------------------------------------------------ fetches
    def on_de_group_fetch(self, group_id: str, telemetry: Telemetry | None = None) -> list[DEBinding]:
        """A DE group leader fetches: phase 1 over the global queue, phase 2 in this group."""
        g = self._group(Role.DECODE, group_id)
        if telemetry is not None:
            self.apply_telemetry(telemetry)
        if self._global:
            self._spread()
        return self._bind_group(g)

    def on_pe_group_fetch(self, group_id: str, telemetry: Telemetry | None = None) -> list[Assignment]:
        """A PE group leader fetches: Algorithm 1 over the PE FIFO queue, read side per request."""
        g = self._group(Role.PREFILL, group_id)
        if telemetry is not None:
            self.apply_telemetry(telemetry)
        queue, engines, alpha = self._pe_queue, g.engines, self.alpha
        beta: float = float(self.beta)
        pick = policy.pick_pe if self._balanced else None
        if pick is not None and queue.waiting > 0:
            # fixed for the whole fetch: a placement moves load from the queue to a PE
            share = policy.pe_share_limit(queue.tokens, self._pe_tok, self._n_pe, self._pe_share)
            if share < beta:
                beta = share

        def choose(need: int) -> Engine | None:
            return pick(engines, alpha, beta, need) if pick else \
                policy.pick_pe_round_robin(g, beta, need)

        admit_by_buffer = self.config.pe_buffer_admission

        def below_beta() -> bool:           # some PE is not C1 (β alone; changes nothing)
            return any(e.tok <= beta for e in engines)

        out: list[Assignment] = []
        while (p := queue.head()) is not None:
            e = choose(p.request.prompt_kv_bytes if admit_by_buffer else 0)
            if e is None:                   # C2 and C3 empty (or no buffer room): end the fetch
                if admit_by_buffer and p.bypassed < self.config.pe_buffer_bypass and below_beta():
                    out.extend(self._place_past(p, choose, below_beta))
                break
            queue.remove(p)
            out.append(self._place(p, e))
        return out

    def _place_past(self, head: Pending, choose: Callable[[int], Engine | None],
                    below_beta: Callable[[], bool]) -> list[Assignment]:
        """Past a head that no PE's buffer takes yet: the later requests that fit one, the
        smallest prompts first (ties in arrival order), up to the head's bypass budget
        (``pe_buffer_bypass``), while some PE is below β. Smallest first is what keeps the
        median TTFT (docs/datapath.md "Buffer admission in the scheduler")."""
        out: list[Assignment] = []
        behind = self._pe_queue.after_head(8 * self.config.pe_buffer_bypass)
        behind.sort(key=_prompt_kv_bytes)
        for p in behind:
            if head.bypassed >= self.config.pe_buffer_bypass or not below_beta():
                break
            e = choose(p.request.prompt_kv_bytes)
            if e is not None:
                self._pe_queue.remove(p)
                out.append(self._place(p, e))
                head.bypassed += 1
        return out

    # ------------------------------------------------------------------ telemetry
    def apply_telemetry(self, telemetry: Telemetry) -> None:
        """Overwrite engines' seq_e/tok_e/free HBM and nodes' read_q; unknown ids are ignored."""
        engines, nodes = self._engines, self._nodes
        for r in telemetry.engines:
            e = engines.get(r.engine_id)
            if e is None:
                continue
            if e.role is Role.PREFILL:
                self._pe_tok += r.tok - e.tok
                if r.free_hbm_bytes is not None:    # PEs: their node's free buffer
                    e.node.buffer_free = r.free_hbm_bytes
            else:
                if r.free_hbm_bytes is not None:
                    e.free_hbm = r.free_hbm_bytes
                if r.buffer_free_bytes is not None:     # DEs: their node's free DE buffer
                    e.node.de_buffer_free = r.buffer_free_bytes
            e.seq, e.tok = r.seq, r.tok
        for node_id, q in telemetry.read_q.items():
            n = nodes.get(node_id)
            if n is not None:
                n.read_q = q

    def update_read_queue(self, node_id: str, tokens: int) -> None:
        """Set one node's read queue (e.g. from its gateway's report)."""
        n = self._nodes.get(node_id)
        if n is not None:
            n.read_q = tokens

    # ------------------------------------------------------------------ introspection
    def held(self, request_id: str) -> tuple[Phase, int] | None:
        """A held request's phase and how often it has been re-planned (0 on its first plan);
        None when the core does not hold it (not submitted, or completed, cancelled or given
        up after ``max_replans``)."""
        p = self._requests.get(request_id)
        return None if p is None else (self.phase(request_id), p.attempt)

    def phase(self, request_id: str) -> Phase:
        p = self._get(request_id)
        if p.de is None:
            return Phase.QUEUED
        if p.pe is None:
            return Phase.BOUND
        return Phase.DECODING if p.prefilled else Phase.PLACED

    def engine_report(self, engine_id: str) -> EngineReport:
        """The core's current view of one engine (seq_e, tok_e, free HBM; a PE: its node's
        free buffer where the node stated one)."""
        e = self._engines.get(engine_id)
        if e is None:
            raise NotFound(f"engine {engine_id!r} is not registered")
        return _report(e)

    def engine_reports(self, role: Role | None = None) -> list[EngineReport]:
        """Every engine's current figures (for a cluster-status reply), in registration order."""
        return [_report(e) for e in self._engines.values() if role is None or e.role is role]

    def read_planned(self) -> dict[str, int]:
        """Hit tokens planned onto each registered node's storage link so far (0 included)."""
        return {nid: self.reads.planned.get(nid, 0) for nid in self._nodes}

    def read_queue(self, node_id: str) -> int:
        n = self._nodes.get(node_id)
        if n is None:
            raise NotFound(f"node {node_id!r} is not registered")
        return n.read_q

    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting for a DE (global, private) and for a PE; how many are held in all."""
        private = sum(len(g.private) for g in self._groups[Role.DECODE].values())
        return {"global": len(self._global), "private": private, "pe": self._pe_queue.waiting,
                "total": len(self._requests)}

    def group_ids(self, role: Role) -> list[str]:
        return list(self._groups[role])

    def private_queue(self, group_id: str) -> list[str]:
        """Request ids in a DE group's private queue, head first."""
        return [p.request.request_id for p in self._group(Role.DECODE, group_id).private]

    def pe_queue(self) -> list[str]:
        """Request ids waiting for a PE (DE already bound), in FIFO order."""
        return self._pe_queue.ids()

    # ------------------------------------------------------------------ internals
    def _tick(self) -> int:
        self._counter += 1
        return self._counter

    def _get(self, request_id: str) -> Pending:
        p = self._requests.get(request_id)
        if p is None:
            raise NotFound(f"request {request_id!r} is not known to the scheduler")
        return p

    def _group(self, role: Role, group_id: str) -> Group:
        g = self._groups[role].get(group_id)
        if g is None:
            raise NotFound(f"no {role.value} group {group_id!r} is registered")
        return g

    def _max_de_capacity(self) -> int | None:
        """Largest DE HBM capacity, or None while unknown (no DEs, or one without a capacity)."""
        if not self._max_hbm_known:
            caps = [e.hbm_capacity for e in self._engines.values() if e.role is Role.DECODE]
            self._max_hbm = max(caps) if caps and min(caps) > 0 else None
            self._max_hbm_known = True
        return self._max_hbm

    def _spread(self) -> None:
        """Phase 1: drain the global queue (in arrival order) into DE groups' private queues."""
        groups = list(self._groups[Role.DECODE].values())
        if not groups:
            return
        queue, self._global = self._global, []
        if not self._global_sorted:
            queue.sort(key=_by_seq)
            self._global_sorted = True
        if self._balanced:
            policy.spread_to_groups(queue, groups)
        else:
            self._rr_groups = policy.spread_round_robin(queue, groups, self._rr_groups)

    def _bind_group(self, g: Group) -> list[DEBinding]:
        """Phase 2 inside ``g``: place the private queue's head until no DE has room for it."""
        private = g.private
        if not private:
            return []
        engines = g.engines
        if self._balanced:
            # Z only matters if the head fits on some DE: skip computing it when none has the
            # room (the common case while the group's HBM is full and its queue backs up).
            hbm = private[0].request.hbm_bytes
            for en in engines:
                if en.fits(hbm):
                    break
            else:
                return []
            z = policy.high_token_threshold(g, self.config.z_factor)
        else:
            z = 0.0
        out: list[DEBinding] = []
        while private:
            p = private[0]
            hbm = p.request.hbm_bytes
            if self._balanced:
                e = policy.pick_de(engines, hbm, p.de_tokens, z)
            else:
                e = policy.pick_de_round_robin(g, hbm)
            if e is None:
                break
            private.popleft()
            g.private_tokens -= p.de_tokens
            p.group = None
            p.de = e
            e.add(p, p.de_tokens, hbm)
            self._pe_queue.push(p)
            out.append(DEBinding(p.request.request_id, e.engine_id, e.node.node_id, hbm))
        return out

    def _place(self, p: Pending, e: Engine) -> Assignment:
        """Bind the PE, choose the read side, count the read on that node's queue."""
        p.pe = e
        e.add(p, p.pe_tokens)
        e.node.take_buffer(p.request.prompt_kv_bytes)
        self._pe_tok += p.pe_tokens
        r, de = p.request, p.de
        assert de is not None
        side, read_node, split = self.reads.place(p, e.node, de.node)
        return Assignment(r.request_id, r.session_id, e.engine_id, e.node.node_id, de.engine_id,
                          de.node.node_id, side, read_node, r.hit_tokens, r.new_tokens,
                          r.gen_tokens, p.attempt, split)

    def _release_pe(self, p: Pending) -> None:
        """Take ``p``'s load off its PE (and off the cluster's Σ tok_e, by what actually left)."""
        e = p.pe
        assert e is not None
        before = e.tok
        if e.release(p, p.pe_tokens):
            e.node.give_buffer(p.request.prompt_kv_bytes)
        self._pe_tok += e.tok - before

    def _release_all(self, p: Pending) -> None:
        """Undo every binding of ``p`` and take it out of whatever queue holds it (idempotent)."""
        self.reads.release(p)
        if p.pe is not None and not p.prefilled:
            self._release_pe(p)
        if p.de is not None:
            p.de.release(p, p.de_tokens, p.request.hbm_bytes)
        if p.group is not None:
            p.group.private.remove(p)
            p.group.private_tokens -= p.de_tokens
        if p.in_global:
            self._global.remove(p)
            p.in_global = False
        self._pe_queue.remove(p)
        p.pe = p.de = p.group = None
        p.prefilled = False

    def _replan(self, p: Pending, keep_de: bool) -> bool:
        """Requeue ``p`` after a failure (PE queue if its DE survives, else global); False = failed.

        The caller has already cleared the binding to the dead engine.
        """
        p.attempt += 1
        p.replans += 1
        if p.replans > self.config.max_replans:
            self._requests.pop(p.request.request_id, None)
            self._release_all(p)
            return False
        if keep_de and p.de is not None:
            self.reads.release(p)
            if p.pe is not None and not p.prefilled:
                self._release_pe(p)
            p.pe = None
            p.prefilled = False
            if p.ticket < 0:
                self._pe_queue.push(p)
            return True
        self._release_all(p)
        self._to_global(p)
        return True

    def _to_global(self, p: Pending) -> None:
        p.in_global = True
        self._global.append(p)
        self._global_sorted = False

    def _drop_group(self, g: Group) -> None:
        """Remove an empty group; its private queue goes back to the global queue."""
        del self._groups[g.role][g.group_id]
        for p in g.private:
            p.group = None
            self._to_global(p)
        g.private.clear()
        g.private_tokens = 0


def _by_seq(p: Pending) -> int:
    return p.seq


def _prompt_kv_bytes(p: Pending) -> int:
    return p.request.prompt_kv_bytes


def _report(e: Engine) -> EngineReport:
    free = e.node.buffer_free if e.role is Role.PREFILL and e.node.buffer_cap else e.free_hbm
    return EngineReport(e.engine_id, e.seq, e.tok, free)
