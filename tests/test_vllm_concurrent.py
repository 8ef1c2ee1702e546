"""Waiting for dualpath never stalls a real vLLM's running batch (docs/vllm.md "Asynchronous
loads").

An in-process data path, a prefill and a decode instance with the connector run stepwise
(``engine_worker.py --stepwise``: requests added while others run, a line per engine step
that gave a request tokens) and plain vLLM for the reference. Request A decodes on the decode
instance; then B arrives at both instances before the node has B's plan, so B's claims are
outstanding — and stay so until the test submits B's plan, which it does only after A has
produced more tokens on the decode instance, and a plain request C on the prefill instance
has too. With claims inside the step (the old connector) neither could happen: the worker
would wait in B's claim. Asserted structurally, never by time: A and C produced tokens while
B's claims were outstanding and B had none; B's prompt KV then reaches the decode instance
through dualpath (an asynchronous load); every output equals plain vLLM at temperature 0.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.helpers import until
from tests.test_datapath import plan, report
from tests.vllm_env import require_vllm
from tools.cluster.inprocess import local_datapath
from tools.vllm_engines import Engine, agent_text_tokens, datapath_overrides

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

GEN_A = 96           # long enough to still run while B waits for its claim
GEN_B = 16
GEN_C = 48
MORE = 8             # tokens A and C must produce while B's claim is outstanding


class Stepwise:
    """One ``--stepwise`` instance: add requests, follow their events."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, int] = {}
        self.done: dict[str, dict] = {}
        self.added: set[str] = set()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        out = self.engine.proc.stdout
        assert out is not None
        while line := await out.readline():
            if not line.startswith(b"{"):
                continue
            ev = json.loads(line)
            if ev["event"] == "added":
                self.added.add(ev["id"])
            elif ev["event"] == "tokens":
                self.tokens[ev["id"]] = ev["n"]
            elif ev["event"] == "done":
                self.done[ev["id"]] = ev

    async def add(self, rid: str, prompt: list[int], max_tokens: int,
                  dualpath: dict | None = None) -> None:
        stdin = self.engine.proc.stdin
        assert stdin is not None
        stdin.write((json.dumps({"id": rid, "prompt": prompt, "max_tokens": max_tokens,
                                 "dualpath": dualpath, "ignore_eos": True}) + "\n").encode())
        await stdin.drain()
        await until(lambda: rid in self.added, timeout=60, what=f"{rid} added")

    def count(self, rid: str) -> int:
        return self.tokens.get(rid, 0)

    async def finished(self, rid: str) -> dict:
        await until(lambda: rid in self.done or self.engine.proc.returncode is not None,
                    timeout=600, what=f"{rid} done on the {self.engine.role} instance")
        assert rid in self.done, f"vLLM {self.engine.role} died:\n{self.engine.log_tail()}"
        return self.done[rid]

    async def stop(self) -> None:
        self._reader.cancel()
        await self.engine.stop()


async def test_a_request_waiting_for_its_claim_never_stalls_running_ones(tmp_path):
    _, model = require_vllm()
    text = agent_text_tokens(model)
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=datapath_overrides(tmp_path)) as c:
        engines = await Engine.start_all([
            (model, "prefill", tmp_path, ["--socket", str(tmp_path / "p0.sock"),
                                          "--engine-id", "p0.e0", "--stepwise"]),
            (model, "decode", tmp_path, ["--socket", str(tmp_path / "d0.sock"),
                                         "--engine-id", "d0.e0", "--stepwise"]),
            (model, "plain", tmp_path, [])])
        prefill, decode = Stepwise(engines[0]), Stepwise(engines[1])
        plain = engines[2]
        try:
            await run(c, prefill, decode, plain, text)
        finally:
            await prefill.stop()
            await decode.stop()
            await plain.stop()


async def reference(plain: Engine, prompt: list[int], n: int) -> list[int]:
    """Plain vLLM's greedy tokens (EOS ignored, as in the stepwise requests)."""
    proc = plain.proc
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps({"prompt": prompt, "max_tokens": n, "dualpath": None,
                                  "ignore_eos": True}) + "\n").encode())
    await proc.stdin.drain()
    while line := await asyncio.wait_for(proc.stdout.readline(), 300):
        if line.startswith(b"{"):
            return json.loads(line)["tokens"]
    raise RuntimeError(f"plain vLLM died:\n{plain.log_tail()}")


async def run(c, prefill: Stepwise, decode: Stepwise, plain: Engine, text: list[int]) -> None:
    a, b, cc = text[:700], text[700:1300], text[1300:1600]
    # A: through dualpath (no hit), decoding on the decode instance
    c.pe["p0"].submit_plan(plan(c, "A", a, 0, "none", gen=GEN_A, deadline=900.0))
    await prefill.add("A", a, 1, {"request_id": "A", "hit_tokens": 0})
    await decode.add("A", a, GEN_A, {"request_id": "A"})
    await until(lambda: decode.count("A") >= 2, timeout=300, what="A decoding")
    # C: plain vLLM on the prefill instance
    await prefill.add("C", cc, GEN_C)
    await until(lambda: prefill.count("C") >= 1, timeout=300, what="C running")
    # B arrives at both instances before its plan reaches the nodes: both claims wait
    await prefill.add("B", b, 1, {"request_id": "B", "hit_tokens": 0})
    await decode.add("B", b, GEN_B, {"request_id": "B"})
    a_at, c_at = decode.count("A"), prefill.count("C")
    await until(lambda: decode.count("A") >= min(a_at + MORE, GEN_A)
                and prefill.count("C") >= min(c_at + MORE, GEN_C), timeout=300,
                what="A and C step on while B's claims wait")
    assert decode.count("A") >= a_at + MORE, "A ended before it could show it ran on"
    assert prefill.count("C") >= c_at + MORE, "C ended before it could show it ran on"
    assert decode.count("B") == 0 and prefill.count("B") == 0     # B waits outside the batch
    # only now does B's plan reach the nodes: its claims resolve, its KV loads
    c.pe["p0"].submit_plan(plan(c, "B", b, 0, "none", gen=GEN_B, deadline=900.0))
    done = {"A": await decode.finished("A"), "B": await decode.finished("B"),
            "C": await prefill.finished("C")}
    pre_b = await prefill.finished("B")
    for rid in ("A", "B"):
        await until(lambda rid=rid: report(c.de["d0"], rid, "finished") is not None,
                    timeout=300, what=f"{rid} finished on the DE")
    # the decode instance loaded B's prompt KV from dualpath (all but the last token)
    assert done["B"]["dualpath"]["hit_tokens"] == len(b) - 1, done["B"]["dualpath"]
    assert pre_b["tokens"][0] == done["B"]["tokens"][0]
    for rid, prompt, n in (("A", a, GEN_A), ("B", b, GEN_B), ("C", cc, GEN_C)):
        assert done[rid]["tokens"] == await reference(plain, prompt, n), \
            f"{rid}: output != plain vLLM"
