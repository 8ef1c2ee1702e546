"""``dualpath bench engine_agents``: the paper's experiment with a real engine — recorded agent
sessions at once through the front on 1P2D real vLLM, every storage link shaped.

One ``dualpath cluster up`` of ``configs/vllm-1p2d.toml`` (free ports, temporary storage):
storage gateways, a PE receiver and two DE loaders, the scheduler, three vLLM OpenAI servers on
SmolLM2-135M fp32 (one prefill, two decode instances) and the front, every one its own
process. The vLLM instances run **without their own prefix cache**
(``[cluster] vllm_prefix_caching = false``): the paper's regime, where an agent's context does
not stay in HBM between turns (tool calls take seconds to minutes and many agents share the
instance), so every hit comes from storage — here the instances' 1 GiB caches would otherwise
hold the whole run, and vLLM would never read storage at all.

The workload: the first ``--sessions`` conversations of ``--trace`` (default
``../shared/traces/agentic``) with at least ``--turns`` turns that fit the instances' 2,048-token
context, their first ``--turns`` turns each. Token scale 1/64: one token per 64-token trace
block, its id derived deterministically from the block's hash id and the conversation
(:func:`token_of`), so turns of one conversation share exactly the prefixes the trace records
and conversations share nothing (turns of 250–1,700 tokens; the trace's own are 15k–110k).
Sessions run at once, each turn right after the previous one's answer (no think time), 16
tokens generated per turn, greedy (temperature 0), streamed. First every session's first turn
runs (its whole prompt computed, its KV stored: not timed — a long agent session pays it once,
and here with 3–5 turns it would otherwise weigh a third of the run); then the later turns are
timed, every session at once: the JCT is the time until the last session's last turn ends.
The first turns run once through dualpath (unshaped) and the storage they leave is kept as a
snapshot; every KV mode starts its timed turns from that snapshot.

Modes, one after another on the same instances (between steps the scheduler and the gateways
restart on the step's config while the storage is emptied, copied or restored:
``Launcher.reconfigure``):

* ``recompute`` — the front's ``kv_loading: false``: each turn, first turns included, on the
  prefill instance alone, every prompt token computed (the outputs every other mode is
  compared with);
* ``oracle`` — scheduler policy ``dualpath``, storage links unshaped (the disk's speed): the
  bound where reading storage costs next to nothing;
* ``basic`` — policy ``basic`` (every hit read by the prefill node, the paper's baseline),
  links shaped to ``R``;
* ``dualpath`` — policy ``dualpath`` (each hit read on the side the scheduler picks), links
  shaped to ``R``;
* ``dualpath-split`` (with ``--split-reads``) — ``dualpath`` with ``[scheduler] split_reads``:
  a hit may be read on the PE's and the DE's link at once (docs/datapath.md "Split reads"),
  links shaped to the same ``R``; reported as ``split_vs_oracle`` and
  ``split_speedup_vs_dualpath`` beside the headline;
* ``dualpath-variant`` (with ``--variant SECTION.KEY=VALUE``, repeatable; ``[gateway]`` and
  ``[scheduler]`` settings, the services restarted between modes) — ``dualpath`` with those
  settings, links shaped to the same ``R``: an A/B of one setting in one run, where two runs
  of this bench differ by as much as the effect (the oracle's drift below). Run A B B A:
  ``dualpath``, ``dualpath-variant``, ``dualpath-variant-repeat``, ``dualpath-repeat``
  (:func:`variant_figures`); reported as ``variant_vs_oracle`` (the first variant run),
  ``variant_speedup_vs_dualpath`` (mean JCT of the ``dualpath`` runs ÷ the variant's) and
  ``variant_pairs``;
* ``oracle-repeat`` — the oracle once more, last: on a small shared host the oracle's JCT
  drifts between runs of one config (±10 %, and 15.7–21.6 s in four ``--quick`` runs of
  2026-12-06: docs/vllm.md), as much as the gap it bounds, so the bound is measured at both
  ends of the run and its mean is what ``dualpath_vs_oracle`` divides by (both JCTs and
  their spread in the JSON). ``--quick`` too since 2026-12-06 (about 30 s more).

``R`` (per node, every link the same): half the rate at which the oracle run consumed hit
bytes (its later turns' hit bytes ÷ its JCT), unless ``--link-mb-s`` sets it — so one storage
link (basic's) carries half of what the engines can consume, the three links of 1P2D together
one and a half times: storage binds the basic mode and not the dual path, the situation the
paper measures.

**The PE's β is profiled** on this engine, as the paper sets it (§6.4: the tokens one GPU
processes in 5 s): the recompute mode's first turns are cold prompts prefilled on the prefill
instance alone, so their load in the scheduler's unit over the time they took is the PE's
rate, given to every KV mode as ``[scheduler] pe_tokens_per_s`` (:func:`profile_pe`; JSON
``pe_profile``). Derived from the KV preset's cost model instead, β is ~2 s of this CPU
engine's work (3,332 units against 8,208–9,090 profiled in five runs), so the PE admitted two or three
turns at a time and each read began only as the turn before it was nearly done.
``--derived-beta`` keeps the derived β; a ``pe_tokens_per_s`` or ``beta_tokens`` given with
``--scheduler-set`` wins over the profile. The PE receiver's and the DE loaders' buffers are
512 MiB for the run (``--set pe_receiver.buffer_bytes=…`` / ``de_loader.buffer_bytes=…``
override them): the prompts of the turns β admits, where the config's 192 MiB holds about
three (the paper's buffers are host DRAM). The scheduler admits by both (docs/datapath.md
"Buffer admission in the scheduler"), so a smaller buffer, not β, would bound the turns in
flight: with the config's 192 MiB decode buffers a full run's dualpath took 49.9 s, with
512 MiB 36.5 s (docs/vllm.md "Decode buffers").

**16 sessions by default** (the issue asks K ≥ 8). The sessions run in lock step, so each
timed wave starts with every hit to read and nothing to compute: a turn's prefill starts only
once its whole hit has crossed one link at ``R``, while the oracle starts at once. Under the
rule for ``R`` (below) with K equal sessions that head costs at least 2/K of the oracle's
JCT (a hit of h bytes at R = K·h / (2·wave time) takes 2/K of a wave), so dualpath ÷ oracle
≥ 1 + 2/K: 1.25 at K = 8, above the goal of 1.15 for any whole-hit read, 1.125 at K = 16. The
paper's offline runs have 1,024–4,096 agents, where the head vanishes (docs/vllm.md "The
head of each wave").

**Storage links full duplex** (``[gateway] link_duplex = "full"``, the services' default since
2026-12-07, docs/storage.md): each node's link carries its reads and its write-backs in
separate directions at ``R`` each, as a real SNIC does and as the simulator models it; the
read-side rule then counts no write bytes (``[scheduler] write_weight = 0``). Until
2026-12-07 the bench shared one bucket between both directions: a decode node's write-backs
then queued behind the reads placed on its link, and each session's next turn waited for them
(0.36 s per turn in a ``--quick`` run against 0.04 s in the oracle; docs/vllm.md).
``--set gateway.link_duplex='"half"'`` runs the old emulation, with ``write_weight = 1`` and
``read_order = "shared"`` unless given. With full-duplex links each link serves its reads **in
their arrival order** (``[gateway] read_order = "arrival"``; ``"shared"`` interleaves the
reads admitted together, so they end together and reach the prefill instance as a burst): the
earliest hit is whole after one hit's read and its prefill starts while the next is read.
Measured A B B A with ``--variant`` (2026-12-07): the dualpath JCT 7 % (``--quick``) and 21 %
(full run) shorter, each pair of both runs the same way (docs/vllm.md "Reads in their arrival
order"). ``--set gateway.read_order='"shared"'`` runs the order of before.

``--keep-logs DIR`` copies every service's log there when the run ends.

``--scheduler-set KEY=VALUE`` (repeatable) adds a ``[scheduler]`` setting to every mode's
config (e.g. ``beta_s=20``), checked before the cluster starts; ``--set SECTION.KEY=VALUE``
(repeatable) any other setting of the cluster file for the whole run (e.g.
``pe_receiver.buffer_bytes=536870912``).

Headline ``engine_agents_speedup`` = JCT(basic) ÷ JCT(dualpath), goal ≥ 1.5; also
``dualpath_vs_oracle`` = JCT(dualpath) ÷ the mean JCT of ``oracle`` and ``oracle-repeat``,
goal ≤ 1.15. Per mode, over the timed
turns: JCT, TTFT p50/p99 from the request's arrival at the front (the front's own clock) and
from the client's send, the scheduler's split of TTFT (``ttft_parts_ms``: the mean Sch./A./
R./PF. of paper §7, submit to the PE's first-token report — where a mode's wait is), decode
step-gap p99 (client side), the wait from the last token to the stream's end
(``outcome_wait_ms``: the front holds the close until the scheduler's outcome, which comes
once the turn's write-back is durable, so it is on each session's path to its next turn),
hit share, read sides; over all
turns: requests failed, and whether every output equals ``recompute``'s; the first turns'
time. ``--quick``: 16 sessions x 3 turns; the default 16 x 5. Measured 2026-12-07: 7.5 min
and 9.6-9.7 min here, of which about 1 min the cluster's start (three vLLM servers on two
cores) and 1.4 min the first turns, twice (recompute's, then dualpath's, which also writes
every session's context back); issue #24 asked ``--quick`` to stay under ~6 min.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engine_agents_settings import (cluster_settings, run_defaults, scheduler_settings,
                                          storage_links, variant_settings)
from bench.report import bench_parser, headline, print_table, write_results

GOAL = 1.5
ORACLE_GOAL = 1.15
CONFIG = "configs/vllm-1p2d.toml"
GEN = 16
MAX_CONTEXT = 2048                  # the instances' --max-model-len
MIN_FIRST = 256                     # a first prompt of at least 4 of our 64-token blocks
SESSIONS = 16                       # sessions at once by default (module docstring: why 16)
TOKEN_LO, TOKEN_HI = 1000, 49000    # ordinary tokens of SmolLM2's 49,152 (no special ids)
# mode -> (scheduler mode of the cluster config, storage links shaped?, kv_loading)
MODES: dict[str, tuple[str, bool, bool]] = {
    "recompute": ("dualpath", False, False),
    "oracle": ("dualpath", False, True),
    "basic": ("basic", True, True),
    "dualpath": ("dualpath", True, True),
    "dualpath-split": ("dualpath", True, True),     # --split-reads: [scheduler] split_reads
    "dualpath-variant": ("dualpath", True, True),   # --variant: dualpath with other settings
    "dualpath-variant-repeat": ("dualpath", True, True),    # --variant: A B B A
    "dualpath-repeat": ("dualpath", True, True),            # --variant: A B B A
    "oracle-repeat": ("dualpath", False, True),     # the oracle again, last (the host's drift)
}


@dataclass
class Session:
    """One conversation of the trace: its id and each turn's prompt token ids."""

    sid: str
    prompts: list[list[int]]


