"""Live replay of recorded sessions (``sim.recorded``: the agentic conversation format).

Each session submits its turns one after another with the trace's block keys (no token ids):
``sim.recorded.block_keys`` maps the 64-token prefix hashes onto the cluster's blocks in a key
space of the session's scope (its file and ``--repeat`` copy), so turns of one conversation hit
what its earlier turns stored and nothing else. Think times (× ``think_scale``) pause a session
before a turn; sub-agents run concurrently where the file puts them and block their parent.

``scale`` multiplies every token count so long agentic contexts fit a local emulation (its
buffers and its slowed links): a 64-token trace block becomes ``64·scale`` tokens and
``block/(64·scale)`` trace blocks make one cluster block (scale 1/8: 8 per 64-token block).

The client predicts each turn's hit — the longest prefix of its keys that earlier turns of the
scope sent, clamped as the scheduler clamps it (whole blocks, at least one token computed) —
and the results compare it with the hit the cluster reports (``hit_mismatches``). Turns whose
scaled prompt + generation passes ``max_prompt`` are not sent and are counted (``dropped``):
trace keys cannot be compacted, so dropping is the replay's context policy.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import msgspec

from common.errors import InvalidArgument
from sim.recorded import Session, Workload, block_keys, block_mapping, load_workload

from .driver import ClientPool, Progress, Replayer, RequestRecord


class SessionTraceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A recorded-session replay (recorded in the results JSON)."""

    path: str
    fmt: str | None = None
    conversations: int | None = 4       # first N sessions (None: all)
    max_turns: int | None = 8           # per session (None: all)
    repeat: int = 1
    scale: float = 0.125                # × every token count
    think_scale: float = 0.0            # × every think time (0: back to back)
    max_prompt: int = 65_536            # scaled prompt + generation above it: turn dropped
    seed: int = 1                       # salts the key space (a rerun on old storage: new seed)
    agents: int | None = None           # table2:DATASET (no :AGENTS): the generator's agents
    arrivals: str = "poisson"           # "trace": recorded session starts and turn times
    speed: float = 1.0                  # arrivals "trace": trace seconds per replay second

    def __post_init__(self) -> None:
        if not self.scale > 0 or self.repeat < 1 or self.think_scale < 0 or self.max_prompt < 2:
            raise InvalidArgument("need scale > 0, repeat >= 1, think_scale >= 0, max_prompt >= 2")
        if self.max_turns is not None and self.max_turns < 1:
            raise InvalidArgument(f"max_turns must be >= 1, got {self.max_turns}")
        if self.arrivals not in ("poisson", "trace") or not self.speed > 0:
            raise InvalidArgument(f"arrivals must be poisson or trace (got {self.arrivals!r}) "
                                  f"and speed > 0 (got {self.speed})")


@dataclass
class SessionPlan:
    """What the driver sends: per turn (think s, prompt, gen, keys), sub-agents by turn."""

    sid: str
    scope: str
    turns: list[tuple[float, int, int, list[str]]] = field(default_factory=list)
    subs: dict[int, list[SessionPlan]] = field(default_factory=dict)
    offsets: list[float] = field(default_factory=list)   # recorded t from the first turn ÷ speed
    start_s: float = 0.0                                 # recorded start ÷ speed (from the first)


class SessionTrace:
    """A loaded trace turned into session plans for a cluster's block size."""

    def __init__(self, spec: SessionTraceSpec, block_tokens: int) -> None:
        self.spec = spec
        w: Workload = _load(spec).subset(spec.conversations)
        if w.fmt not in ("agentic", "table2"):
            raise InvalidArgument(f"{spec.path}: session replay takes the agentic format; replay "
                                  "a Mooncake file with --trace FILE.jsonl (per-request mode)")
        w = w.repeated(spec.repeat)
        self.label = f"{w.name}: {len(w.sessions)} sessions"
        self.trace_block = w.block_tokens * spec.scale
        if self.trace_block != int(self.trace_block):
            raise InvalidArgument(f"--trace-scale {spec.scale} must make the {w.block_tokens}-token "
                                  "trace block a whole number of tokens")
        block_mapping(int(self.trace_block), block_tokens)        # raises if they cannot map
        self.bt = block_tokens
        self.dropped = 0
        self.plans = [self._plan(s) for s in w.sessions]
        first = min(s.start_s for s in w.sessions)
        for plan, s in zip(self.plans, w.sessions):
            plan.start_s = (s.start_s - first) / spec.speed
        if spec.arrivals == "trace" and not any(p.start_s or any(p.offsets) for p in self.plans):
            raise InvalidArgument(f"{w.name}: --arrivals trace needs recorded times (every session "
                                  "and turn of this trace is at t = 0); use poisson")

    def _plan(self, s: Session) -> SessionPlan:
        sp = self.spec
        plan = SessionPlan(s.sid, s.scope)
        n = len(s.turns) if sp.max_turns is None else min(len(s.turns), sp.max_turns)
        for k, t in enumerate(s.turns[:n]):
            for sub in s.subagents:           # they run before the next turn that is sent
                if sub.before == k:
                    plan.subs.setdefault(len(plan.turns), []).append(self._plan(sub.session))
            prompt = max(1, math.ceil(t.prompt_tokens * sp.scale))
            gen = max(1, round(t.gen_tokens * sp.scale))
            if prompt + gen > sp.max_prompt:
                self.dropped += 1
                continue
            keys = block_keys(t.hash_ids, prompt, int(self.trace_block), self.bt, f"{sp.seed}:{s.scope}")
            plan.turns.append((t.think_s * sp.think_scale, prompt, gen, keys))
            plan.offsets.append((t.t_s - s.turns[0].t_s) / sp.speed)
        for sub in s.subagents:
            if sub.before >= n:
                plan.subs.setdefault(len(plan.turns), []).append(self._plan(sub.session))
        return plan

    def requests(self) -> int:
        def count(p: SessionPlan) -> int:
            return len(p.turns) + sum(count(c) for cs in p.subs.values() for c in cs)
        return sum(count(p) for p in self.plans)


