"""Trace sessions (``sim.recorded.Workload``) as a simulator workload.

Each session's turns become ``(hit, new, gen)`` once, at load (a few thousand tuples shared by
every ``--repeat`` copy); the cluster asks for them turn by turn, exactly as it asks the Table 2
generator (``sim.workload.TraceWorkload``).

* **Hit** of a turn: its leading trace blocks whose hash an earlier request of the same scope
  (file) sent, in file order (``sim.recorded.scope_hits``), mapped to whole cluster blocks and
  capped one token below the prompt. Copies made by ``--repeat`` are their own scopes, so they
  never hit each other (the simulator's hits are per session, so that holds by construction).
* **Think times** (``think_s``) × ``think_scale`` delay a session's next turn (online; offline,
  the paper's RL-rollout setting, uses 0: every turn follows the previous at once).
* **Sub-agents** start when their parent reaches them and block it until all are done.
* **Maximum context** (``max_context``, the model's): a turn whose prompt + generation would pass
  it follows ``policy``: ``compact`` — the agent compacts, as the Table 2 model does: the context
  keeps the task prefix (the first prompt, at most ``max_context / 8``, stored, so a hit) and the
  turn's own append; later turns grow from there (their trace hit shifts by what was dropped);
  ``drop`` — the turn is not simulated. Both are counted (``stats()``).
* **Arrivals** (online): ``poisson`` — top-level sessions arrive at ``aps``; ``trace`` — at their
  recorded start (``Session.start_s``: a Mooncake timestamp) ÷ ``speed``, and each turn not
  before the session's start + its recorded ``t`` (from the session's first turn) ÷ ``speed``
  — nor before the previous turn is done: a closed loop on the trace's own timeline. The think
  times are then not added (the recorded ``t`` holds them). ``--repeat`` copies of a session
  arrive together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.errors import InvalidArgument

from .recorded import Session, Workload, cluster_hit, scope_hits
from .workload import Agent, uniform

POLICIES = ("compact", "drop")
ARRIVALS = ("poisson", "trace")
_T_ARRIVAL = 6          # the stream tag sim.workload uses for Poisson arrivals


@dataclass
class Plan:
    """One session's simulated turns and where its sub-agents start."""

    sid: str
    shapes: list[tuple[int, int, int]] = field(default_factory=list)
    thinks: list[float] = field(default_factory=list)          # pause before each turn
    offsets: list[float] = field(default_factory=list)         # recorded t from the first turn
    spawns: dict[int, list[int]] = field(default_factory=dict)  # before turn k -> child plans


@dataclass
class PolicyStats:
    turns: int = 0
    compacted: int = 0
    dropped: int = 0
    trace_prompt_tokens: int = 0
    sim_prompt_tokens: int = 0
    hit_tokens: int = 0