def token_of(scope: str, hash_id: int) -> int:
    """The token standing for trace block ``hash_id`` of conversation ``scope``."""
    digest = hashlib.blake2b(f"{scope}:{hash_id}".encode(), digest_size=8).digest()
    return TOKEN_LO + int.from_bytes(digest, "little") % (TOKEN_HI - TOKEN_LO)


def sessions_from_trace(trace: Path, count: int, turns: int) -> list[Session]:
    """The first ``count`` conversations (by file name) whose first ``turns`` turns fit the
    context at one token per trace block (module docstring); ValueError if too few do."""
    from sim.recorded import load_workload

    out = []
    for s in sorted(load_workload(trace).sessions, key=lambda s: s.sid):
        prompts = [[token_of(s.scope, h) for h in t.hash_ids] for t in s.turns[:turns]]
        if (len(prompts) == turns and len(prompts[0]) >= MIN_FIRST
                and max(map(len, prompts)) + GEN <= MAX_CONTEXT):
            out.append(Session(s.sid, prompts))
        if len(out) == count:
            return out
    raise ValueError(f"{trace}: only {len(out)} conversations have {turns} turns that fit "
                     f"{MAX_CONTEXT} tokens at one token per trace block (need {count})")


async def run_turns(front_url: str, sessions: list[Session], mode: str, kv_loading: bool,
                    first: bool) -> dict[str, Any]:
    """Every session at once: its first turn (``first``), or its later turns one after
    another; the turns as the client saw them and the time until the last one ended."""
    from tools.stream_client import Streams

    turns: list[dict[str, Any]] = []
    with Streams(len(sessions)) as streams:
        async def session(s: Session) -> None:
            for k in range(1) if first else range(1, len(s.prompts)):
                prompt = s.prompts[k]
                body = {"model": "smollm2", "prompt": prompt, "max_tokens": GEN,
                        "temperature": 0.0, "session_id": f"{mode}-{s.sid}",
                        "kv_loading": kv_loading}
                row: dict[str, Any] = {"session": s.sid, "turn": k, "prompt": len(prompt)}
                try:
                    row["got"] = await streams.complete(front_url, body)
                except Exception as e:  # noqa: BLE001 -- a failed turn is counted, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"
                turns.append(row)

        start = time.monotonic()
        await asyncio.gather(*(session(s) for s in sessions))
    return {"turns": turns, "elapsed_s": time.monotonic() - start}


