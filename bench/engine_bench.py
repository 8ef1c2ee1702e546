"""``dualpath bench engine``: a real later turn's TTFT through the front on 1P1D real vLLM —
dualpath loading the hit vs recomputing it vs vLLM's ExampleConnector.

One ``dualpath cluster up`` of ``configs/vllm-1p1d.toml`` (free ports, temporary storage):
gateways, PE receiver, DE loader, scheduler (policy ``dualpath``), a prefill and a decode vLLM
OpenAI server (SmolLM2-135M fp32, the DualPathConnector) and the front, each its own process;
the instances at ``--max-model-len 4608`` (``[cluster] vllm_max_model_len``) **without their
own prefix cache** (``vllm_prefix_caching = false``: every hit comes from dualpath's storage,
the paper's premise that an agent's context does not stay in HBM between turns — with vLLM's
cache on, the timed turn would hit the prefill instance's own HBM and nothing would be
loaded). Beside it, the bench starts the peer: a plain vLLM OpenAI server (same flags, no
prefix cache, but one step per prompt: ExampleConnector saves and loads whole prompts) with
vLLM's bundled ``ExampleConnector`` (``kv_both``) over a directory on the same disk.

Per context length C (1k, 2k, 4k; ``--quick``: 1k and 4k) and repeat (each its own session:
the text starts at its own offset, so nothing one stored is another's prefix):

1. **Turn 1** through the front (dualpath on): a ``C - 208``-token prompt, 8 tokens generated;
   the decode node writes the prompt and the output back to storage. Not timed.
2. **The timed later turn**: turn 1's prompt + its 8 output tokens + 200 new tokens (C
   tokens), streamed through the front twice: ``dualpath`` (the hit, ~C - 200 tokens, loaded
   on the read side the scheduler picks; prefill computes the rest) and ``recompute``
   (``kv_loading: false``: the prefill instance computes all C tokens). TTFT is the front's
   own, from the request's arrival (placement and the scheduler included); the client's is
   recorded too. Outputs must be equal.
3. **ExampleConnector**: turn 1's prompt (it stores it), then the later turn twice, each timed
   from the client: ``example_later_turn`` (ExampleConnector matches whole prompts only, so a
   real later turn misses and vLLM computes all C tokens — then stores it) and
   ``example_same_prompt`` (the same prompt again: it loads everything but the last block, its
   best case and the old bench's only row).

Headline ``engine_ttft_vs_recompute`` = median dualpath TTFT ÷ median recompute TTFT (front,
from arrival) at the longest context, goal ≤ 0.30 (lower is better). Also per context: the hit,
read sides, the client-side TTFTs and dualpath ÷ ExampleConnector-same-prompt (client side,
both through one HTTP hop fewer for the peer: no front, no scheduler, no P/D hand-off); and
the KV load rate into vLLM's paged cache against a memcpy of the same bytes
(``integrations/vllm/load_rate.py``); per timed dualpath turn, what each instance's connector
spent (its ``/metrics``: seconds loading KV into the paged cache, waits for the KV to arrive
included, bytes loaded, seconds waiting for its node to hand the request over): where the
TTFT goes besides the prefill's compute.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import bench_parser, headline, print_table, write_results
from tools.vllm_engines import DTYPE, REPO, VLLM_PYTHON, agent_text_tokens, model_dir

GOAL = 0.30
CONFIG = "configs/vllm-1p1d.toml"
MAX_MODEL_LEN = 4608
NEW = 200                       # the later turn's new tokens (a tool result, a user message)
GEN = 8
MiB = 1 << 20
# every 4k prompt's KV is 180 MiB (30 layers x 1,536 B/token): room for one in each buffer
BUFFERS = {"pe_receiver": {"buffer_bytes": 384 * MiB}, "de_loader": {"buffer_bytes": 384 * MiB}}


def prompts(text: list[int], context: int, offset: int) -> tuple[list[int], list[int]]:
    """Turn 1's prompt and the new tokens of the later turn, from ``text[offset:]``."""
    first = text[offset:offset + context - NEW - GEN]
    new = text[offset + len(first):offset + len(first) + NEW]
    if len(first) + NEW + GEN != context or len(new) != NEW:
        raise ValueError(f"the bench text is too short for a {context}-token context at "
                         f"offset {offset}")
    return first, new


