"""Agentic workloads from the paper's Table 2 statistics, generated lazily and deterministically.

Trajectory model ([inference]; the paper publishes only the averages of Table 2):

* 500 base trajectories per dataset (the paper's count). Base trajectory ``b`` has
  ``turns·U(0.5, 1.5)`` turns; turn ``i`` appends ``A_i`` tokens (log-normal, mean ``append``,
  σ = 1: tool outputs are heavy-tailed) and generates ``G_i`` tokens (log-normal, mean ``gen``,
  σ = 0.6). All of it is a pure function of ``(seed, b, i)`` — nothing is stored per turn.
* Agent ``a`` replays base trajectory ``π(a mod 500)`` (``π`` a seeded permutation) behind a
  synthetic first round of 64–512 random tokens with ``g_1 = 1`` (the paper's trick, §6.6), so no
  two agents share a prefix. Dealing the base trajectories out in turn (rather than drawing them
  independently) gives every run of ≥ 500 agents the same trajectory mix — the longest base
  trajectory, which sets the tail of an offline run, is in all of them — so clusters with agents
  proportional to nodes compare like for like (Table 3).
* Context grows turn by turn: prompt = context + ``A_i``; the hit is what earlier turns stored, i.e.
  the context rounded down to full blocks (a partial last block is not stored, docs/datapath.md).
* The first real turn carries the task prompt (system prompt, tools, repository context):
  ``MaxLen/8`` extra appended tokens; the other turns' appends are scaled down so that the mean
  append over all turns stays Table 2's.
* When a turn would overflow the dataset's maximum length the agent compacts its context: it keeps
  the task prompt (the prefix up to the end of the first real turn, stored, so it is a hit) and
  drops the rest; the turn's append follows it. This saw-tooth is what makes Table 2 consistent:
  with 157 turns of 429 + 176 tokens a trajectory
  would grow to 95K tokens, yet MaxLen is 64K and the mean context is 32.7K ≈ MaxLen/2 (likewise
  17.2K for 32K and 25.1K for 48K). ``table2_check`` prints the generated statistics next to
  Table 2's (docs/simulator.md has the table).

Append/gen scaling (Fig. 9) multiplies every ``A_i``/``G_i``; ``turns_scale`` shortens runs.
"""

from __future__ import annotations

import math

# Table 2 (one copy, shared with the live replay); re-exported here.
from .datasets import DATASETS, Dataset, dataset  # noqa: F401

M64 = (1 << 64) - 1
BASE_TRAJECTORIES = 500
_TWO_PI = 2.0 * math.pi
_U32 = 1.0 / 4294967296.0


def _mix(x: int) -> int:
    """splitmix64 finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def uniform(seed: int, a: int, b: int = 0, c: int = 0) -> float:
    """A uniform in (0, 1) that is a pure function of its integer keys (counter-based RNG)."""
    h = _mix(_mix(_mix(_mix(seed & M64) ^ (a & M64)) ^ (b & M64)) ^ (c & M64))
    return ((h >> 11) + 0.5) * (1.0 / 9007199254740992.0)


def _lognormal(mean: float, sigma: float, u1: float, u2: float) -> float:
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(_TWO_PI * u2)
    return mean * math.exp(sigma * z - 0.5 * sigma * sigma)


# Stream tags for uniform(): keep the streams of different quantities apart.
_T_TURNS, _T_APPEND, _T_GEN, _T_BASE, _T_FIRST, _T_ARRIVAL = 1, 2, 3, 4, 5, 6


class Agent:
    """One agent's replay position: all it needs to produce its next turn."""

    __slots__ = ("aid", "base", "turn", "n_turns", "context", "start", "session", "done_t",
                 "last_append", "base_ctx", "delay", "due", "parent", "waiting", "spawned")

    def __init__(self, aid: int, base: int, n_turns: int) -> None:
        self.aid = aid
        self.base = base
        self.turn = 0
        self.n_turns = n_turns
        self.context = 0
        self.start = 0.0
        self.session = f"a{aid}"
        self.done_t = 0.0
        self.last_append = 0
        self.base_ctx = 0
        # trace sessions (session_workload.py): think time before the next turn, the parent a
        # sub-agent unblocks when done, sub-agents still running, the turn whose sub-agents were
        # started
        self.delay = 0.0
        self.due = 0.0        # trace arrivals: the next turn not before this simulated time
        self.parent: Agent | None = None
        self.waiting = 0
        self.spawned = -1