def _load(spec: SessionTraceSpec) -> Workload:
    """The recorded trace at ``spec.path``, or the Table 2 generator's sessions for a
    ``table2:DATASET[:AGENTS]`` spec. The generator is the simulator's (``sim.table2_trace``),
    imported only here: one model of Table 2, not a second copy in the replay."""
    if spec.path.lower().startswith("table2:"):
        from sim.table2_trace import table2_workload
        return table2_workload(spec.path, default_agents=spec.agents or 8, seed=spec.seed)
    return load_workload(spec.path, spec.fmt)


def expected_hit(keys: list[str], sent: set[str], prompt: int, block_tokens: int) -> int:
    """The hit the scheduler should report: leading keys an earlier turn sent, clamped."""
    n = 0
    for k in keys:
        if k not in sent:
            break
        n += 1
    return max(0, min(n, (prompt - 1) // block_tokens)) * block_tokens


async def run_sessions(pool: ClientPool, trace: SessionTrace, *, aps: float | None = None,
                       deadline_s: float = 300.0, retries: int = 3, progress: Progress | None = None,
                       stop_after_s: float | None = None) -> Replayer:
    """Every session (offline: all at t = 0; online: Poisson arrivals at ``aps``; arrivals
    ``trace``: each session at its recorded start, each turn not before its recorded time)."""
    r = Replayer(pool, deadline_s=deadline_s, retries=retries, on_done=progress.done if progress else None)
    sent: dict[str, set[str]] = {}
    timed = trace.spec.arrivals == "trace"
    starts = [p.start_s for p in trace.plans] if timed else _arrivals(len(trace.plans), aps, trace.spec.seed)

    async def session(p: SessionPlan, key: int) -> None:
        scope = sent.setdefault(p.scope, set())
        t0 = 0.0                # turn 0's submission (set below): the offsets' origin
        for k, (think, prompt, gen, keys) in enumerate(p.turns):
            if k:
                wait = t0 + p.offsets[k] - r.now() if timed else think
                if wait > 0:
                    await asyncio.sleep(wait)
            if k in p.subs:
                await asyncio.gather(*(session(c, key) for c in p.subs[k]))
            rec = RequestRecord(request_id=f"{p.sid}-t{k}", session_id=p.sid, turn=k, prompt_tokens=prompt,
                                gen_tokens=gen, expected_hit=expected_hit(keys, scope, prompt, trace.bt))
            final = await r.request(rec, key, block_keys=keys)
            if k == 0:
                t0 = rec.submit_s             # turn k goes >= offsets[k] after turn 0 went
            if final is None:
                return                        # a session cannot go on past a failed turn
            scope.update(keys)
        if len(p.turns) in p.subs:
            await asyncio.gather(*(session(c, key) for c in p.subs[len(p.turns)]))

    async def top(i: int) -> None:
        await asyncio.sleep(max(starts[i] - r.now(), 0.0))
        if stop_after_s is not None and r.now() > stop_after_s:
            return
        await session(trace.plans[i], i)

    await asyncio.gather(*(top(i) for i in range(len(trace.plans))))
    return r


def _arrivals(n: int, aps: float | None, seed: int) -> list[float]:
    if not aps:
        return [0.0] * n
    import numpy as np
    gaps = np.random.default_rng([seed, 0x5E55]).exponential(1.0 / aps, n)
    gaps[0] = 0.0
    return list(np.cumsum(gaps))