async def _example_server(model: Path, root: Path) -> tuple[Any, str]:
    """The peer: vLLM's OpenAI server with ExampleConnector over ``root/example``, one step per
    prompt (its engine core died on a 4k prompt prefilled in two chunks of the cluster's
    budget: ExampleConnector saves and loads whole prompts)."""
    from tools.cluster.config import free_port
    from tools.vllm_engines import omp_bind
    from tools.proc_group import private_ipc_env
    from tools.vllm_serve import KVCACHE_GIB, start, vllm_server_argv

    port = free_port()
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(root / "example")}}
    argv = vllm_server_argv(str(VLLM_PYTHON), str(model), "example", "", "", port,
                            MAX_MODEL_LEN, prefix_caching=False, kv_transfer=kv)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=KVCACHE_GIB, PYTHONPATH=str(REPO),
               **omp_bind("example"), **private_ipc_env())      # removed by its stop()
    return await start(argv, env, root / "vllm-example.log"), f"http://127.0.0.1:{port}"


# what each dualpath instance's connector spent on the timed turn (its /metrics, vLLM's stats
# path: docs/vllm.md "Metrics"): where a later turn's TTFT goes besides the prefill compute
BREAKDOWN = {"load_seconds": "dualpath_engine_load_seconds_total",
             "load_bytes": "dualpath_engine_load_bytes_total",
             "claim_wait_seconds": "dualpath_engine_claim_wait_seconds_total"}


def connector_totals(url: str) -> dict[str, float]:
    """The connector's counters on one vLLM instance (summed over labels)."""
    from tools.vllm_serve import http

    from prometheus_client.parser import text_string_to_metric_families

    status, body = http("GET", f"{url}/metrics", timeout=10)
    out = dict.fromkeys(BREAKDOWN, 0.0)
    if status != 200:
        return out
    key_of = {family: key for key, family in BREAKDOWN.items()}
    for family in text_string_to_metric_families(body.decode(errors="replace")):
        for sample in family.samples:
            if sample.name in key_of:
                out[key_of[sample.name]] += sample.value
    return out


async def _breakdown(instances: dict[str, str], before: dict[str, dict[str, float]] | None
                     ) -> dict[str, dict[str, float]]:
    now = {role: await asyncio.to_thread(connector_totals, url)
           for role, url in instances.items()}
    if before is None:
        return now
    return {role: {k: round(now[role][k] - before[role][k], 4) for k in BREAKDOWN}
            for role in instances}


