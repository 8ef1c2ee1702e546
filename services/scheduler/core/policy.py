"""The placement rules of paper §6 as small pure functions over ``state``.

Each function reads engine/group/node state and returns a choice; the caller (``core``) applies
it. None of them mutates anything except the round-robin cursors of the baseline rules.

Tie rules (all deterministic): equal keys go to the engine or group registered first.

* PE (Algorithm 1): category C2 (read_q ≤ α, tok_e ≤ β) before C3 (read_q > α, tok_e ≤ β);
  smallest tok_e inside the category; C1 (tok_e > β) never. ``None`` ends the fetch.
* PE fair share (``pe_share_limit``): β is lowered for one fetch to the cluster's mean PE load
  with the PE queue placed. [deviation] Algorithm 1 balances tok_e only among the fetching
  group's engines; across groups it relies on every group pulling often. Whatever reaches the
  PE queue between two fetches goes to the next group that fetches, up to β (5 s of prefill per
  GPU), while the other groups get none of it. In a cluster of N PE groups whose fetches see
  the whole queue (a common fetch tick, a burst of submissions, long-polls woken together),
  one group gets a fetch interval of the whole cluster's intake — N intervals of its own
  share — at once: its reads queue on its own node and its batcher, and the lumps grow with N
  (the simulator's 12P24D:
  one group took all ~150 requests of a tick, once every 12 ticks; the read wait doubled and
  the offline JCT grew with the cluster, docs/simulator.md "Findings"). With the limit a fetch
  takes at most the group's fair share plus one request per engine (the engine is checked
  before each assignment, as for β); the engine with the least load is always under the limit,
  so work is never left without an engine that may take it, and a single-node group places
  exactly what Algorithm 1 places. A registered group that stops fetching still counts in the
  share: the others then take at most it, and part of a burst waits until they drain below it
  or the group's lease expires. ``SchedulerConfig.pe_share = 0`` restores β alone.
* DE phase 1: the DE group with the smallest load, see ``Group.load`` (Σ tok_e of its engines
  plus the tokens already waiting in its private queue — [inference] the paper only says "update
  the sum after each assignment"; counting the private queue keeps the next fetch from piling
  onto the same group before its queue drains).
* DE phase 2: among DEs with enough free HBM, those with tok_e + len(r) ≤ Z by smallest seq_e
  (then smallest tok_e), else the smallest tok_e; ``None`` ends the fetch.
* Read side (``read_side``): the node with the shorter read queue *plus* what its storage link
  has been sent above a floor (``Node.read_v``; floor = the cluster's mean minus a credit of
  ``read_credit_s`` of SNIC reading); on a tie the PE's node (the conventional path, which needs
  no DE-buffer → PE hop over the compute network). [inference] The paper's rule is the shorter
  queue alone. A PE node only gets reads at its own group's fetches, which come in bursts
  (engines drop below β together), while a DE node gets them from every group's fetches; by
  queue alone the PE node loses after its first read of a burst and its link idles until the
  next one, and the loss grows with the number of groups (12P24D: PE SNICs 38 % busy, DE SNICs
  92 %, storage max/avg 1.35; docs/simulator.md). The sent-volume term lets a node that was
  sent less catch up (at most the credit), the queue term still steers away from a slow link.
  What a node is sent includes its write-backs, × ``write_weight`` (0 by default: a full-duplex
  SNIC; 1 where one link carries both directions: a DE node writes back every request's new
  and generated tokens over the same link; counting reads alone, a miss-heavy
  workload's hits went onto DE links saturated by writes, docs/workloads.md "Never worse than
  basic"), up to at most the mean plus the credit (past writes bias reads by two credits at
  most); an idle PE link beside a busy DE link always takes the read.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from .records import ReadSide
from .state import Engine, Group, Node, Pending


# --------------------------------------------------------------------------- PE placement

def has_buffer_room(e: Engine, need: int) -> bool:
    """Whether the KV buffer of PE ``e``'s node (shared by its PEs) holds ``need`` more bytes.

    Not checked where the node stated no buffer (capacity 0). A node holding nothing always
    has room, so a prompt larger than the whole buffer is still placed once and fails at the
    node with its typed error instead of waiting here for ever. Why at all: a PE that
    is sent more prompts than its buffer holds makes each wait at the node for room, bounded
    (``alloc_timeout_s``, then a re-plan, three at most), and fails them — seen in
    ``bench engine_agents`` with β raised (docs/vllm.md); here they wait in the PE queue,
    bounded by their own deadline.
    """
    n = e.node
    cap = n.buffer_cap
    return not cap or n.buffer_free >= need or n.buffer_free >= cap


def pick_pe(engines: Sequence[Engine], alpha: int, beta: float, need: int = 0) -> Engine | None:
    """Algorithm 1's choice: smallest tok_e in C2, else in C3; ``None`` if every engine is C1
    (or has no buffer room for ``need`` bytes of prompt KV: :func:`has_buffer_room`)."""
    best2 = best3 = None
    for e in engines:
        t = e.tok
        if t > beta:                       # C1: overloaded, never gets work
            continue
        if need and not has_buffer_room(e, need):
            continue
        if e.node.read_q <= alpha:         # C2: short read queue, preferred
            if best2 is None or t < best2.tok:
                best2 = e
        elif best2 is None and (best3 is None or t < best3.tok):
            best3 = e
    return best2 if best2 is not None else best3


def pe_share_limit(queued: int, total_tok: int, n_engines: int, factor: float) -> float:
    """Fair-share cap on tok_e for one fetch: ``factor · (queued + Σ tok_e) / |PEs|``.

    ``queued`` is the PE load waiting in the PE queue, ``total_tok`` the sum over every PE of the
    cluster. Placing a request moves its load from one term to the other, so the limit holds for
    a whole fetch. ``factor`` 0 (off) or ``n_engines`` 0: no limit.
    """
    if factor <= 0 or n_engines <= 0:
        return float("inf")
    return factor * (queued + total_tok) / n_engines


def pick_pe_round_robin(group: Group, beta: float, need: int = 0) -> Engine | None:
    """Baseline: the next engine in cyclic order that is not above β (β kept as flow control)
    and has buffer room for ``need`` bytes (:func:`has_buffer_room`)."""
    engines = group.engines
    n = len(engines)
    for k in range(n):
        i = (group.rr + k) % n
        if engines[i].tok <= beta and (not need or has_buffer_room(engines[i], need)):
            group.rr = (i + 1) % n
            return engines[i]
    return None


# --------------------------------------------------------------------------- DE placement

def high_token_threshold(group: Group, z_factor: float) -> float:
    """Z = z_factor · (Σ_{r∈R} len_r + Σ_e tok_e) / |E| (paper §6, DE placement).

    R is the longest head of the private queue whose HBM needs fit in the group's total free
    HBM as if it were not fragmented.
    """
    engines = group.engines
    free = 0
    tok = 0
    for e in engines:
        tok += e.tok
        if e.free_hbm > 0:
            free += e.free_hbm
    need = 0
    len_r = 0
    for p in group.private:
        need += p.request.hbm_bytes
        if need > free:
            break
        len_r += p.de_tokens
    return z_factor * (len_r + tok) / len(engines)


def pick_de(engines: Sequence[Engine], hbm: int, tokens: int, z: float) -> Engine | None:
    """Phase 2's choice for one request of ``tokens`` tokens needing ``hbm`` bytes."""
    rest = high = None
    for e in engines:
        if not e.fits(hbm):
            continue
        if e.tok + tokens <= z:
            if rest is None or e.seq < rest.seq or (e.seq == rest.seq and e.tok < rest.tok):
                rest = e
        elif high is None or e.tok < high.tok:
            high = e
    return rest if rest is not None else high


