"""Workloads: agentic trajectories from the paper's Table 2, and Mooncake trace requests.

**Agentic** (paper §6.6, Appendix A.3). Table 2 publishes only averages per
dataset (turns, appended and generated tokens per turn); the shape of one trajectory is our
model, the same one the simulator uses (``sim/workload.py``; the table: ``sim/datasets.py``):

* turns ``≈ turns · U(0.5, 1.5)`` (capped by ``max_turns`` for short runs);
* appended tokens per turn log-normal (mean ``append``, σ = 1: tool output is heavy-tailed),
  generated tokens log-normal (mean ``gen``, σ = 0.6);
* the first real turn carries the task prompt (``max_len / 8`` extra tokens) and the other turns'
  appends shrink so the mean stays Table 2's;
* a **synthetic first round** of 64–512 random tokens with ``g_1 = 1`` goes before every agent
  (the paper's trick to make more agents than the 500 trajectories without shared prefixes);
* when a turn would pass ``max_len`` the agent compacts its context back to the task prompt.

Token ids are random (seeded per agent and turn); a turn's prompt is built by the replay driver
as *previous prompt + the tokens the engine generated + this turn's appended tokens*, so the
next turn hits exactly what the previous turn wrote back. ``scale`` multiplies every token
count (a 1/8-scale 32K dataset fits the local emulation's buffers).

**Mooncake** (``../shared/traces/README.md``): one request per JSON line, 512-token prefix
``hash_ids`` → our 64-token block keys (``common.kv.block_keys_from_mooncake``); with
``scale`` s < 1 a trace block becomes ``512·s`` tokens (s ∈ {1, 1/2, 1/4, 1/8}).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from sim.datasets import DATASETS  # Table 2: one copy, shared with the simulator
from common.errors import InvalidArgument
from common.kv import MOONCAKE_BLOCK_TOKENS, block_keys_from_mooncake


class AgenticSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an agentic workload is made of (recorded in the results JSON)."""

    dataset: str = "32k"
    agents: int = 8
    seed: int = 1
    scale: float = 1.0              # × every token count
    max_turns: int | None = None    # cap on real turns per agent (short runs)
    append_scale: float = 1.0       # Fig. 9: × every append
    gen_scale: float = 1.0
    vocab: int = 100_000

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise InvalidArgument(f"unknown dataset {self.dataset!r}; choose one of "
                                  f"{', '.join(DATASETS)}")
        if self.agents < 1 or not self.scale > 0 or self.vocab < 2:
            raise InvalidArgument("need agents >= 1, scale > 0, vocab >= 2")
        if self.max_turns is not None and self.max_turns < 1:
            raise InvalidArgument(f"max_turns must be >= 1, got {self.max_turns}")


@dataclass(frozen=True)
class Turn:
    append: np.ndarray        # token ids appended before this turn's prompt is sent
    gen: int                  # tokens to generate


@dataclass(frozen=True)
class Trajectory:
    """One agent: the synthetic first round, then its real turns (turn 1 = the task)."""

    session_id: str
    turns: list[Turn]         # turns[0] is the synthetic round (gen 1)
    max_len: int

    @property
    def requests(self) -> int:
        return len(self.turns)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
    return float(mean * math.exp(sigma * rng.standard_normal() - 0.5 * sigma * sigma))


