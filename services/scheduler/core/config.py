"""Scheduler configuration: one frozen Struct holding α, β, Z and the ablation switches (paper §6.4, §9).

α (short-read-queue threshold) = tokens one node's SNIC reads in ``alpha_s`` = 3 s;
β (cap on unfinished tokens of a PE) = prompt tokens one GPU prefills in ``beta_s`` = 5 s; a PE's
load counts each request at its prefill cost in tokens of the reference shape (``pe_load =
"cost"``, see ``cost_model.PrefillLoad``), so β is 5 s of work whatever the requests' shapes.
The paper profiles both; here they are derived from the SNIC bandwidth, the KV preset's bytes
per token and the cost model's prefill rate at a reference request shape (Table 2's 64K dataset:
32,721 context + 429 appended tokens), unless given outright (``alpha_tokens``/``beta_tokens``
or the profiled ``pe_tokens_per_s``).

``pe_share`` (default 1, 0 = off) adds a cluster-wide cap to β at each PE group fetch
(``policy.pe_share_limit``): a PE takes work only while its tok_e is at most the mean PE load the
cluster would have with the whole PE queue placed, so a burst is shared by all PE groups instead
of going to whichever group fetches first.

Ablation switches (paper §7.3, Fig. 12): ``policy`` picks the defaults of the two independent knobs

================  ===========================  ==========================================
policy            read side                    engine placement
================  ===========================  ==========================================
``basic``         PE node always               round-robin
``dpl``           alternate PE / DE            round-robin
``dualpath``      shorter queue + sent volume  Algorithm 1 + two-phase DE placement
================  ===========================  ==========================================

``placement`` overrides the engine placement (``round_robin`` with the ``dualpath`` read side is
the load-balance comparison's round-robin scheduler); ``read_side = "pe"`` overrides the read
side (every hit read on the PE node: the ``pe-only`` ablation, ``dualpath`` without the DE read
path, so what the second path itself adds is measured apart from the rest of the policy);
``oracle`` skips all KV I/O (read side ``none``) while keeping the ``policy``'s placement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

import msgspec

from common.config import NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, Section
from common.kv import PRESETS as KV_PRESETS

from services.compute_model.cost_model import PrefillLoad, cost_model

# attempt numbers one scheduler epoch may use per request: its first plan and every re-plan
# (``Scheduler.attempt_base``; ``max_replans`` stays below it)
ATTEMPT_SPAN = 1 << 10

Policy = Literal["basic", "dpl", "dualpath"]
Placement = Literal["auto", "balanced", "round_robin"]
ReadSideMode = Literal["auto", "pe"]     # "auto": the policy's read side; "pe": PE node always


class SchedulerConfig(Section, frozen=True):  # frozen restated for mypy's dataclass_transform
    """Placement policy constants; ``[scheduler]`` in a config file."""

    policy: Policy = "dualpath"
    oracle: bool = False
    placement: Placement = "auto"
    read_side: ReadSideMode = "auto"
    model: str = "deepseek-v3.2"            # KV + cost-model preset α and β are derived from
    snic_bytes_per_s: PositiveFloat = 50e9  # one 400 Gbps storage NIC per node (paper §6.1)
    alpha_s: PositiveFloat = 3.0
    beta_s: PositiveFloat = 5.0
    alpha_tokens: NonNegInt | None = None   # overrides the derived α
    beta_tokens: NonNegInt | None = None    # overrides the derived β
    pe_tokens_per_s: float | None = None    # profiled prompt tokens/s of one PE (None: cost model)
    ref_context_tokens: NonNegInt = 32_721
    ref_append_tokens: PositiveInt = 429
    # tok_e/β unit: "cost" = prefill-cost-weighted tokens of the reference shape
    # (cost_model.PrefillLoad: a cold token counts what it costs), "tokens" = raw prompt tokens
    pe_load: Literal["cost", "tokens"] = "cost"
    # read side (policy.read_side): how far, in seconds of SNIC reading, a node that has been
    # sent less than the cluster's mean may catch up in one go
    read_credit_s: NonNegFloat = 1.0
    # read side: what one written-back token weighs on its node's storage link, counted in what
    # the link has been sent (policy.read_side). 0: a full-duplex SNIC, where a write-back never
    # delays a read (the paper's rule: reads alone; the gateway's default link_duplex = "full");
    # 1: reads and write-backs share the link ([gateway] link_duplex = "half"; storage whose
    # disks serve both)
    write_weight: NonNegFloat = 0.0
    # PE fair share (policy.pe_share_limit): at a fetch a PE takes work only while its tok_e is at
    # most pe_share × the cluster's mean PE load with the PE queue placed; 0 = β alone (paper)
    pe_share: float = 1.0
    z_factor: PositiveFloat = 1.05
    # PE buffer admission (policy.has_buffer_room; docs/datapath.md "Buffer admission in the
    # scheduler"): place a request on a PE only when its node's buffer holds its prompt's KV, so
    # over-admission waits in the PE queue instead of failing at the node's pool after
    # alloc_timeout_s. Then, when the queue's head fits no node yet, at most pe_buffer_bypass
    # later requests that fit are placed past it (smallest prompts first), after which the
    # head waits for room and the rest behind it (no starvation); 0 = strict arrival order.
    pe_buffer_admission: bool = True
    pe_buffer_bypass: NonNegInt = 256
    # split reads (policy.split_read; docs/datapath.md "Split reads"): under the dualpath policy
    # one hit may be read on both links at once, the DE's node its leading part and the PE's
    # node the rest, sized so both finish together; parts under split_min_blocks blocks are not
    # split off. Off: one link per hit (the paper's rule)
    split_reads: bool = False
    split_min_blocks: PositiveInt = 4
    max_replans: Annotated[int, msgspec.Meta(ge=0, le=ATTEMPT_SPAN - 1)] = 3

    def __post_init__(self) -> None:
        # What a declared bound cannot say (the preset table, "0 or >= 1"); ValueError:
        # build_config turns it into a ConfigError naming the section.
        if self.model not in KV_PRESETS:
            raise ValueError(f"unknown scheduler model {self.model!r}; known: {sorted(KV_PRESETS)}")
        if self.pe_share != 0 and self.pe_share < 1:
            # below 1 no PE may be under the limit: work would wait for the queue to raise it
            raise ValueError(f"scheduler.pe_share must be 0 (off) or >= 1, got {self.pe_share}")

    def resolved_alpha(self) -> int:
        """α in tokens: what one node's SNIC reads in ``alpha_s`` seconds."""
        if self.alpha_tokens is not None:
            return self.alpha_tokens
        return int(self.snic_bytes_per_s / KV_PRESETS[self.model].bytes_per_token * self.alpha_s)

    def resolved_read_credit(self) -> int:
        """The read-side credit in tokens: what one node's SNIC reads in ``read_credit_s``."""
        return int(self.snic_bytes_per_s / KV_PRESETS[self.model].bytes_per_token * self.read_credit_s)

    def resolved_beta(self) -> int:
        """β in prompt tokens: what one PE prefills in ``beta_s`` seconds."""
        if self.beta_tokens is not None:
            return self.beta_tokens
        rate = self.pe_tokens_per_s
        if rate is None:
            rate = cost_model(self.model).prompt_tokens_per_s(self.ref_context_tokens,
                                                              self.ref_append_tokens)
        return int(rate * self.beta_s)

    def pe_load_fn(self) -> PrefillLoad | None:
        """``(hit, new) -> PE load`` in β's unit, or ``None`` for raw prompt tokens."""
        if self.pe_load == "tokens":
            return None
        return PrefillLoad(cost_model(self.model), self.ref_context_tokens, self.ref_append_tokens)

    def pe_load_counter(self) -> Callable[[int, int], int]:
        """``(hit, new) -> PE load`` in β's unit, always a function (raw: ``hit + new``).

        Everything that reports or adds up a PE's tok_e — the core, the PE receivers'
        telemetry, the scheduler's count of plans not yet delivered — uses this, so the
        figures that replace the core's own are in the same unit.
        """
        load = self.pe_load_fn()
        return load.fn if load is not None else _raw_pe_load

    def read_side_mode(self) -> Literal["none", "pe", "alternate", "shorter_queue"]:
        if self.oracle:
            return "none"
        if self.read_side == "pe":
            return "pe"
        sides: dict[Policy, Literal["pe", "alternate", "shorter_queue"]] = {
            "basic": "pe", "dpl": "alternate", "dualpath": "shorter_queue"}
        return sides[self.policy]

    def placement_mode(self) -> Literal["balanced", "round_robin"]:
        if self.placement != "auto":
            return self.placement
        return "balanced" if self.policy == "dualpath" else "round_robin"


def _raw_pe_load(hit: int, new: int) -> int:
    return hit + new