def pick_de_round_robin(group: Group, hbm: int) -> Engine | None:
    """Baseline: the next DE in cyclic order with enough free HBM."""
    engines = group.engines
    n = len(engines)
    for k in range(n):
        i = (group.rr + k) % n
        if engines[i].fits(hbm):
            group.rr = (i + 1) % n
            return engines[i]
    return None


def spread_to_groups(requests: Iterable[Pending], groups: Sequence[Group]) -> None:
    """Phase 1: each request to the group with the smallest load, updated after each one."""
    heap = [(g.load(), g.order, g) for g in groups]
    heapq.heapify(heap)
    replace = heapq.heapreplace
    for p in requests:
        load, order, g = heap[0]
        _to_private(p, g)
        replace(heap, (load + p.de_tokens, order, g))


def spread_round_robin(requests: Iterable[Pending], groups: Sequence[Group], cursor: int) -> int:
    """Phase-1 baseline: groups in turn; returns the advanced cursor."""
    n = len(groups)
    for p in requests:
        _to_private(p, groups[cursor % n])
        cursor += 1
    return cursor % n


def _to_private(p: Pending, g: Group) -> None:
    p.in_global = False
    p.group = g
    g.private.append(p)
    g.private_tokens += p.de_tokens


# --------------------------------------------------------------------------- read side