class SessionWorkload:
    """Simulator workload over trace sessions (see the module docstring)."""

    nested = True

    def __init__(self, w: Workload, block_tokens: int, max_context: int, *, policy: str = "compact",
                 think_scale: float = 0.0, repeat: int = 1, seed: int = 1,
                 arrivals: str = "poisson", speed: float = 1.0) -> None:
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown context policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if arrivals not in ARRIVALS:
            raise InvalidArgument(f"unknown arrivals {arrivals!r}; choose one of {', '.join(ARRIVALS)}")
        if repeat < 1 or think_scale < 0 or max_context < 2 * block_tokens or not speed > 0:
            raise InvalidArgument("need repeat >= 1, think_scale >= 0, max_context >= 2 blocks, speed > 0")
        self.arrivals = arrivals
        self.speed = speed
        self.source = w
        self.bt = block_tokens
        self.max_context = max_context
        self.policy = policy
        self.think_scale = think_scale
        self.repeat = repeat
        self.seed = seed
        self.st = PolicyStats()
        self.plans: list[Plan] = []
        self.roots: list[int] = []
        self._pos: dict[tuple[str, int], int] = {}   # (sid, trace turn) -> position in its plan
        # one pass over every session in file order: a scope may span sessions (Mooncake's
        # one-request sessions share the file's scope)
        hits = scope_hits(w.all_sessions(), w.block_tokens)
        for top in w.sessions:
            self.roots.append(self._plan_tree(top, hits))
        self.per_copy = len(self.plans)
        self.n_roots = len(self.roots) * repeat
        self.n_agents = self.per_copy * repeat
        self._next_aid = self.n_roots
        # trace arrivals: top-level sessions in order of their recorded start, from 0
        first = min((s.start_s for s in w.sessions), default=0.0)
        self._starts = [(s.start_s - first) / speed for s in w.sessions]
        self._order = sorted(range(len(self.roots)), key=lambda i: (self._starts[i], i))
        self.arrival_span = 0.0
        if arrivals == "trace":
            self.arrival_span = max(self._starts[i] + (self.plans[r].offsets or [0.0])[-1]
                                    for i, r in enumerate(self.roots))
            if not self.arrival_span > 0:
                raise InvalidArgument(f"{w.name}: --arrivals trace needs recorded times (every "
                                      "session and turn of this trace is at t = 0); use poisson")

    # ------------------------------------------------------------------ building plans
    def _plan_tree(self, top: Session, hits: dict[tuple[str, int], int]) -> int:
        sessions = list(top.walk())
        index = {}
        for s in sessions:
            index[s.sid] = len(self.plans)
            self.plans.append(self._plan(s, hits))
        for s in sessions:
            plan = self.plans[index[s.sid]]
            for sub in s.subagents:
                at = plan.spawns.setdefault(self._pos[(s.sid, sub.before)], [])
                at.append(index[sub.session.sid])
        return index[top.sid]

    def _plan(self, s: Session, hits: dict[tuple[str, int], int]) -> Plan:
        plan, st, bt, mx = Plan(s.sid), self.st, self.bt, self.max_context
        pos = self._pos
        keep = min(s.turns[0].prompt_tokens if s.turns else 0, mx // 8) // bt * bt
        shift = 0
        for k, t in enumerate(s.turns):
            pos[(s.sid, k)] = len(plan.shapes)
            st.turns += 1
            st.trace_prompt_tokens += t.prompt_tokens
            h = hits[(s.sid, k)]
            p, g = t.prompt_tokens, t.gen_tokens
            if shift and h >= keep + shift:
                h, p = h - shift, p - shift
            elif shift:
                shift = 0                        # the conversation itself moved on: trace as is
            if p + g > mx:
                if self.policy == "drop":
                    st.dropped += 1
                    continue
                st.compacted += 1
                append = p - h
                new_p = max(min(keep + append, mx - g), keep + 1)
                shift += p - new_p
                h, p = keep, new_p
            hit = cluster_hit(h, p, bt)
            plan.shapes.append((hit, p - hit, max(g, 1)))
            plan.thinks.append(t.think_s * self.think_scale)
            plan.offsets.append((t.t_s - s.turns[0].t_s) / self.speed)
            st.sim_prompt_tokens += p
            st.hit_tokens += hit
        pos[(s.sid, len(s.turns))] = len(plan.shapes)
        return plan

    # ------------------------------------------------------------------ the simulator's interface
    def describe(self) -> str:
        w = self.source
        return (f"trace {w.name} ({w.fmt}): {len(self.roots)} sessions x{self.repeat}, "
                f"{self.n_agents} with sub-agents, context ≤ {self.max_context} ({self.policy})")

    def make_agent(self, aid: int) -> Agent:
        """Top-level session ``aid`` (copy ``aid // sessions``; trace arrivals: the copies of
        one session are consecutive, sessions in order of their recorded start)."""
        if self.arrivals == "trace":
            i, copy = divmod(aid, self.repeat)
            return self._agent(aid, self.roots[self._order[i]], copy)
        copy, i = divmod(aid, len(self.roots))
        return self._agent(aid, self.roots[i], copy)

    def _agent(self, aid: int, plan_no: int, copy: int) -> Agent:
        plan = self.plans[plan_no]
        a = Agent(aid, plan_no, len(plan.shapes))
        a.session = f"{plan.sid}#{copy}"
        a.context = copy                        # the copy this agent belongs to (its key space)
        return a

    def spawn(self, agent: Agent) -> list[Agent]:
        """Sub-agents that start before the agent's next turn (once per spawn point)."""
        k = agent.turn
        kids = self.plans[agent.base].spawns.get(k)
        if not kids or agent.spawned == k:
            return []
        agent.spawned = k
        out = []
        for plan_no in kids:
            out.append(self._agent(self._next_aid, plan_no, agent.context))
            self._next_aid += 1
        return out

    def next_turn(self, agent: Agent) -> tuple[int, int, int] | None:
        k = agent.turn
        if k >= agent.n_turns:
            return None
        plan = self.plans[agent.base]
        agent.turn = k + 1
        if self.arrivals == "trace":
            agent.due = agent.start + plan.offsets[k + 1] if k + 1 < len(plan.offsets) else 0.0
        else:
            agent.delay = plan.thinks[k + 1] if k + 1 < len(plan.thinks) else 0.0
        return plan.shapes[k]

    def arrival_gap(self, k: int, aps: float) -> float:
        """Gap before top-level session ``k``: Poisson at ``aps``, or the trace's own."""
        if self.arrivals == "trace":
            i, prev = self._order[k // self.repeat], self._order[(k - 1) // self.repeat]
            return self._starts[i] - self._starts[prev]
        return -math.log(uniform(self.seed, _T_ARRIVAL, k)) / aps

    def stats(self) -> dict:
        st = self.st
        return {"sessions": len(self.roots), "repeat": self.repeat, "agents_with_subagents": self.n_agents,
                "turns_per_copy": st.turns, "max_context": self.max_context, "policy": self.policy,
                "compacted_turns": st.compacted, "dropped_turns": st.dropped,
                "trace_prompt_tokens": st.trace_prompt_tokens, "sim_prompt_tokens": st.sim_prompt_tokens,
                "hit_share": st.hit_tokens / st.sim_prompt_tokens if st.sim_prompt_tokens else 0.0,
                "think_scale": self.think_scale, "arrivals": self.arrivals,
                "speed": self.speed if self.arrivals == "trace" else None}