GATEWAY_KEYS = ("bytes_read", "bytes_written", "link_bytes_charged", "link_wait_s",
                "link_write_wait_s", "read_requests_admitted")   # write: full-duplex links only


async def gateway_counters(state: Any, rpc: Any) -> dict[str, dict[str, float]]:
    """Each node's gateway counters (``GetStats``): how much its storage link carried, how
    long transfers waited for it — which link bound a mode."""
    from common.errors import DualpathError
    from common.protocol import ErrorReply, GetStats, GetStatsReply
    from common.rpc import RpcClient

    out: dict[str, dict[str, float]] = {}
    for p in state.procs:
        if p.service != "gateway":
            continue
        client = RpcClient(rpc, p.host, int(p.rpc_port), role="monitor", node_id="bench",
                           reply_type=GetStatsReply | ErrorReply)
        try:
            reply = await client.call(GetStats(), timeout=5.0)
            counters = dict(getattr(reply, "counters", {}))
            out[p.node] = {k: round(float(counters.get(k, 0.0)), 3) for k in GATEWAY_KEYS}
        except (DualpathError, OSError) as e:
            out[p.node] = {"error": str(e)}  # type: ignore[dict-item]
        finally:
            await client.close()
    return out


PARTS = ("sched", "alloc", "read", "prefill", "total")    # the front's ``ttft_parts_s``


