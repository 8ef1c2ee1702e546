"""``dualpath demo --engine vllm`` (``make demo-vllm``): real vLLM behind dualpath, in minutes.

``dualpath cluster up`` of a real-engine cluster file (``--config``, default
``configs/vllm-1p1d.toml``, its fixed ports made free ones and its state in a temporary
directory): storage gateways on a directory, a PE receiver, a DE loader and the scheduler
(policy ``dualpath``: it picks the read side), a vLLM prefill instance (DualPathConnector,
kv_producer) and a decode instance (kv_consumer) as vLLM OpenAI servers on SmolLM2-135M (float32,
docs/vllm.md), and the OpenAI front — every one its own process — then a few agents'
multi-turn conversations through the front. Every turn runs twice on the same prompt: through
dualpath (the previous turns' KV loaded from storage by the side the scheduler chose) and with
``kv_loading: false`` (the same front sends it to the prefill instance without dualpath: vLLM
recomputes the prompt). Prints per turn the hit rate, read side, both TTFTs and whether the
greedy outputs are equal; exits 1 if any output differs. Stops every process it started.
Needs ``make vllm-env vllm-model`` (``make demo-vllm`` runs them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.vllm_serve import ahttp, tokenize

GEN = 16
APPEND = 40


def agent_text(agent: int) -> str:
    """A coding agent's tool output, different per agent (so agents share no prefix)."""
    return " ".join(f"Agent {agent} step {i}: read_file('src/app_{agent}/mod_{i}.py') returned "
                    f"{(i * 13 + agent) % 400} lines; parse_{i} calls helper_{(i + agent) % 7}."
                    for i in range(120))


async def demo(agents: int, turns: int, first: int, out: Path, config: str) -> int:
    from tools.cluster.launcher import Launcher
    from tools.cluster.real_engines import on_loopback
    from tools.tables import print_table
    from tools.vllm_engines import model_dir

    model = model_dir()
    if model is None:
        print("dualpath demo --engine vllm: the vLLM venv or the model is missing; run "
              "`make vllm-env vllm-model` (3.9 GB, ~5 min once) or `make demo-vllm`",
              file=sys.stderr)
        return 2
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dualpath-demo-vllm-") as tmp_s:
        launcher = Launcher(on_loopback(config, Path(tmp_s)), echo=print)
        print(f"dualpath cluster up -c {config} (free ports, state in {tmp_s}); the vLLM "
              f"instances load {model.name} ...", flush=True)
        try:
            state = await asyncio.to_thread(launcher.up)
            front_url = str(state.proc("front").url)
            prefill = next(str(p.url) for p in state.procs if p.service == "vllm"
                           and launcher.cluster.spec.node(p.node).role == "prefill")
            print(f"front at {front_url}; {agents} agents x {turns} turns", flush=True)
            texts = [await tokenize(prefill, str(model), agent_text(a)) for a in range(agents)]
            rows = await _conversations(front_url, texts, turns, first)
        finally:
            procs = {p.name: p for p in launcher.state.procs} if launcher.state else {}
            await asyncio.to_thread(launcher.down)
        left = [s for p in procs.values() for s in p.left_files if Path(s).exists()]
        if launcher.removed_files:
            print(f"removed {len(launcher.removed_files)} file(s) the vLLM instances left "
                  "(/dev/shm queues, IPC sockets)", flush=True)
    cols = ["turn", "agent", "prompt", "hit", "read side", "TTFT dualpath s",
            "TTFT recompute s", "ratio", "equal"]
    table = [dict(zip(cols, [r["turn"], r["agent"], r["prompt"],
                             f"{100 * r['hit'] / r['prompt']:.0f}%", r["side"],
                             f"{r['ttft_dp']:.3f}", f"{r['ttft_rc']:.3f}",
                             f"{r['ttft_dp'] / r['ttft_rc']:.2f}",
                             "yes" if r["equal"] else "NO"])) for r in rows]
    print_table(table, cols)
    later = [r for r in rows if r["turn"] > 0]
    summary = {"agents": agents, "turns": turns, "requests": len(rows),
               "all_equal": all(r["equal"] for r in rows),
               "hit_rate_from_turn_2": sum(r["hit"] for r in later) / max(1, sum(r["prompt"] for r in later)),
               "read_sides": {s: sum(r["side"] == s for r in later) for s in ("pe", "de")},
               "ttft_ratio_median_from_turn_2": statistics.median(
                   r["ttft_dp"] / r["ttft_rc"] for r in later) if later else None,
               "processes": {name: p.pid for name, p in procs.items()},
               "files_of_instances": sorted({s for p in procs.values() for s in p.left_files}),
               "files_left_after_stop": left,
               "wall_s": time.monotonic() - t_start}
    print(f"\nfrom turn 2: hit rate {summary['hit_rate_from_turn_2']:.1%}, read sides "
          f"{summary['read_sides']}, median TTFT dualpath/recompute "
          f"{summary['ttft_ratio_median_from_turn_2']:.2f}; outputs equal: "
          f"{summary['all_equal']}; {summary['wall_s']:.0f} s")
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo-vllm.json").write_text(json.dumps({"summary": summary, "turns": rows}, indent=1))
    print(f"results: {out / 'demo-vllm.json'}")
    return 0 if summary["all_equal"] else 1


