"""What one chaos case is and what it found: the injected :class:`Fault`, each
:class:`Submission` of the load and how it ended, and the :class:`CaseResult` the harness
(:mod:`tools.cluster.chaos`) fills in. Plain records, no processes: the harness, the bench
and the tests share them; ``tools.cluster.chaos`` re-exports them for its users."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from common.faults import FAILPOINTS

DEADLINE_S = 30.0              # per submission
LATE_S = 3.0                   # an answer this long after the deadline counts as hung


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``target`` is a launcher process name (``de_loader:d0``, ...)."""

    case: str
    target: str
    action: str                    # kill | stop | partition | latency (the last two: a point)
    point: str | None = None       # a failpoint (None: a signal from outside at after_s)
    at: int = 1                    # the failpoint's hit that fires
    after_s: float = 1.0           # outside signal: seconds into the load
    pause_s: float = 3.5           # stop: SIGCONT this long after the pause (lease is 2 s);
                                   # partition: its length; latency: how long the disk is slow
    latency_s: float = 0.3         # latency: added to every hit of the point
    agents: int = 4
    turns: int = 4

    def __post_init__(self) -> None:
        if self.action not in ("kill", "stop", "partition", "latency"):
            raise ValueError(f"{self.case}: action must be kill, stop, partition or latency")
        if self.action in ("partition", "latency") and self.point is None:
            raise ValueError(f"{self.case}: {self.action} needs a failpoint")
        if self.point is not None and self.point not in FAILPOINTS:
            raise ValueError(f"{self.case}: unknown failpoint {self.point!r}")

    @property
    def where(self) -> str:
        return self.point or f"external@{self.after_s:g}s"

    @property
    def spec(self) -> str:
        """The failpoint spec armed in the victim (common.faults)."""
        arg = {"partition": f":{self.pause_s:g}", "latency": f":{self.latency_s:g}"}
        return f"{self.point}={self.action}{arg.get(self.action, '')}@{self.at}"


@dataclass
class Submission:
    """One submission of the load (a retry is a new one) and how it ended."""

    request_id: str
    t_start: float
    t_end: float | None = None
    outcome: str = "pending"       # finished | failed | hung
    code: str | None = None
    message: str | None = None
    retryable: bool | None = None
    output_ok: bool | None = None
    attempts: int = 0
    pe_node: str | None = None
    de_node: str | None = None
    read_side: str | None = None

    @property
    def lost(self) -> bool:
        if self.outcome == "finished":
            return self.output_ok is False
        if self.outcome == "failed":
            return not self.retryable or (self.t_end - self.t_start) > DEADLINE_S + LATE_S
        return True                # hung / pending: never answered


@dataclass
class CaseResult:
    case: str
    target: str
    point: str
    action: str
    fired: bool = False
    t_fault_s: float | None = None          # from the case's start
    submissions: int = 0
    finished: int = 0
    failed_retryable: int = 0
    lost: int = 0
    lost_detail: list[str] = field(default_factory=list)
    affected: int = 0                       # in flight at the fault, or failed, or re-planned
    replans: int = 0
    leases_expired: int = 0
    rejoined: bool = False                  # registered again with a new epoch
    old_epoch: int | None = None
    new_epoch: int | None = None
    recovery_s: float | None = None
    leaked_pages: dict[str, int] = field(default_factory=dict)   # survivors
    victim_leaked_pages: int = 0
    orphaned_pages: dict[str, int] = field(default_factory=dict)  # of those: no attempt's
    unreachable: list[str] = field(default_factory=list)      # survivors not answering
    unreachable_logs: dict[str, str] = field(default_factory=dict)   # their log tails
    quiet_s: float | None = None            # fault → no live request and every pool free
    prompt_mismatches: int = 0
    wall_s: float = 0.0
    outcome: str = ""

    @property
    def leaked_total(self) -> int:
        return sum(self.leaked_pages.values())

    @property
    def ok(self) -> bool:
        return (self.fired and self.lost == 0 and self.leaked_total == 0 and self.rejoined
                and not self.unreachable
                and self.recovery_s is not None and self.prompt_mismatches == 0)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, leaked_total=self.leaked_total)
        return d
