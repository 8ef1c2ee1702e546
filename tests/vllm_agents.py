"""Many agents at once through the front and real vLLM (docs/vllm.md "Many agents at once"):
the concurrent phase tests/test_vllm_front.py runs on its 1P2D cluster.

Agents are concurrent by nature, and DualPath's gain exists only under many of them: here
``SESSIONS`` multi-turn agent sessions run at once (``asyncio.gather``: each session's turns
follow one another, the sessions' turns overlap) through the OpenAI front over an in-process
dualpath cluster (scheduler policy ``dualpath``: it chooses each read side) and real vLLM
servers with the DualPathConnector. :func:`agents` is the phase; its caller checks what its
shape adds (on 1P2D: both decode instances served, both read sides used, every node's storage
link read).

Every turn is streamed; the test records each chunk's arrival time. Checked per turn of every
session: the output equals plain vLLM's at temperature 0 (the reference is the prefill
instance's own output for the same prompt without ``kv_transfer_params``, where the connector
stays idle: cheaper here than a fourth instance, and tests/test_vllm_dualpath.py keeps the
strictly separate plain instance); from turn 2 the dualpath hit is >= 90 % of the prompt. Over
the phase: the bytes the storage gateways read equal the hit blocks x Full Block bytes of the
phase's requests (every hit is read once from storage, on its read side, and nothing else is
read, as tests/test_vllm_dualpath.py checks per turn); each instance's connector counters
(vLLM ``/metrics``) show every request claimed on both roles, no load error and no recompute
fallback (the output checks alone would not see a fallback: vLLM then recomputes, and its
output is the same); the nodes' buffers drain; at least two requests were observed in flight
at once, and running requests received tokens while another request was loading (between
its submission and its first token) — the structural form of "the batch is not stalled by
another request's load"; the decode step gaps (time between a running request's consecutive
chunks) are printed, p50/p99, overall and for the gaps that overlapped another request's
load. No timed assertion: speed belongs to the benches.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import until
from tools.stream_client import Streamed, Streams, timeline
from tools.vllm_serve import ahttp, tokenize

SESSIONS = 4
TURNS = 5
GEN = 16
# a session's first prompt, then short appends (tool results): from turn 2 the miss is at
# most the last partial 64-token block plus GEN + APPEND (< 112 tokens), under 10 % of a
# >= 1,000-token prompt; the longest context is 1,000 + 4 x 48 + 16 = 1,208 tokens
FIRST = 1000
APPEND = 32


async def reference(plain_url: str, model: str, prompt: list[int]) -> list[int]:
    """Plain vLLM's greedy tokens: the prefill instance without ``kv_transfer_params``."""
    status, raw = await ahttp("POST", f"{plain_url}/v1/completions",
                              {"model": model, "prompt": prompt, "max_tokens": GEN,
                               "temperature": 0.0, "return_token_ids": True})
    assert status == 200, raw
    return list(json.loads(raw)["choices"][0]["token_ids"])


def session_text(s: int) -> str:
    """A tool-output transcript of its own per session (no prefix shared across sessions)."""
    return " ".join(f"Agent {s} step {i}: cat logs/run_{s}_{i}.txt prints {i * 7 + s} lines; "
                    f"pytest reports {i % 5 + s} failures in test_{i}.py." for i in range(130))


def lookups(c) -> dict[str, float]:
    """The scheduler's hit-lookup counters (a failed lookup plans hit 0: correct, slower)."""
    return {k: v for k, v in c.scheduler.stats().items() if k.startswith("hit_lookup")}


def bytes_read(c) -> dict[str, float]:
    """Storage bytes each node's gateway has read."""
    return {n: g.counters().get("bytes_read", 0.0) for n, g in c.gateways.items()}