class TraceWorkload:
    """Agents replaying Table 2-shaped trajectories (see the module docstring)."""

    def __init__(self, ds: Dataset | str, n_agents: int, seed: int = 1, block_tokens: int = 64,
                 append_scale: float = 1.0, gen_scale: float = 1.0, turns_scale: float = 1.0,
                 append_sigma: float = 1.0, gen_sigma: float = 0.6) -> None:
        self.ds = dataset(ds) if isinstance(ds, str) else ds
        if n_agents <= 0:
            raise ValueError(f"need at least one agent, got {n_agents}")
        self.n_agents = n_agents
        self.seed = seed
        self.bt = block_tokens
        self.append_mean = self.ds.append * append_scale
        self.gen_mean = self.ds.gen * gen_scale
        self.turns_scale = turns_scale
        self.append_sigma = append_sigma
        self.gen_sigma = gen_sigma
        self.max_len = self.ds.max_len
        self.append_max = self.max_len // 4
        self._shapes: dict[int, list[tuple[int, int]]] = {}   # ≤ 500 base trajectories
        self._perm = sorted(range(BASE_TRAJECTORIES), key=lambda b: uniform(seed, _T_BASE, b))
        self.task_tokens = int(self.max_len / 8 * append_scale)
        t = self.ds.turns * turns_scale
        rest = (t * self.append_mean - self.task_tokens) / max((t - 1) * self.append_mean, 1.0)
        self.rest_scale = min(max(rest, 0.1), 1.0)

    def describe(self) -> str:
        return (f"{self.ds.name}: {self.n_agents} agents, ~{self.ds.turns * self.turns_scale:.0f} turns, "
                f"append {self.append_mean:.0f}, gen {self.gen_mean:.0f}, max {self.max_len}")

    def base_turns(self, base: int) -> int:
        u = uniform(self.seed, _T_TURNS, base)
        return max(1, round(self.ds.turns * self.turns_scale * (0.5 + u)))

    def make_agent(self, aid: int) -> Agent:
        base = self._perm[aid % BASE_TRAJECTORIES]
        return Agent(aid, base, self.base_turns(base) + 1)   # + the synthetic first round

    def turn_shape(self, base: int, i: int) -> tuple[int, int]:
        """(append, gen) of base trajectory ``base``'s turn ``i`` (cached per base trajectory)."""
        shapes = self._shapes.get(base)
        if shapes is None:
            shapes = self._shapes[base] = [self._shape(base, k) for k in range(self.base_turns(base))]
        return shapes[i] if i < len(shapes) else self._shape(base, i)

    def _shape(self, base: int, i: int) -> tuple[int, int]:
        """(append, gen) from two hashes → four uniforms."""
        h = _mix(_mix(_mix(self.seed & M64) ^ _T_APPEND) ^ base)
        x = _mix(h ^ (2 * i + 1))
        y = _mix(h ^ (2 * i + 2))
        af = _lognormal(self.append_mean, self.append_sigma, ((x >> 32) + 0.5) * _U32, ((x & 0xFFFFFFFF) + 0.5) * _U32)
        gf = _lognormal(self.gen_mean, self.gen_sigma, ((y >> 32) + 0.5) * _U32, ((y & 0xFFFFFFFF) + 0.5) * _U32)
        a = min(max(int(af + 0.5), 1), self.append_max)
        g = min(max(int(gf + 0.5), 1), 4096)
        return a, g

    def next_turn(self, agent: Agent) -> tuple[int, int, int] | None:
        """``(hit, new, gen)`` of the agent's next turn (advancing it), or None when it is done."""
        k = agent.turn
        if k >= agent.n_turns:
            return None
        agent.turn = k + 1
        if k == 0:
            first = 64 + int(uniform(self.seed, _T_FIRST, agent.aid) * 449)
            agent.context = first + 1
            return 0, first, 1
        a, g = self.turn_shape(agent.base, k - 1)
        a = int(a * self.rest_scale + 0.5) or 1
        if k == 1:
            a += self.task_tokens
            agent.base_ctx = agent.context + a   # the task prefix a compaction keeps
        agent.last_append = a
        ctx = agent.context
        if ctx + a + g > self.max_len:          # compaction: back to the task prefix
            ctx = agent.base_ctx
        hit = ctx - ctx % self.bt
        agent.context = ctx + a + g
        return hit, ctx + a - hit, g

    def arrival_gap(self, k: int, aps: float) -> float:
        """Exponential gap before agent ``k`` arrives (Poisson arrivals at ``aps``)."""
        return -math.log(uniform(self.seed, _T_ARRIVAL, k)) / aps


class FixedWorkload:
    """Every turn of every agent is ``(hit, new, gen)``: steady loads for tests."""

    def __init__(self, n_agents: int, turns: int, hit: int, new: int, gen: int, seed: int = 1) -> None:
        self.n_agents = n_agents
        self.turns = turns
        self.shape = (hit, new, gen)
        self.seed = seed

    def describe(self) -> str:
        h, n, g = self.shape
        return f"fixed: {self.n_agents} agents x {self.turns} turns of hit {h}, new {n}, gen {g}"

    def make_agent(self, aid: int) -> Agent:
        return Agent(aid, 0, self.turns)

    def next_turn(self, agent: Agent) -> tuple[int, int, int] | None:
        if agent.turn >= agent.n_turns:
            return None
        agent.turn += 1
        return self.shape

    def arrival_gap(self, k: int, aps: float) -> float:
        return -math.log(uniform(self.seed, _T_ARRIVAL, k)) / aps


def table2_check(name: str, seed: int = 1, agents: int = 500) -> dict[str, float]:
    """Generated per-trajectory / per-turn averages next to Table 2's, over ``agents`` agents.

    ``append`` is the mean number of tokens a turn appends (prompt − previous context);
    ``prefilled`` the mean number of tokens a turn must prefill (append + the partial last block
    + whole prompts after a compaction); ``context`` the mean hit per turn.
    """
    w = TraceWorkload(name, agents, seed)
    turns = appends = prefilled = gens = hits = peak = 0
    for aid in range(agents):
        ag = w.make_agent(aid)
        w.next_turn(ag)                        # the synthetic round is not part of Table 2
        top = 0
        while (t := w.next_turn(ag)) is not None:
            hit, new, gen = t
            turns += 1
            prompt = hit + new
            appends += ag.last_append
            prefilled += new
            gens += gen
            hits += hit
            top = max(top, prompt + gen)
        peak += top
    ds, n = w.ds, max(turns, 1)
    return {"turns": turns / agents, "turns_paper": ds.turns,
            "append": appends / n, "append_paper": ds.append,
            "prefilled": prefilled / n,
            "gen": gens / n, "gen_paper": ds.gen,
            "context": hits / n, "context_paper": ds.context,
            "peak": peak / agents, "total_paper": ds.total,
            "hit_rate": hits / max(hits + prefilled, 1),
            "hit_rate_paper": ds.context / (ds.context + ds.append)}