async def _conversations(front_url: str, texts: list[list[int]], turns: int,
                         first: int) -> list[dict[str, Any]]:
    """Each turn: every agent once through dualpath, then the same prompt recomputed."""
    prompts = [t[:first] for t in texts]
    cursors = [first] * len(texts)
    rows = []
    for turn in range(turns):
        for a, prompt in enumerate(prompts):
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": GEN,
                    "session_id": f"agent-{a}"}
            dp = await _complete(front_url, body)
            rc = await _complete(front_url, {**body, "kv_loading": False})
            rows.append({"turn": turn, "agent": a, "prompt": len(prompt),
                         "hit": dp["hit_tokens"], "side": dp["read_side"],
                         "ttft_dp": dp["ttft_s"], "ttft_rc": rc["ttft_s"],
                         "equal": dp["token_ids"] == rc["token_ids"]})
            print(f"  turn {turn} agent {a}: {len(prompt)} tokens, hit {dp['hit_tokens']}, "
                  f"{dp['read_side']}, TTFT {dp['ttft_s']:.3f} s vs {rc['ttft_s']:.3f} s",
                  flush=True)
            prompts[a] = prompt + dp["token_ids"] + texts[a][cursors[a]:cursors[a] + APPEND]
            cursors[a] += APPEND
    return rows


async def _complete(front_url: str, body: dict) -> dict[str, Any]:
    status, raw = await ahttp("POST", f"{front_url}/v1/completions", body, 900)
    if status != 200:
        raise RuntimeError(f"front answered {status}: {raw[:300]!r}")
    return dict(json.loads(raw)["dualpath"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dualpath demo --engine vllm",
                                description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-tokens", type=int, default=1000,
                   help="tokens of each agent's first prompt (max model length 2,048)")
    p.add_argument("--out", default="results/demo", help="demo-vllm.json goes here")
    p.add_argument("--config", default="configs/vllm-1p1d.toml",
                   help="a real-engine cluster file ([cluster] engine = \"vllm\")")
    a = p.parse_args(argv)
    if not (1 <= a.agents <= 8 and 1 <= a.turns <= 12 and 64 < a.first_tokens <= 1400):
        p.error("--agents 1..8, --turns 1..12, --first-tokens 65..1400 (the context stays "
                "under the instances' 2,048-token limit)")
    from common.logging import configure_logging

    configure_logging("warning", None)
    return asyncio.run(demo(a.agents, a.turns, a.first_tokens, Path(a.out), a.config))
