"""The paper's Table 2 generator (``sim.workload.TraceWorkload``) as a :class:`Workload`.

So the replay, the simulator and the planner read every source through one trace layer
(``sim.recorded``): ``--trace table2:64k`` (``table2:DATASET[:AGENTS]``) names a generated
workload as a path names a recorded one. Each agent becomes one session (its own hash-id scope)
whose turns are exactly the generator's ``(hit, new, gen)`` for the same seed: prompt = hit +
new, generated = gen.

Hash ids (docs/workloads.md "Table 2 as a trace"): one id per ``block_tokens`` block of the
agent's context, prefix-consistent by construction — a block keeps its id while the context keeps
it, and a block whose content is new (an append, the generated tokens that complete the prompt's
partial last block, the append after a compaction) gets a new id from the agent's counter. The
generated tokens are stored by the write-back (docs/datapath.md, 'Write-back'), so the next turn
hits them; a recorded trace has no hashes for them, so the turn carries them apart
(``Turn.gen_hash_ids``) and ``sim.recorded.scope_hits`` counts them as stored. With that the hit
computed from the ids equals the generator's hit, turn by turn (tested).

Why this is not the only Table 2 path: the ids take memory in proportion to agents × turns ×
context blocks (~1,000 per 64K turn), so paper-scale runs (48K agents at 48P96D) keep the lazy
generator (``sim.run.simulate``); for the sizes where both fit, their simulations are equal
(``tests/test_table2_trace.py``).
"""

from __future__ import annotations

from common.errors import InvalidArgument

from .datasets import DATASETS
from .recorded import Session, Turn, Workload
from .workload import TraceWorkload

PREFIX = "table2:"
DEFAULT_AGENTS = 500            # the generator's base trajectories: every one appears once


def is_table2(spec: object) -> bool:
    return isinstance(spec, str) and spec.lower().startswith(PREFIX)


def parse_spec(spec: str, default_agents: int = DEFAULT_AGENTS) -> tuple[str, int]:
    """``table2:DATASET[:AGENTS]`` -> (dataset, agents); InvalidArgument naming the spec."""
    parts = spec[len(PREFIX):].split(":") if is_table2(spec) else []
    if not 1 <= len(parts) <= 2 or parts[0].lower() not in DATASETS:
        raise InvalidArgument(f"{spec!r}: want table2:DATASET[:AGENTS] with DATASET one of "
                              f"{', '.join(DATASETS)} (docs/workloads.md)")
    agents = default_agents
    if len(parts) == 2:
        if not parts[1].isdigit() or int(parts[1]) < 1:
            raise InvalidArgument(f"{spec!r}: AGENTS must be a positive integer")
        agents = int(parts[1])
    return parts[0].lower(), agents


def table2_workload(spec: str, *, default_agents: int = DEFAULT_AGENTS, seed: int = 1,
                    block_tokens: int = 64, turns_scale: float = 1.0) -> Workload:
    """The generator's agents for ``spec`` as sessions (seeded, deterministic)."""
    ds, agents = parse_spec(spec, default_agents)
    if block_tokens < 1 or not turns_scale > 0:
        raise InvalidArgument("need block_tokens >= 1 and turns_scale > 0")
    gen = TraceWorkload(ds, agents, seed, block_tokens, turns_scale=turns_scale)
    name = f"table2-{ds}-{agents}a-s{seed}" + (f"-t{turns_scale:g}" if turns_scale != 1.0 else "")
    sessions = tuple(_session(gen, aid, name) for aid in range(agents))
    return Workload(name, "table2", block_tokens, sessions)


class _Context:
    """One agent's context as block ids: full blocks, plus the tokens of a partial last one."""

    def __init__(self, block_tokens: int) -> None:
        self.bt = block_tokens
        self.last_id = 0
        self.blocks: list[int] = []
        self.tail = 0

    def new_id(self) -> int:
        self.last_id += 1
        return self.last_id

    def extend(self, tokens: int) -> list[int]:
        """Append ``tokens`` of new content; returns the ids of the blocks they complete."""
        fill = self.tail + tokens
        done = []
        while fill >= self.bt:
            done.append(self.new_id())
            fill -= self.bt
        self.blocks += done
        self.tail = fill
        return done


def _session(gen: TraceWorkload, aid: int, scope: str) -> Session:
    agent = gen.make_agent(aid)
    ctx = _Context(gen.bt)
    base: tuple[list[int], int] | None = None     # the task prefix a compaction keeps
    turns: list[Turn] = []
    while True:
        before = agent.context
        t = gen.next_turn(agent)
        if t is None:
            break
        hit, new, g = t
        prompt = hit + new
        append = prompt - before if agent.turn == 1 else agent.last_append
        if agent.turn > 1 and prompt != before + append:      # compacted to the task prefix
            if base is None:
                raise RuntimeError(f"agent {aid}: compaction before its task turn")
            ctx.blocks, ctx.tail = list(base[0]), base[1]
        ctx.extend(append)
        ids = ctx.blocks + ([ctx.new_id()] if ctx.tail else [])
        if agent.turn == 2:
            base = (list(ctx.blocks), ctx.tail)               # turn 1 of the trajectory: the task
        out = ctx.extend(g)
        turns.append(Turn(len(turns), 0.0, 0.0, prompt, g, tuple(ids), tuple(out)))
    return Session(f"a{aid}", f"{scope}/a{aid}", scope, 0.0, tuple(turns))
