"""The ablation modes (paper §6.7): one table, read by the simulator and the cluster.

Why here: most of what a mode switches is the scheduler's (``SchedulerConfig.policy``,
``placement``, ``oracle``), and both users — the simulator (``sim.config``) and the live cluster
launcher (``tools.cluster.config``) — sit above ``services.scheduler``. The engine-side switches
(layer-wise prefill, quota batching) are listed beside them so a mode means the same thing in a
simulated and in an emulated run.

================  ==========  =========  ===========  ======  =========  =====  ========
mode              policy      read side  placement    oracle  layerwise  quota  ablation
================  ==========  =========  ===========  ======  =========  =====  ========
``basic``         basic       auto       auto         no      no         no     yes
``+layer``        basic       auto       auto         no      yes        no     yes
``+dpl``          dpl         auto       auto         no      yes        no     yes
``pe-only``       dualpath    pe         auto         no      yes        yes    yes
``dualpath``      dualpath    auto       auto         no      yes        yes    yes
``dualpath-rr``   dualpath    auto       round_robin  no      yes        yes    no
``oracle``        dualpath    auto       auto         yes     yes        yes    yes
================  ==========  =========  ===========  ======  =========  =====  ========

``pe-only`` is ``dualpath`` with the DE read path switched off (``SchedulerConfig.read_side``):
the same layer-wise prefill, quota batching and placement, every hit read on the PE side — the
baseline that isolates what the dual read path itself adds (``dualpath plan``'s headline saving
is against it; ``basic`` also lacks layer-wise prefill and quota batching).
``oracle`` skips all KV I/O; ``dualpath-rr`` is the load-balance comparison's round-robin
scheduler, not a step of the ablation sweep (:data:`ABLATION_MODES`, what ``all`` runs).
``quota`` (intra-engine 300 ms quota batching, part of "+sched") is read by the simulator only:
the engine emulator always batches under its ``engine_sim.quota_s``.

Not compiled by ``sim.accel`` (not one of its ``MODULES``): the compiled ``sim.cluster`` reads a
``ModeSpec``'s attributes as those of a plain Python object.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .config import Placement, Policy, ReadSideMode

EngineMode = Literal["layerwise", "whole"]     # tools.engine_sim's ``[engine_sim] mode``


class ModeSpec(msgspec.Struct, frozen=True):
    """What one ablation mode switches: scheduler policy and the engines' prefill style."""

    policy: Policy              # SchedulerConfig.policy
    placement: Placement        # SchedulerConfig.placement
    oracle: bool                # SchedulerConfig.oracle: all KV I/O skipped
    layerwise: bool             # layer-wise prefill (else whole-prompt, the basic mode)
    quota: bool                 # intra-engine 300 ms quota batching (simulator; part of "+sched")
    ablation: bool = True       # a step of the ablation sweep (paper Fig. 12 right, plus pe-only)
    read_side: ReadSideMode = "auto"    # SchedulerConfig.read_side ("pe": no DE read path)

    @property
    def engine_mode(self) -> EngineMode:
        """The engine emulator's ``[engine_sim] mode`` for this mode."""
        return "layerwise" if self.layerwise else "whole"

    @property
    def de_reads(self) -> bool:
        """Whether the mode ever reads a hit on the DE side (else only the PE nodes' links read)."""
        return not self.oracle and self.policy != "basic" and self.read_side != "pe"


MODE_SPECS: dict[str, ModeSpec] = {
    "basic": ModeSpec("basic", "auto", False, False, False),      # PE reads only, no layer-wise
    "+layer": ModeSpec("basic", "auto", False, True, False),
    "+dpl": ModeSpec("dpl", "auto", False, True, False),          # both paths, alternating
    "pe-only": ModeSpec("dualpath", "auto", False, True, True, read_side="pe"),  # no DE reads
    "dualpath": ModeSpec("dualpath", "auto", False, True, True),
    "dualpath-rr": ModeSpec("dualpath", "round_robin", False, True, True, ablation=False),
    "oracle": ModeSpec("dualpath", "auto", True, True, True),     # all KV I/O skipped
}

MODES: tuple[str, ...] = tuple(MODE_SPECS)
ABLATION_MODES: tuple[str, ...] = tuple(m for m, s in MODE_SPECS.items() if s.ablation)


def mode_spec(mode: str) -> ModeSpec:
    """The switches of ``mode``; ValueError naming the known modes if there is no such mode."""
    try:
        return MODE_SPECS[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}") from None