def mean_ms(seconds: list[float]) -> float:
    return round(1e3 * sum(seconds) / len(seconds), 1)


def figures(mode: str, run: dict[str, Any], reference: dict[tuple[str, int], list[int]]
            ) -> dict[str, Any]:
    """One mode's row of the results (module docstring)."""
    from tools.stream_client import pcts, timeline

    ok = [t for t in run["turns"] if "got" in t]
    later = [t for t in ok if t["turn"] > 0]
    hit = sum(t["got"].dualpath.get("hit_tokens", 0) for t in later)
    sides: dict[str, int] = {}
    for t in ok:
        side = t["got"].dualpath.get("read_side", "?")
        sides[side] = sides.get(side, 0) + 1
    timed = [t["got"] for t in later]         # what the JCT times: the later turns
    seen = timeline(timed)
    front_ttft = [t.dualpath["ttft_s"] for t in timed if t.dualpath.get("ttft_s") is not None]
    parts = [t.dualpath["ttft_parts_s"] for t in timed if t.dualpath.get("ttft_parts_s")]
    # the last token to the stream's end: the front waits for the outcome, which comes once
    # the turn's write-back is durable — on the session's path to its next turn
    outcome_wait = [t.done_at - t.arrivals[-1] for t in timed if t.arrivals]
    equal = all(reference.get((t["session"], t["turn"])) == t["got"].tokens for t in ok)
    return {"mode": mode, "jct_s": round(run["jct_s"], 2),
            "first_turns_s": round(run["first_turns_s"], 2), "requests": len(run["turns"]),
            "failed": len(run["turns"]) - len(ok),
            "errors": [t["error"] for t in run["turns"] if "error" in t][:5],
            "ttft_from_arrival_ms": pcts(front_ttft), "ttft_client_ms": seen["ttft_ms"],
            "ttft_parts_ms": ({k: mean_ms([p[k] for p in parts]) for k in PARTS} if parts
                              else {}) | {"n": len(parts)},
            "step_gap_ms": seen["step_gap_ms"], "max_in_flight": seen["max_in_flight"],
            "outcome_wait_ms": pcts(outcome_wait) | ({"mean": mean_ms(outcome_wait)}
                                                     if outcome_wait else {}),
            "hit_share_from_turn_2": round(hit / max(1, sum(t["prompt"] for t in later)), 3),
            "hit_tokens": hit, "read_sides": sides,
            "outputs_equal": bool(ok) and len(ok) == len(run["turns"]) and equal}


