"""A client's view of streamed completions through the OpenAI front: when each token arrived.

What the many-agents test (tests/vllm_agents.py) and ``bench engine_agents`` measure from the
client's side: TTFT from the moment a request was sent, the decode step gaps of running
requests (time between consecutive streamed chunks), how many requests were in flight at once,
and the gaps that overlapped another request's load (its submission to its first token).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class Streamed:
    """One streamed completion as the client saw it (``time.monotonic`` seconds): when it was
    sent, each chunk with tokens, the tokens, the closing chunk's ``dualpath`` object."""

    def __init__(self) -> None:
        self.sent_at = time.monotonic()
        self.arrivals: list[float] = []
        self.tokens: list[int] = []
        self.dualpath: dict[str, Any] = {}
        self.done_at = 0.0

    @property
    def first_at(self) -> float:
        return self.arrivals[0] if self.arrivals else self.done_at


def stream_completion(front_url: str, body: dict[str, Any], timeout: float = 900,
                      from_front: bool = True) -> Streamed:
    """POST ``body`` with ``stream: true`` to the front's ``/v1/completions`` (blocking: run it
    in a thread), each chunk's arrival recorded as it is read; a chunk carrying an error (or
    a stream without the closing ``dualpath`` object) raises RuntimeError. ``from_front``
    False: a vLLM OpenAI server's own (asked for token ids; no ``dualpath`` object)."""
    req = urllib.request.Request(f"{front_url}/v1/completions",
                                 data=json.dumps({**body, "stream": True, **({} if from_front
                                                  else {"return_token_ids": True})}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    got = Streamed()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"front streamed an error: {ev['error']}")
            new = ev["choices"][0].get("token_ids") or []
            if new:
                got.arrivals.append(time.monotonic())
                got.tokens.extend(new)
            got.dualpath = ev.get("dualpath", got.dualpath)
    got.done_at = time.monotonic()
    if from_front and not got.dualpath:
        raise RuntimeError("the front's stream closed without its dualpath object")
    return got


class Streams:
    """Streamed completions from asyncio, one thread per concurrent session (the default
    executor has too few threads on a small host for a few sessions at once). Leaving the
    ``with`` never joins the threads: a thread still waiting for a server that this very loop
    serves (an in-process cluster) would otherwise hang the loop instead of letting the error
    that ended the block through."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads)

    async def complete(self, front_url: str, body: dict[str, Any],
                       timeout: float = 900, from_front: bool = True) -> Streamed:
        """:func:`stream_completion` in one of the threads."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, stream_completion, front_url, body, timeout, from_front)

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def timeline(turns: list[Streamed]) -> dict[str, Any]:
    """What overlapped: the most requests in flight at once, and the decode step gaps of
    running requests (consecutive chunks of one request), overall and while another request
    was loading (submitted, no token yet)."""
    events = sorted([(t.sent_at, 1) for t in turns] + [(t.done_at, -1) for t in turns])
    in_flight = peak = 0
    for _, d in events:
        in_flight += d
        peak = max(peak, in_flight)
    gaps, during = [], []
    tokens_during = 0
    for t in turns:
        others = [(o.sent_at, o.first_at) for o in turns if o is not t]
        for a, b in zip(t.arrivals, t.arrivals[1:]):
            gaps.append(b - a)
            if any(s < b and f > a for s, f in others):
                during.append(b - a)
        tokens_during += sum(1 for x in t.arrivals[1:] if any(s < x < f for s, f in others))
    return {"max_in_flight": peak, "tokens_during_loads": tokens_during,
            "step_gap_ms": pcts(gaps), "step_gap_during_loads_ms": pcts(during),
            "ttft_ms": pcts([t.first_at - t.sent_at for t in turns])}


def pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 1)

    return {"n": len(s), "p50": at(0.50), "p99": at(0.99), "max": round(s[-1] * 1e3, 1)}