async def _context(streams: Any, front: str, example: str, instances: dict[str, str],
                   text: list[int], context: int, repeats: int, echo: Any) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"dualpath": [], "recompute": [], "dualpath_client": [],
                                       "recompute_client": [], "example_later_turn": [],
                                       "example_same_prompt": []}
    hits, sides, equal, spent = [], [], True, []
    for r in range(repeats):
        first, new = prompts(text, context, offset=17 * r + 5 * (context // 1024))
        session = f"ctx{context}-r{r}"
        body = {"model": "smollm2", "max_tokens": GEN, "temperature": 0.0,
                "session_id": session}
        turn1 = await streams.complete(front, {**body, "prompt": first, "kv_loading": True})
        later = first + turn1.tokens + new
        before = await _breakdown(instances, None)
        dp = await streams.complete(front, {**body, "prompt": later, "kv_loading": True})
        spent.append(await _breakdown(instances, before))
        rc = await streams.complete(front, {**body, "prompt": later, "kv_loading": False})
        equal = equal and dp.tokens == rc.tokens
        hits.append(int(dp.dualpath.get("hit_tokens", 0)))
        sides.append(str(dp.dualpath.get("read_side", "?")))
        for name, got in (("dualpath", dp), ("recompute", rc)):
            samples[name].append(float(got.dualpath["ttft_s"]))
            samples[f"{name}_client"].append(got.first_at - got.sent_at)
        plain = {"model": str(model_dir()), "max_tokens": GEN, "temperature": 0.0}
        await streams.complete(example, {**plain, "prompt": first}, from_front=False)
        for name in ("example_later_turn", "example_same_prompt"):
            got = await streams.complete(example, {**plain, "prompt": later}, from_front=False)
            samples[name].append(got.first_at - got.sent_at)
        echo(f"  {context} tokens, repeat {r + 1}/{repeats}: hit {hits[-1]} ({sides[-1]}), "
             f"TTFT dualpath {samples['dualpath'][-1] * 1e3:.0f} ms, recompute "
             f"{samples['recompute'][-1] * 1e3:.0f} ms, ExampleConnector later turn "
             f"{samples['example_later_turn'][-1] * 1e3:.0f} / same prompt "
             f"{samples['example_same_prompt'][-1] * 1e3:.0f} ms")
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"context": context, "hit_tokens": hits, "read_sides": sides,
            "outputs_equal": equal, "connector_per_turn": spent,
            **{f"{k}_ttft_ms": round(v * 1e3, 1) for k, v in med.items()},
            "ratio_vs_recompute": med["dualpath"] / med["recompute"],
            "client_ratio_vs_example_same_prompt":
                med["dualpath_client"] / med["example_same_prompt"],
            "client_ratio_vs_example_later_turn":
                med["dualpath_client"] / med["example_later_turn"],
            "samples_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in samples.items()}}


async def bench(contexts: list[int], repeats: int, root: Path, echo: Any) -> dict[str, Any]:
    from tools.cluster.launcher import Launcher
    from tools.cluster.real_engines import on_loopback
    from tools.stream_client import Streams
    from tools.vllm_serve import stop, wait_healthy

    model = model_dir()
    assert model is not None
    text = agent_text_tokens(model, n_items=200)
    cluster = on_loopback(CONFIG, root, mode="dualpath", sections=BUFFERS,
                          vllm_prefix_caching=False, vllm_max_model_len=MAX_MODEL_LEN)
    launcher = Launcher(cluster, echo=echo)
    proc, example = await _example_server(model, root)
    t_up = time.monotonic()
    try:
        state = await asyncio.to_thread(launcher.up)
        try:
            await wait_healthy([example])
            up_s = time.monotonic() - t_up
            front = str(state.proc("front").url)
            instances: dict[str, str] = {str(n.role): str(state.proc(f"vllm:{n.id}.e0").url)
                         for n in cluster.spec.nodes}
            rows = []
            with Streams(1) as streams:
                for context in contexts:
                    rows.append(await _context(streams, front, example, instances, text,
                                               context, repeats, echo))
        finally:
            await asyncio.to_thread(launcher.down)
    finally:
        await stop(proc)
    return {"rows": rows, "cluster_up_s": round(up_s, 1), "repeats": repeats,
            "max_model_len": MAX_MODEL_LEN, "new_tokens": NEW, "gen_tokens": GEN}


def load_rate(tokens: int) -> dict[str, Any]:
    """The connector's scatter into a vLLM-shaped paged cache vs memcpy (in the vLLM venv:
    integrations/vllm/load_rate.py), for ``tokens`` tokens of hit."""
    out = subprocess.run([str(VLLM_PYTHON), "-m", "integrations.vllm.load_rate", "--tokens",
                          str(tokens), "--dtype", DTYPE], capture_output=True, text=True,
                         cwd=REPO, timeout=600, check=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("engine", __doc__.splitlines()[0], quick_takes="about 6 min")
    p.add_argument("--repeats", type=int, default=None,
                   help="sessions per context (quick 2, else 3)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if model_dir() is None:
        print("bench engine needs the vLLM venv and the model: make vllm-env vllm-model",
              file=sys.stderr)
        return 2
    repeats = args.repeats or (2 if args.quick else 3)
    if repeats < 1:
        p.error("--repeats >= 1")
    from common.logging import configure_logging

    configure_logging("warning", None)
    # SIGTERM as Ctrl-C: the cluster's processes are stopped on the way out (``bench``'s finally)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    contexts = [1024, 4096] if args.quick else [1024, 2048, 4096]
    with tempfile.TemporaryDirectory(prefix="dualpath-bench-engine-") as tmp:
        res = asyncio.run(bench(contexts, repeats, Path(tmp), lambda m: print(m, flush=True)))
    print_table(res["rows"], ["context", "hit_tokens", "read_sides", "dualpath_ttft_ms",
                              "recompute_ttft_ms", "example_later_turn_ttft_ms",
                              "example_same_prompt_ttft_ms", "ratio_vs_recompute",
                              "client_ratio_vs_example_same_prompt", "outputs_equal"])
    res["load_rate"] = lr = load_rate(max(contexts))
    print(f"KV load into vLLM's paged cache ({lr['tokens']} tokens x 30 layers, "
          f"{lr['bytes'] / 2**20:.0f} MiB): {lr['load_gb_s']:.2f} GB/s vs memcpy "
          f"{lr['memcpy_gb_s']:.2f} GB/s of the same bytes ({lr['load_vs_memcpy']:.2f}x)")
    res["all_outputs_equal"] = all(r["outputs_equal"] for r in res["rows"])
    ratio = res["rows"][-1]["ratio_vs_recompute"]
    write_results(args.out, "engine",
                  headline("engine_ttft_vs_recompute", ratio, GOAL, higher_is_better=False), res)
    return 0 if res["all_outputs_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