def shorter_queue_side(pe_node: Node, de_node: Node) -> ReadSide:
    """Join the shorter read queue; a tie goes to the PE's node."""
    return ReadSide.PE if pe_node.read_q <= de_node.read_q else ReadSide.DE


def charge_write(sent: int, write: int, mean: int, credit: int) -> int:
    """A node's link volume (``Node.read_v``) after a write-back of ``write`` tokens is
    counted on it, with the reads' floor (mean − credit).

    Why: a DE node's link also carries every write-back (≈ new + generated tokens), on a
    miss-heavy workload most of its traffic; counting reads alone levelled the *reads* over
    all nodes and sent ~2/3 of the hits (1P2D) onto DE links saturated by writes while the
    PE's link idled (docs/workloads.md "Never worse than basic"). Writes lift a node at most
    to the mean plus the credit: a miss-heavy phase's write-backs must not keep every read off
    that node long after it (a read queue more than two credits longer on the other side
    still sends reads here).
    """
    v = (sent if sent > mean - credit else mean - credit) + write
    cap = mean + credit
    if v > cap:
        v = cap if cap > sent else sent
    return v


def read_side(pe_node: Node, de_node: Node, floor: int) -> ReadSide:
    """Shorter read queue plus what the node has been sent above ``floor``; a tie: PE.

    An idle PE link beside a busy DE one always takes the read: it finishes there first, and
    the DE path would add its DE-buffer → PE hop for nothing (docs/workloads.md "Never worse
    than basic")."""
    if pe_node.read_q == 0 and de_node.read_q > 0:
        return ReadSide.PE
    # the keys inline (_read_key): this runs at every placement
    pv, dv = pe_node.read_v, de_node.read_v
    pk = pe_node.read_q + (pv - floor if pv > floor else 0)
    dk = de_node.read_q + (dv - floor if dv > floor else 0)
    return ReadSide.PE if pk <= dk else ReadSide.DE


def _read_key(node: Node, floor: int) -> int:
    """What a node's link has ahead of a new read: its queue plus its volume above ``floor``."""
    v = node.read_v
    return node.read_q + (v - floor if v > floor else 0)


def split_read(pe_node: Node, de_node: Node, floor: int, hit: int, block: int,
               min_part: int) -> tuple[ReadSide, int]:
    """Both links read one hit (``[scheduler] split_reads``): the DE's node its leading
    ``split`` tokens, the PE's node the rest, so both finish together — ``split`` levels the
    two links' keys (:func:`read_side`'s queue plus volume above ``floor``), in whole blocks.
    Returns ``(SPLIT, split)``, or :func:`read_side`'s whole-hit choice with 0 when either part
    would be under ``min_part`` tokens (one link is far enough ahead, or the hit is small).

    Why: the paper's rule puts each hit on one link, so a turn's read takes hit ÷ one link's
    rate even when the other link idles; with agents in lock step (no think time) that read is
    on every turn's critical path (docs/vllm.md "The paper's experiment with a real engine").
    [inference] The paper leaves splitting one request's read to future work (§5.5)."""
    pk, dk = _read_key(pe_node, floor), _read_key(de_node, floor)
    split = (pk - dk + hit) // 2
    split = (split + block // 2) // block * block
    if min_part <= split <= hit - min_part:
        return ReadSide.SPLIT, split
    return read_side(pe_node, de_node, floor), 0