async def agents(c, front_url: str, urls: dict[str, str], model: str) -> dict[str, Any]:
    """The concurrent phase over the instances ``urls`` (engine id → URL; the prefill one
    ``p0.e0`` also gives the references): ``SESSIONS`` sessions x ``TURNS`` turns at once,
    every check of the module docstring; returns the turns and the measured figures (also
    printed)."""
    plain_url = urls["p0.e0"]
    texts = [await tokenize(plain_url, model, session_text(s)) for s in range(SESSIONS)]
    assert all(len(ids) > FIRST + TURNS * APPEND for ids in texts)
    before = bytes_read(c)
    counted = {e: await connector_counters(u) for e, u in urls.items()}
    turns: list[Streamed] = []
    with Streams(SESSIONS) as streams:
        async def session(s: int) -> None:
            ids = texts[s]
            prompt, cursor = ids[:FIRST], FIRST
            for turn in range(TURNS):
                body = {"model": "smollm2", "prompt": prompt, "max_tokens": GEN,
                        "temperature": 0.0, "session_id": f"agent-{s}"}
                try:
                    got = await streams.complete(front_url, body)
                except RuntimeError as e:
                    raise AssertionError(f"session {s} turn {turn}: {e}") from None
                turns.append(got)
                ref = await reference(plain_url, model, prompt)
                assert got.tokens == ref, f"session {s} turn {turn}: front output != plain vLLM"
                assert got.dualpath["token_ids"] == got.tokens
                if turn > 0:
                    assert got.dualpath["hit_tokens"] >= 0.9 * len(prompt), \
                        (f"session {s} turn {turn}: {got.dualpath}; the scheduler's hit "
                         f"lookups: {lookups(c)}")
                prompt = prompt + got.tokens + ids[cursor:cursor + APPEND]
                cursor += APPEND

        await asyncio.gather(*(session(s) for s in range(SESSIONS)))
    after = bytes_read(c)
    bt = c.spec.block_tokens
    hits = [t.dualpath["hit_tokens"] for t in turns]
    assert all(h % bt == 0 for h in hits), hits
    read = {n: after[n] - before[n] for n in after}
    assert sum(read.values()) == sum(hits) // bt * c.spec.full_block_bytes, (read, hits)
    await connector_check(urls, counted, len(turns))
    # every attempt ended on the nodes and gave its buffer pages back
    await until(lambda: not any(c.leaks().values())
                and not any(n.attempts for n in c.nodes.values()), timeout=60,
                what=lambda: f"node pools empty after the phase (pages held {c.leaks()})")
    figures = timeline(turns)
    assert figures["max_in_flight"] >= 2, figures
    assert figures["tokens_during_loads"] > 0, figures
    figures["read_bytes"] = read
    print(f"\nmany agents at once ({SESSIONS} sessions x {TURNS} turns): "
          f"{json.dumps(figures, sort_keys=True)}")
    return {"turns": turns, **figures}


async def connector_counters(url: str) -> dict[str, float]:
    """The connector's counters on one instance's vLLM ``/metrics`` (docs/vllm.md
    "Metrics"), summed over their labels."""
    status, body = await ahttp("GET", f"{url}/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for sample in fam.samples:
            if sample.name.startswith("dualpath_engine_"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def connector_check(urls: dict[str, str], before: dict[str, dict[str, float]],
                          requests: int) -> None:
    """What each instance's connector did over the phase: every request claimed on its
    prefill and on its decode instance, no load error and no recompute fallback. The output
    checks alone would not see a fallback (vLLM then recomputes, and its output is the
    same). vLLM publishes the counters with its step outputs: poll until the claims show."""
    def delta(now: dict[str, dict[str, float]], name: str, role: str) -> float:
        return sum(now[e].get(name, 0.0) - before[e].get(name, 0.0)
                   for e in urls if e.startswith(role))

    now: dict[str, dict[str, float]] = {}
    for _ in range(100):
        now = {e: await connector_counters(u) for e, u in urls.items()}
        if all(delta(now, "dualpath_engine_claim_waits_total", r) >= requests for r in "pd"):
            break
        await asyncio.sleep(0.2)
    for role in "pd":
        assert delta(now, "dualpath_engine_claim_waits_total", role) >= requests, (before, now)
        for bad in ("dualpath_engine_load_errors_total",
                    "dualpath_engine_recompute_fallbacks_total"):
            assert delta(now, bad, role) == 0, (role, bad, before, now)


