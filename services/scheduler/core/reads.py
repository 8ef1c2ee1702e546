"""Read-side bookkeeping of the scheduler core: which storage link reads a placed request's hit
(paper §4's read-side choice: ``policy.read_side``, or ``policy.split_read`` with
``[scheduler] split_reads``), and what every link has been given so far — ``Node.read_q`` (hit
tokens queued on it, until ``read_done``), ``Node.read_v`` (tokens sent to it above the
floor, write-backs included) and the operations counters (per node, per side).

Kept apart from the placement (``scheduler.py``): the core decides *where* a request runs; this
ledger decides *which links read its hit* and keeps their counts true through placements,
read completions, re-plans and lost nodes.
"""

from __future__ import annotations

from . import policy
from .config import SchedulerConfig
from .records import ReadSide
from .state import Node, Pending


class ReadLedger:
    """The storage links' queues and volumes, and the read-side decision that feeds them.

    ``nodes`` is the core's own node table (shared, not copied): the floor is the mean volume
    over the nodes registered now.
    """

    def __init__(self, cfg: SchedulerConfig, nodes: dict[str, Node], block_tokens: int) -> None:
        self.mode = cfg.read_side_mode()
        self.credit = cfg.resolved_read_credit()
        self.write_weight = cfg.write_weight if self.mode == "shorter_queue" else 0.0
        self.block_tokens = block_tokens
        # smallest part of a split read (0: never split); only the balancing policy splits
        self.split_min = (cfg.split_min_blocks * block_tokens
                          if cfg.split_reads and self.mode == "shorter_queue" else 0)
        self._nodes = nodes
        self._sum = 0                        # Σ read_v over nodes (their mean is the floor's base)
        self._alternate: dict[str, int] = {}  # dpl: PE/DE alternation per DE node
        # operations view (docs/kubernetes.md): hit tokens planned onto each node's storage
        # link, and by read side (a split read counts each part on its side); cumulative
        self.planned: dict[str, int] = {}
        self.side_tokens = {"pe": 0, "de": 0}
        self.split_reads = 0                 # requests whose hit was read on both links

    def mean(self) -> int:
        n = len(self._nodes)
        return self._sum // n if n else 0

    def forget(self, node: Node) -> None:
        """``node`` left the cluster: its volume leaves the mean."""
        self._sum -= node.read_v
        self._alternate.pop(node.node_id, None)

    def place(self, p: Pending, pe_node: Node, de_node: Node) -> tuple[ReadSide, str | None, int]:
        """Choose ``p``'s read side and count it: returns the side, the node the plan names as
        its read node (on a split read the PE's, which reads the part after the split) and the
        split (the DE's leading part; 0 unless split). Also charges the request's write-back
        on its DE node's link."""
        r = p.request
        hit = r.hit_tokens
        # the balancing floor: the keys compare volumes above it, and the parts' volumes are
        # lifted to it (one for both parts of a split); computed once per placement
        floor = (self.mean() - self.credit
                 if self.mode == "shorter_queue" and hit > 0 else None)
        side, split = self._choose(hit, pe_node, de_node, floor)
        if side is ReadSide.SPLIT:
            self._count(pe_node, hit - split, "pe", floor)
            self._count(de_node, split, "de", floor)
            p.read_node, p.read_tokens = pe_node, hit - split
            p.split_node, p.split_tokens = de_node, split
            self.split_reads += 1
        elif side is not ReadSide.NONE:
            node, label = (pe_node, "pe") if side is ReadSide.PE else (de_node, "de")
            self._count(node, hit, label, floor)
            p.read_node, p.read_tokens = node, hit
        w = int((r.new_tokens + r.gen_tokens) * self.write_weight)
        if w > 0:                           # the write-back on the DE node's link
            v = policy.charge_write(de_node.read_v, w, self.mean(), self.credit)
            self._sum += v - de_node.read_v
            de_node.read_v = v
        reader = p.read_node
        return side, (None if reader is None else reader.node_id), split

    def _count(self, node: Node, tokens: int, label: str, floor: int | None) -> None:
        """One link reads ``tokens`` of a hit: its queue, its volume lifted to ``floor`` (the
        balancing keys; None: no balancing), the operations counters."""
        if floor is not None:
            v = node.read_v
            v = (v if v > floor else floor) + tokens
            self._sum += v - node.read_v
            node.read_v = v
        node.read_q += tokens
        nid = node.node_id
        self.planned[nid] = self.planned.get(nid, 0) + tokens
        self.side_tokens[label] += tokens

    def release(self, p: Pending) -> None:
        """``p``'s hit is read (or will not be): take its tokens off its links' queues."""
        node = p.read_node
        if node is not None:
            node.read_q = max(node.read_q - p.read_tokens, 0)
            p.read_node, p.read_tokens = None, 0
            node = p.split_node
            if node is not None:
                node.read_q = max(node.read_q - p.split_tokens, 0)
                p.split_node, p.split_tokens = None, 0

    def _choose(self, hit: int, pe_node: Node, de_node: Node, floor: int | None
                ) -> tuple[ReadSide, int]:
        """The read side of a hit of ``hit`` tokens and the split (0 unless split); ``floor``
        is the balancing floor (set exactly when the mode balances and there is a hit)."""
        mode = self.mode
        if hit <= 0 or mode == "none":
            return ReadSide.NONE, 0
        if floor is not None:
            if self.split_min and pe_node is not de_node:
                return policy.split_read(pe_node, de_node, floor, hit, self.block_tokens,
                                         self.split_min)
            return policy.read_side(pe_node, de_node, floor), 0
        if mode == "pe":
            return ReadSide.PE, 0
        # "alternate": dpl ablation, no balancing; alternate per DE node: one global counter
        # lines up with the round-robin DE choice (1P2D: every DE-path read on the second DE
        # node)
        k = self._alternate.get(de_node.node_id, 0)
        self._alternate[de_node.node_id] = k + 1
        return (ReadSide.PE if k % 2 == 0 else ReadSide.DE), 0
