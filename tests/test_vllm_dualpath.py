"""Real vLLM prefill and decode instances loading their KV through a real dualpath data path.

One in-process cluster (storage gateways, PE receiver, DE loader; engines attach over the
nodes' Unix sockets) and three vLLM processes from .venv-vllm, shared by the module's tests
(an instance's load is most of a real-engine test's time): a prefill instance
(DualPathConnector, kv_producer, attached to the PE receiver) and a decode instance
(kv_consumer, attached to the DE loader), both stepwise (``engine_worker.py --stepwise``:
requests added while others run, a line per engine step that gave a request tokens), and plain
vLLM (no connector, prefix caching off) for the reference. Each test's prompts start at their
own offset of the token text, so no test's blocks are another's prefix: neither dualpath's
store nor vLLM's own prefix cache carries anything from one test into the next.

**Waiting for dualpath never stalls a running batch** (docs/vllm.md "Asynchronous loads").
Request A decodes on the decode instance; then B arrives at both instances before the node has
B's plan, so B's claims are outstanding — and stay so until the test submits B's plan, which it
does only after A has produced more tokens on the decode instance, and a plain request C on the
prefill instance has too. With claims inside the step (the old connector) neither could
happen: the worker would wait in B's claim. Asserted structurally, never by time: A and C
produced tokens while B's claims were outstanding and B had none; B's prompt KV then reaches
the decode instance through dualpath (an asynchronous load); every output equals plain vLLM at
temperature 0.

**A multi-turn conversation, read side forced to PE or DE** (the scheduler's own choice is
left to the front's tests). Real token ids: each turn's prompt is the previous prompt + its
output + new text; its hit is the stored prefix (the previous turn's prompt and output,
written back by the decode side). Asserted per turn: the decode instance's greedy tokens equal
plain vLLM's; from turn 2 the hit covers >= 90 % of the prompt; the bytes the gateways read
equal hit blocks x Full Block bytes.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
import pytest_asyncio

from common.kv import block_keys_from_tokens
from tests.helpers import until
from tests.test_datapath import BT, plan, report
from tests.vllm_env import require_vllm
from tools.cluster.inprocess import local_datapath
from tools.vllm_engines import Engine, agent_text_tokens, datapath_overrides

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.asyncio(loop_scope="module")]

# where each test's prompts start in the token text (module docstring)
OFFSET = {"stall": 0, "pe": 1, "de": 2}

# A and C must still be running when B starts to wait: adding B to an instance under load
# took long enough once for C (then 48 tokens) to reach its end first (ci59)
GEN_A = 128          # long enough to still run while B waits for its claim
GEN_B = 16
GEN_C = 128
MORE = 8             # tokens A and C must produce while B's claim is outstanding

TURNS = 4           # a miss, then three hits: each later turn exercises the same path again
GEN = 16
# an agent's turns: a long context, short appends (tool results); from turn 2 the hit is every
# full block of the previous prompt + output, >= 90 % of the prompt once appends stay < ~60
# tokens; turn 4 reaches 1,250 + 3 x (16 + 40) + 16 = 1,434 tokens of context
FIRST = 1250
APPEND = 40


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


@dataclass
class Rig:
    """The module's cluster and instances, and the token text the tests cut prompts from."""

    cluster: object
    prefill: Stepwise
    decode: Stepwise
    plain: Engine
    text: list[int]

    async def reference(self, prompt: list[int], n: int) -> list[int]:
        """Plain vLLM's greedy tokens (EOS ignored, as in the stepwise requests)."""
        proc = self.plain.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps({"prompt": prompt, "max_tokens": n, "dualpath": None,
                                      "ignore_eos": True}) + "\n").encode())
        await proc.stdin.drain()
        while line := await asyncio.wait_for(proc.stdout.readline(), 300):
            if line.startswith(b"{"):
                return json.loads(line)["tokens"]
        raise RuntimeError(f"plain vLLM died:\n{self.plain.log_tail()}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory):
    _, model = require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-pd")
    text = agent_text_tokens(model)
    assert len(text) >= OFFSET["de"] + FIRST + TURNS * APPEND
    async with local_datapath(tmp, scheduler=False, engines=False,
                              overrides=datapath_overrides(tmp)) as c:
        engines = await Engine.start_all([
            (model, "prefill", tmp, ["--socket", str(tmp / "p0.sock"),
                                     "--engine-id", "p0.e0", "--stepwise"]),
            (model, "decode", tmp, ["--socket", str(tmp / "d0.sock"),
                                    "--engine-id", "d0.e0", "--stepwise"]),
            (model, "plain", tmp, [])])
        prefill, decode = Stepwise(engines[0]), Stepwise(engines[1])
        try:
            yield Rig(c, prefill, decode, engines[2], text)
        finally:
            # at once: each instance's own shutdown is seconds of waiting
            await asyncio.gather(prefill.stop(), decode.stop(), engines[2].stop())


async def test_a_request_waiting_for_its_claim_never_stalls_running_ones(rig):
    c, prefill, decode = rig.cluster, rig.prefill, rig.decode
    text = rig.text[OFFSET["stall"]:]
    a, b, cc = text[:700], text[700:1300], text[1300:1600]
    # A: through dualpath (no hit), decoding on the decode instance
    c.pe["p0"].submit_plan(plan(c, "A", a, 0, "none", gen=GEN_A, deadline=900.0))
    await prefill.add("A", a, 1, {"request_id": "A", "hit_tokens": 0})
    await decode.add("A", a, GEN_A, {"request_id": "A"})
    await until(lambda: decode.count("A") >= 2, timeout=300, what="A decoding")
    # C: plain vLLM on the prefill instance
    await prefill.add("C", cc, GEN_C)
    await until(lambda: prefill.count("C") >= 1, timeout=300, what="C running")
    # B arrives at both instances before its plan reaches the nodes: both claims wait. Each
    # running request's count is taken as soon as B waits on its instance
    await prefill.add("B", b, 1, {"request_id": "B", "hit_tokens": 0})
    c_at = prefill.count("C")
    await decode.add("B", b, GEN_B, {"request_id": "B"})
    a_at = decode.count("A")
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
        assert done[rid]["tokens"] == await rig.reference(prompt, n), \
            f"{rid}: output != plain vLLM"
    # each worker marked its steps (the connector's hooks), and its beats told its node: what
    # a hung instance is judged by (docs/engine-api.md, "A stuck engine")
    for node in ("p0", "d0"):
        api = (c.pe if node == "p0" else c.de)[node].engine_api
        await until(lambda api=api: api.stats()["engine_steps"] >= GEN_A, timeout=30,
                    what=f"{node}'s vLLM steps counted by its beats")
        assert api.counters["engines_stuck"] == 0


def bytes_read(c) -> float:
    return sum(g.counters().get("bytes_read", 0.0) for g in c.gateways.values())


def datapath_state(c, rid: str) -> str:
    """What the nodes did with ``rid`` and their counters: appended to a failed turn's
    assertion, since CI keeps neither the cluster nor its logs (a CI run on 52be796 reported
    this test only by name)."""
    lines = []
    for name, svc in (("PE p0", c.pe["p0"]), ("DE d0", c.de["d0"])):
        mine = [r for r in svc.reports if r.request_id == rid]
        lines.append(f"{name} reports for {rid}: {mine!r:.1500}")
        lines.append(f"{name} counters: {dict(svc.counters)!r:.1500}")
    for node, g in c.gateways.items():
        lines.append(f"gateway {node}: {g.counters()!r:.800}")
    return "\n".join(lines)


@pytest.mark.parametrize("side", ["pe", "de"])
async def test_multi_turn_greedy_outputs_equal_plain_vllm(rig, side):
    c, text = rig.cluster, rig.text[OFFSET[side]:]
    prompt, cursor = text[:FIRST], FIRST
    for turn in range(TURNS):
        try:
            prompt = await _one_turn(rig, side, turn, prompt, text[cursor:cursor + APPEND])
        except AssertionError as e:
            raise AssertionError(f"{e}\n{datapath_state(c, f'{side}-t{turn}')}") from e
        cursor += APPEND
    assert len(prompt) >= FIRST + TURNS * (GEN + APPEND)


async def _one_turn(rig, side: str, turn: int, prompt: list[int], append: list[int]
                    ) -> list[int]:
    """One turn through dualpath, checked against plain vLLM; the next turn's prompt."""
    c = rig.cluster
    block_bytes = c.spec.full_block_bytes
    keys = block_keys_from_tokens(prompt, BT)
    hit_blocks = min(await c.stored_prefix(keys), (len(prompt) - 1) // BT)
    if turn == 0:
        assert hit_blocks == 0, "another test's blocks are this conversation's prefix"
    rid = f"{side}-t{turn}"
    before = bytes_read(c)
    c.pe["p0"].submit_plan(plan(c, rid, prompt, hit_blocks, side if hit_blocks else "none",
                                gen=GEN, deadline=900.0))
    await rig.prefill.add(rid, prompt, 1, {"request_id": rid,
                                           "hit_tokens": hit_blocks * BT})
    await rig.decode.add(rid, prompt, GEN, {"request_id": rid})
    ref = await rig.reference(prompt, GEN)
    pre, dec = await rig.prefill.finished(rid), await rig.decode.finished(rid)
    how = f"(the decode instance's dualpath: {dec.get('dualpath')}; the prefill's: " \
          f"{pre.get('dualpath')})"
    assert dec["tokens"] == ref, \
        f"turn {turn}: decode output {dec['tokens']} != plain vLLM {ref} {how}"
    assert pre["tokens"][0] == ref[0], f"turn {turn}: prefill's first token {how}"
    await until(lambda rid=rid: report(c.de["d0"], rid, "finished") is not None, timeout=300,
                what=f"{rid} finished on the DE")
    if turn > 0:
        assert hit_blocks * BT >= 0.9 * len(prompt), \
            f"turn {turn}: hit {hit_blocks * BT} of {len(prompt)} tokens stored"
    read = bytes_read(c) - before
    assert read == hit_blocks * block_bytes, \
        f"turn {turn}: the gateways read {read} B for a hit of {hit_blocks} blocks {how}"
    # next turn: this prompt + its output + new text (an agent's tool result)
    return prompt + dec["tokens"] + append