def profile_pe(sessions: list[Session], first_turns_s: float,
               scheduler: dict[str, Any], model: str) -> dict[str, Any]:
    """β profiled on this engine, as the paper sets it (§6.4: the tokens one GPU processes in
    5 s): the recompute mode's first turns are cold prompts prefilled on the prefill instance
    alone, so their load in the scheduler's unit (``pe_load``: reference-shape tokens by
    default) over the time they took is the PE's rate, ``[scheduler] pe_tokens_per_s``. The
    time includes their 16 generated tokens, so the rate errs low (β smaller, not larger)."""
    import msgspec

    from services.scheduler.core.config import SchedulerConfig

    cfg = msgspec.convert({"model": model} | scheduler, SchedulerConfig)
    load = cfg.pe_load_counter()
    units = sum(load(0, len(s.prompts[0])) for s in sessions)
    rate = units / first_turns_s
    derived = msgspec.structs.replace(cfg, pe_tokens_per_s=None, beta_tokens=None).resolved_beta()
    return {"load_units": units, "first_turns_s": round(first_turns_s, 2),
            "pe_tokens_per_s": round(rate, 1), "beta": int(rate * cfg.beta_s),
            "beta_derived_from_cost_model": derived, "pe_load": cfg.pe_load}


async def bench(sessions: list[Session], root: Path, link_mb_s: float | None,
                echo: Any, reads: int | None = None, split: bool = False,
                scheduler: dict[str, Any] | None = None,
                settings: dict[str, dict[str, Any]] | None = None,
                profile_beta: bool = True, keep_logs: Path | None = None,
                variant: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    from common.kv import spec_from_config
    from tools.cluster.launcher import Launcher
    from tools.cluster.real_engines import on_loopback

    fixed = {section: dict(values) for section, values in (settings or {}).items()}
    if reads:
        fixed.setdefault("gateway", {})["max_concurrent_reads"] = reads

    profiled: dict[str, Any] = {}       # [scheduler] pe_tokens_per_s once profiled
    pe_profile: dict[str, Any] | None = None

    def config(sched_mode: str, rate: float, mode: str = ""):
        """The cluster file of a step; ``mode`` adds ``dualpath-split``'s or
        ``dualpath-variant``'s own settings."""
        extra = (variant or {}) if mode.startswith("dualpath-variant") else {}
        sched = (profiled | dict(scheduler or {})
                 | ({"split_reads": True} if mode == "dualpath-split" else {})
                 | extra.get("scheduler", {}))
        sections = fixed | {section: fixed.get(section, {}) | values
                            for section, values in extra.items() if section != "scheduler"}
        sections |= {"scheduler": sched} if sched else {}
        return on_loopback(CONFIG, root, mode=sched_mode, sections=sections or None,
                           storage_link_bytes_per_s=rate, vllm_prefix_caching=False)

    launcher = Launcher(config("dualpath", 0.0), echo=echo)
    storage = launcher.cluster.spec.storage_dir().resolve()
    kv = spec_from_config(launcher.cluster.cfg.kv)
    bytes_per_token = kv.full_block_bytes / kv.block_tokens

    def empty_storage() -> None:
        for child in storage.iterdir():
            (shutil.rmtree if child.is_dir() else Path.unlink)(child)

    def restore(snapshot: Path) -> None:
        empty_storage()
        shutil.copytree(snapshot, storage, dirs_exist_ok=True)

    rows: dict[str, dict[str, Any]] = {}
    reference: dict[tuple[str, int], list[int]] = {}
    rate = 0.0
    t_up = time.monotonic()
    state = await asyncio.to_thread(launcher.up)
    up_s = time.monotonic() - t_up
    try:
        front_url = str(state.proc("front").url)
        restart = ["scheduler", *(f"gateway:{n.id}" for n in launcher.cluster.spec.nodes)]

        async def timed(mode: str, first: dict[str, Any]) -> None:
            """``mode``'s later turns; its row counts ``first`` (the first turns) with them."""
            _, shaped, kv_loading = MODES[mode]
            echo(f"mode {mode}: {len(sessions)} sessions, turns 2-{len(sessions[0].prompts)}"
                 + (f", storage links {rate / 1e6:.1f} MB/s" if shaped else ""))
            later = await run_turns(front_url, sessions, mode, kv_loading, first=False)
            run = {"turns": first["turns"] + later["turns"], "jct_s": later["elapsed_s"],
                   "first_turns_s": first["elapsed_s"]}
            if mode == "recompute":
                reference.update({(t["session"], t["turn"]): t["got"].tokens
                                  for t in run["turns"] if "got" in t})
            rows[mode] = figures(mode, run, reference)
            rows[mode]["gateways"] = await gateway_counters(launcher.state,
                                                            launcher.cluster.cfg.rpc)
            echo(f"  JCT {rows[mode]['jct_s']:.1f} s, failed {rows[mode]['failed']}, "
                 f"outputs equal {rows[mode]['outputs_equal']}")

        # recompute: both phases on the prefill instance alone (the reference outputs)
        echo(f"mode recompute: first turns of {len(sessions)} sessions")
        await timed("recompute", await run_turns(front_url, sessions, "recompute", False,
                                                 first=True))
        # β of every KV mode: profiled from those cold first turns, unless given outright
        if profile_beta and not {"pe_tokens_per_s", "beta_tokens"} & set(scheduler or {}):
            pe_profile = profile_pe(sessions, rows["recompute"]["first_turns_s"],
                                    scheduler or {}, kv.name)
            profiled["pe_tokens_per_s"] = pe_profile["pe_tokens_per_s"]
            echo(f"PE profiled: {pe_profile['pe_tokens_per_s']:.0f} load units/s -> beta "
                 f"{pe_profile['beta']} (derived from the cost model: "
                 f"{pe_profile['beta_derived_from_cost_model']})")
        # every session's first turn through dualpath, unshaped: the stored contexts every
        # KV mode starts from (a snapshot of the storage, restored before each)
        await asyncio.to_thread(launcher.reconfigure, config("dualpath", 0.0), restart,
                                empty_storage)
        echo(f"first turns through dualpath: {len(sessions)} sessions")
        first = await run_turns(front_url, sessions, "first", True, first=True)
        snapshot = root / "snapshot"
        await asyncio.to_thread(launcher.reconfigure, config("dualpath", 0.0), restart,
                                lambda: shutil.copytree(storage, snapshot))
        await timed("oracle", first)
        oracle = rows["oracle"]
        demand = oracle["hit_tokens"] * bytes_per_token / oracle["jct_s"]
        rate = link_mb_s * 1e6 if link_mb_s else demand / 2
        # oracle-repeat last, after the shaped modes: the bound measured at both ends of the
        # run, so the host's drift over these minutes shows in the bound itself
        abba = ("dualpath-variant", "dualpath-variant-repeat", "dualpath-repeat")
        for mode in ("basic", "dualpath", *(("dualpath-split",) if split else ()),
                     *(abba if variant else ()), "oracle-repeat"):
            sched_mode, shaped, _ = MODES[mode]
            await asyncio.to_thread(launcher.reconfigure,
                                    config(sched_mode, rate if shaped else 0.0, mode),
                                    restart, lambda: restore(snapshot))
            await timed(mode, first)
    finally:
        await asyncio.to_thread(launcher.down)
        if keep_logs is not None:       # every service's log, each mode's run after a header
            shutil.copytree(launcher.log_dir, keep_logs, dirs_exist_ok=True)
    return {"modes": rows, "link_rate_mb_s": round(rate / 1e6, 1), "cluster_up_s": round(up_s, 1),
            "link_rate_rule": "--link-mb-s" if link_mb_s else "oracle hit bytes / JCT / 2",
            "storage_links": storage_links(config("dualpath", rate).cfg),
            "pe_profile": pe_profile}


def versus_oracle(modes: dict[str, dict[str, Any]], mode: str) -> dict[str, Any]:
    """``mode``'s JCT ÷ the oracle's: the mean of ``oracle`` and ``oracle-repeat`` (where it
    ran), with both JCTs and their spread (range ÷ mean)."""
    runs = [modes[m]["jct_s"] for m in ("oracle", "oracle-repeat") if m in modes]
    mean = sum(runs) / len(runs)
    value = modes[mode]["jct_s"] / mean
    return {"value": value, "goal": ORACLE_GOAL, "met": value <= ORACLE_GOAL,
            "oracle_jct_s": runs, "oracle_spread": (max(runs) - min(runs)) / mean}


def variant_figures(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``--variant``'s A/B, run A B B A (``dualpath``, the variant twice, ``dualpath`` again):
    the mean JCT of both ``dualpath`` runs ÷ the mean of both variant runs, and each pair's
    ratio. Why A B B A: in three runs with the variant right after ``dualpath`` the mode run
    second won each time, either way round (docs/vllm.md "Reads in their arrival order"); a
    drift of the host over the run cancels in the means."""
    a = [modes[m]["jct_s"] for m in ("dualpath", "dualpath-repeat")]
    b = [modes[m]["jct_s"] for m in ("dualpath-variant", "dualpath-variant-repeat")]
    return {"variant_vs_oracle": versus_oracle(modes, "dualpath-variant")["value"],
            "variant_speedup_vs_dualpath": sum(a) / sum(b),
            "variant_pairs": [a[0] / b[0], a[1] / b[1]]}


def main(argv: list[str] | None = None) -> int:
    from sim.recorded import shared_agentic_dir
    from tools.vllm_engines import model_dir

    p = bench_parser("engine_agents", __doc__.splitlines()[0], quick_takes="about 7.5 min")
    p.add_argument("--trace", type=Path, default=None,
                   help="agentic trace directory (default ../shared/traces/agentic)")
    p.add_argument("--sessions", type=int, default=SESSIONS,
                   help=f"sessions at once (>= 1; default {SESSIONS})")
    p.add_argument("--turns", type=int, default=None, help="turns per session (quick 3, else 5)")
    p.add_argument("--link-mb-s", type=float, default=None,
                   help="storage link rate per node, MB/s (default: half the oracle's demand)")
    p.add_argument("--split-reads", action="store_true",
                   help="also run mode dualpath-split ([scheduler] split_reads = true)")
    p.add_argument("--variant", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="also run mode dualpath-variant: dualpath with this [gateway] or "
                        "[scheduler] setting (TOML value; repeatable), e.g. "
                        "'gateway.read_order=\"shared\"'")
    p.add_argument("--scheduler-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a [scheduler] setting for every mode (TOML value; repeatable), e.g. "
                        "beta_s=20")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   dest="settings", help="a cluster-file setting for the whole run (TOML value; "
                   "repeatable), e.g. pe_receiver.buffer_bytes=536870912")
    p.add_argument("--gateway-reads", type=int, default=None,
                   help="read requests each gateway serves at once ([gateway] "
                        "max_concurrent_reads; default: the config's)")
    p.add_argument("--derived-beta", action="store_true",
                   help="keep beta derived from the KV preset's cost model instead of "
                        "profiling this engine (the A/B of the profile)")
    p.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                   help="copy every service's log here when the run ends")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        scheduler = scheduler_settings(args.scheduler_set)
    except ValueError as e:
        p.error(f"--scheduler-set: {e}")
    try:
        settings = cluster_settings(args.settings)
    except ValueError as e:
        p.error(f"--set: {e}")
    try:
        variant = variant_settings(args.variant)
    except ValueError as e:
        p.error(f"--variant: {e}")
    run_defaults(settings, scheduler)
    turns = args.turns or (3 if args.quick else 5)
    trace = args.trace or shared_agentic_dir()
    if model_dir() is None:
        print("bench engine_agents needs the vLLM venv and the model: make vllm-env vllm-model",
              file=sys.stderr)
        return 2
    if not trace.is_dir():
        print(f"bench engine_agents: no trace directory at {trace} (--trace DIR)",
              file=sys.stderr)
        return 2
    if args.sessions < 1 or turns < 2 or (args.link_mb_s is not None and args.link_mb_s <= 0) \
            or (args.gateway_reads is not None and args.gateway_reads < 1):
        p.error("--sessions >= 1, --turns >= 2 (a hit needs an earlier turn), --link-mb-s > 0, "
                "--gateway-reads >= 1")
    try:
        sessions = sessions_from_trace(trace, args.sessions, turns)
    except ValueError as e:
        print(f"bench engine_agents: {e}", file=sys.stderr)
        return 2
    from common.logging import configure_logging

    configure_logging("warning", None)
    # SIGTERM as Ctrl-C: the cluster's processes are stopped on the way out (``bench``'s finally)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="dualpath-bench-engine-agents-") as tmp:
        res = asyncio.run(bench(sessions, Path(tmp), args.link_mb_s,
                                lambda m: print(m, flush=True), args.gateway_reads,
                                args.split_reads, scheduler, settings,
                                not args.derived_beta, args.keep_logs, variant))
    res["scheduler_settings"] = scheduler
    res["cluster_settings"] = settings
    res["variant_settings"] = variant
    res["workload"] = {"trace": str(trace), "sessions": [s.sid for s in sessions],
                       "turns": turns, "gen_tokens": GEN, "token_scale": "1 token per 64-token "
                       "trace block", "prompt_tokens": [list(map(len, s.prompts))
                                                        for s in sessions]}
    modes = res["modes"]
    print_table([{k: v for k, v in r.items() if not isinstance(v, (dict, list))}
                 | {"ttft_p50_ms": r["ttft_from_arrival_ms"].get("p50"),
                    "ttft_p99_ms": r["ttft_from_arrival_ms"].get("p99"),
                    "gap_p99_ms": r["step_gap_ms"].get("p99"), "sides": r["read_sides"],
                    "end_wait_ms": r["outcome_wait_ms"].get("mean")}
                 for r in modes.values()],
                ["mode", "jct_s", "requests", "failed", "ttft_p50_ms", "ttft_p99_ms",
                 "gap_p99_ms", "end_wait_ms", "hit_share_from_turn_2", "sides",
                 "outputs_equal"])
    print("TTFT split by the scheduler (mean ms over the timed turns: Sch./A./R./PF.):")
    print_table([{"mode": r["mode"], **r["ttft_parts_ms"]} for r in modes.values()],
                ["mode", *PARTS, "n"])
    speedup = modes["basic"]["jct_s"] / modes["dualpath"]["jct_s"]
    res["dualpath_vs_oracle"] = vs = versus_oracle(modes, "dualpath")
    vs_oracle, oracle_runs = vs["value"], vs["oracle_jct_s"]
    if "dualpath-split" in modes:
        res["split_vs_oracle"] = versus_oracle(modes, "dualpath-split")["value"]
        res["split_speedup_vs_dualpath"] = (modes["dualpath"]["jct_s"]
                                            / modes["dualpath-split"]["jct_s"])
        print(f"split reads: JCT / oracle JCT = {res['split_vs_oracle']:.2f}, dualpath JCT / "
              f"split JCT = {res['split_speedup_vs_dualpath']:.2f}")
    if "dualpath-variant" in modes:
        res |= variant_figures(modes)
        print(f"variant {args.variant}: JCT / oracle JCT = {res['variant_vs_oracle']:.2f}; "
              f"dualpath JCT / variant JCT = {res['variant_speedup_vs_dualpath']:.2f} over "
              f"A B B A (pairs {', '.join(f'{x:.2f}' for x in res['variant_pairs'])})")
    res["all_checks_passed"] = all(r["outputs_equal"] and not r["failed"]
                                   for r in modes.values())
    links = res["storage_links"]
    print(f"storage links {res['link_rate_mb_s']} MB/s per node ({res['link_rate_rule']}; "
          f"{links['link_duplex']} duplex, reads in {links['read_order']} order, write_weight "
          f"{links['write_weight']:g}); "
          f"dualpath JCT / oracle JCT = {vs_oracle:.2f} (goal <= {ORACLE_GOAL}; oracle "
          f"{' and '.join(f'{j:.1f}' for j in oracle_runs)} s); every output "
          f"equal to recompute and no request failed: {res['all_checks_passed']}")
    write_results(args.out, "engine_agents", headline("engine_agents_speedup", speedup, GOAL),
                  res)
    return 0 if res["all_checks_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