class AgenticWorkload:
    """Deterministic Table 2-shaped trajectories (see the module docstring)."""

    def __init__(self, spec: AgenticSpec) -> None:
        self.spec = spec
        ds = DATASETS[spec.dataset]
        s = spec.scale
        self.max_len = max(int(ds.max_len * s), 256)
        self.append_mean = max(ds.append * s * spec.append_scale, 1.0)
        self.gen_mean = max(ds.gen * s * spec.gen_scale, 1.0)
        self.task_tokens = int(self.max_len / 8 * spec.append_scale)
        t = ds.turns
        rest = (t * self.append_mean - self.task_tokens) / max((t - 1) * self.append_mean, 1.0)
        self.rest_scale = min(max(rest, 0.1), 1.0)
        self.turns_mean = ds.turns

    def describe(self) -> str:
        sp = self.spec
        return (f"agentic {sp.dataset} x{sp.scale:g}: {sp.agents} agents, "
                f"~{self.turns_mean} turns (cap {sp.max_turns}), append {self.append_mean:.0f}, "
                f"gen {self.gen_mean:.0f}, max_len {self.max_len}")

    def trajectory(self, agent: int) -> Trajectory:
        sp = self.spec
        rng = np.random.default_rng([sp.seed, agent])
        n = max(1, round(self.turns_mean * (0.5 + rng.random())))
        if sp.max_turns is not None:
            n = min(n, sp.max_turns)
        first = 64 + int(rng.random() * 449)
        turns = [Turn(rng.integers(0, sp.vocab, first, dtype=np.int64), 1)]
        for k in range(1, n + 1):
            a = _lognormal(rng, self.append_mean, 1.0) * self.rest_scale
            a = min(max(int(a + 0.5), 1), self.max_len // 4)
            if k == 1:
                a += self.task_tokens
            g = min(max(int(_lognormal(rng, self.gen_mean, 0.6) + 0.5), 1), 4096)
            turns.append(Turn(rng.integers(0, sp.vocab, a, dtype=np.int64), g))
        return Trajectory(f"agent-{sp.seed}-{agent}", turns, self.max_len)

    def trajectories(self) -> list[Trajectory]:
        return [self.trajectory(a) for a in range(self.spec.agents)]

    def arrival_times(self, aps: float) -> list[float]:
        """Poisson agent arrivals at ``aps`` agents per second (seeded), agent 0 at t = 0."""
        if not aps > 0:
            raise InvalidArgument(f"online mode needs aps > 0, got {aps}")
        rng = np.random.default_rng([self.spec.seed, 0xA85])
        gaps = rng.exponential(1.0 / aps, self.spec.agents)
        gaps[0] = 0.0
        return list(np.cumsum(gaps))


class PromptBuilder:
    """One agent's prompts turn by turn, and the hit its earlier write-backs should give.

    ``expected_hit`` is the client's prediction (paper §6.5: hits only within a trajectory):
    after a turn with prompt P and output O, storage holds the full blocks of ``P + O[:-1]``
    (the last generated token has no KV yet); the next prompt starts with ``P + O``.
    """

    def __init__(self, traj: Trajectory, block_tokens: int) -> None:
        self.traj, self.bt = traj, block_tokens
        self.context: list[int] = []
        self.task: list[int] | None = None
        self.stored = 0           # tokens of the current context whose blocks are stored
        self.task_stored = 0

    def prompt(self, k: int) -> tuple[list[int], int]:
        """Turn ``k``'s prompt token ids and the hit (tokens) the client expects."""
        turn = self.traj.turns[k]
        app = turn.append.tolist()
        ctx, stored = self.context, self.stored
        if k > 1 and self.task is not None and \
                len(ctx) + len(app) + turn.gen > self.traj.max_len:
            ctx, stored = self.task, self.task_stored      # compaction: back to the task
        prompt = ctx + app
        hit = min(stored, (len(prompt) - 1) // self.bt * self.bt)
        if k == 1:
            self.task = prompt
        return prompt, max(hit, 0)

    def finished(self, k: int, prompt: list[int], output: list[int] | None) -> None:
        """Turn ``k`` ended with ``output`` (None: unknown, e.g. stub nodes → random ids)."""
        if output is None:
            rng = np.random.default_rng([len(prompt), k, 7])
            output = rng.integers(0, 100_000, self.traj.turns[k].gen).tolist()
            stored = len(prompt) // self.bt * self.bt
        else:
            stored = (len(prompt) + len(output) - 1) // self.bt * self.bt
        self.context, self.stored = prompt + list(output), stored
        if k == 1:
            self.task_stored = len(prompt) // self.bt * self.bt


# --------------------------------------------------------------------------- Mooncake

class TraceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    limit: int | None = 200          # first N requests (None: all in the window)
    start_s: float = 0.0             # window start in trace time
    duration_s: float | None = None  # window length in trace time
    speed: float = 1.0               # trace seconds per replay second
    scale: float = 0.125             # a 512-token trace block → 512·scale tokens


@dataclass(frozen=True)
class TraceRequest:
    index: int                       # its line in the trace file (0-based): ``trace-<index>``
    t_s: float                       # replay time of arrival
    prompt_tokens: int
    gen_tokens: int
    keys: list[str]


def load_mooncake(spec: TraceSpec, block_tokens: int = 64) -> list[TraceRequest]:
    """The trace's requests in the window, times rebased to 0 and divided by ``speed``; each
    keeps its line number as its index (its request id ``trace-<line>`` whatever the window)."""
    per = block_tokens / spec.scale                # trace tokens per one of our blocks
    if per != int(per) or MOONCAKE_BLOCK_TOKENS % int(per) or int(per) % block_tokens:
        raise InvalidArgument(f"trace scale {spec.scale} must make {block_tokens}/scale divide "
                              f"{MOONCAKE_BLOCK_TOKENS} (use 1, 0.5, 0.25 or 0.125)")
    if not spec.speed > 0:
        raise InvalidArgument(f"trace speed must be positive, got {spec.speed}")
    out: list[TraceRequest] = []
    path = Path(spec.path)
    if not path.exists():
        raise InvalidArgument(f"trace file not found: {path}")
    t0 = spec.start_s * 1000.0
    with path.open() as f:
        for line_no, line in enumerate(f):
            if spec.limit is not None and len(out) >= spec.limit:
                break
            r = json.loads(line)
            ts = float(r["timestamp"])
            if ts < t0:
                continue
            if spec.duration_s is not None and ts >= t0 + spec.duration_s * 1000.0:
                break
            out.append(_trace_request(line_no, r, ts - t0, spec, int(per), block_tokens))
    return out


def _trace_request(i: int, r: dict, rel_ms: float, spec: TraceSpec, per: int,
                   block_tokens: int) -> TraceRequest:
    n_in = int(r["input_length"])
    prompt = max(1, math.ceil(n_in * spec.scale))
    gen = max(1, round(int(r["output_length"]) * spec.scale))
    keys = block_keys_from_mooncake(r["hash_ids"], n_in, per)[:prompt // block_tokens]
    return TraceRequest(i, rel_ms / 1000.0 / spec.speed, prompt, gen, keys)
