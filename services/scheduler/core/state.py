"""Mutable cluster state the policies read and update: engines, groups, nodes, pending requests.

Plain ``__slots__`` classes (not Structs) because the placement loops update them in place
millions of times in the simulator. Every collection that is iterated is a list or an
insertion-ordered dict, never a set of strings, so iteration order — and hence every decision —
is the same in every process (string hashing is randomised per process).

Ties are broken by **registration order** (``Engine.order``, ``Group.order``): the engine or
group registered first wins, whatever its id looks like.
"""

from __future__ import annotations

from collections import deque

from .records import Request, Role


class Node:
    """A machine: its storage link's disk-read queue, in tokens, and its PE or DE buffer."""

    __slots__ = ("node_id", "read_q", "read_v", "engines", "buffer_cap", "buffer_free",
                 "de_buffer_free")

    def __init__(self, node_id: str, read_v: int = 0) -> None:
        self.node_id = node_id
        self.read_q = 0
        # read tokens sent to this node's storage link so far, floored (policy.read_side)
        self.read_v = read_v
        self.engines: list[Engine] = []
        # the PE buffer every prefill attempt of the node stages its prompt's KV in, shared by
        # the node's PEs (bytes; cap 0: not stated, not checked — policy.has_buffer_room)
        self.buffer_cap = 0
        self.buffer_free = 0
        # the DE buffer every decode attempt of the node stages its KV in, shared by the node's
        # decode engines: free bytes as the node last reported them (protocol v7), less what
        # was bound here since; None: never reported, not checked (each engine's HBM still is)
        self.de_buffer_free: int | None = None

    def take_buffer(self, nbytes: int) -> None:
        self.buffer_free -= nbytes

    def give_buffer(self, nbytes: int) -> None:
        free = self.buffer_free + nbytes
        self.buffer_free = free if free < self.buffer_cap else self.buffer_cap


class Engine:
    """One GPU's engine: seq_e, tok_e and (DEs) free HBM, plus the requests it holds."""

    __slots__ = ("engine_id", "order", "role", "node", "group", "seq", "tok", "free_hbm",
                 "hbm_capacity", "requests")

    def __init__(self, engine_id: str, order: int, role: Role, node: Node, group: Group,
                 hbm_capacity: int) -> None:
        self.engine_id = engine_id
        self.order = order
        self.role = role
        self.node = node
        self.group = group
        self.seq = 0
        self.tok = 0
        self.free_hbm = hbm_capacity
        self.hbm_capacity = hbm_capacity
        self.requests: dict[str, Pending] = {}

    def fits(self, hbm: int) -> bool:
        """Whether a request reserving ``hbm`` bytes fits this (decode) engine: its own free
        HBM, and its node's DE buffer, which the node's decode engines share — so two engines
        of one node are never each given the same free buffer within one placement pass."""
        if self.free_hbm < hbm:
            return False
        buffer = self.node.de_buffer_free
        return buffer is None or buffer >= hbm

    def add(self, p: Pending, tokens: int, hbm: int = 0) -> None:
        self.seq += 1
        self.tok += tokens
        self.free_hbm -= hbm
        if hbm and self.node.de_buffer_free is not None:
            self.node.de_buffer_free -= hbm
        self.requests[p.request.request_id] = p

    def release(self, p: Pending, tokens: int, hbm: int = 0) -> bool:
        """Undo ``add`` (False: it did not hold ``p``); clamped at zero because telemetry may
        already have counted it out."""
        if self.requests.pop(p.request.request_id, None) is None:
            return False
        seq, tok = self.seq - 1, self.tok - tokens
        self.seq = seq if seq > 0 else 0
        self.tok = tok if tok > 0 else 0
        free, cap = self.free_hbm + hbm, self.hbm_capacity
        self.free_hbm = cap if cap and free > cap else free
        if hbm and self.node.de_buffer_free is not None:
            # may count bytes the node's next report already freed: that report replaces it
            self.node.de_buffer_free += hbm
        return True


class Group:
    """An engine group: all engines of one role on one node (or more); its leader fetches.

    DE groups also own the phase-1 private queue and the tokens waiting in it.
    """

    __slots__ = ("group_id", "order", "role", "engines", "private", "private_tokens", "rr")

    def __init__(self, group_id: str, order: int, role: Role) -> None:
        self.group_id = group_id
        self.order = order
        self.role = role
        self.engines: list[Engine] = []
        self.private: deque[Pending] = deque()
        self.private_tokens = 0
        self.rr = 0   # round-robin cursor over engines

    def load(self) -> int:
        """Phase-1 key: Σ tok_e of the engines plus the tokens already in the private queue."""
        return sum(e.tok for e in self.engines) + self.private_tokens


class Pending:
    """A request inside the scheduler, with its bindings as they are made."""

    __slots__ = ("request", "seq", "pe_tokens", "de_tokens", "group", "de", "pe",
                 "read_node", "read_tokens", "split_node", "split_tokens", "prefilled",
                 "ticket", "in_global", "attempt", "replans", "bypassed")

    def __init__(self, request: Request, seq: int, pe_tokens: int | None = None) -> None:
        self.request = request
        self.seq = seq                     # arrival order: the FIFO key
        prompt = request.hit_tokens + request.new_tokens
        # PE load (tok_e, β's unit): raw prompt tokens, or the cost-weighted count the core
        # passes in (cost_model.PrefillLoad); the DE's load is the KV it holds, always raw.
        self.pe_tokens = prompt if pe_tokens is None else pe_tokens
        self.de_tokens = prompt + request.gen_tokens
        self.group: Group | None = None    # DE group whose private queue holds it
        self.de: Engine | None = None
        self.pe: Engine | None = None
        # hit tokens still counted in the reading nodes' read_q: ``read_node`` reads the whole
        # hit, or on a split read the part after the split (the PE's node), ``split_node`` the
        # leading part (the DE's node). Plain slots, not a tuple of parts: a container per
        # placement cost the core ~12 % of its placement rate in garbage collection
        self.read_node: Node | None = None
        self.read_tokens = 0
        self.split_node: Node | None = None
        self.split_tokens = 0
        self.prefilled = False
        self.ticket = -1                   # valid PE-queue entry carries this ticket
        self.in_global = False             # sits in the global DE queue
        self.attempt = 0                   # the wire's attempt number (attempt_base + re-plans)
        self.replans = 0                   # re-plans so far (bounded by max_replans)
        self.bypassed = 0                  # requests placed past it while no PE buffer took it
