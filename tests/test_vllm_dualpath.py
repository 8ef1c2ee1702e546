"""Real vLLM prefill and decode instances loading their KV through a real dualpath data path.

An in-process cluster (storage gateways, PE receiver, DE loader; engines attach over the nodes'
Unix sockets) and three vLLM processes from .venv-vllm: a prefill instance (DualPathConnector,
kv_producer, attached to the PE receiver), a decode instance (kv_consumer, attached to the DE
loader) and plain vLLM (no connector, prefix caching off). A multi-turn conversation of real
token ids: each turn's prompt is the previous prompt + its output + new text; its hit is the
stored prefix (the previous turn's prompt and output, written back by the decode side). The
read side is forced to PE or DE per test; the scheduler's own choice is left to the front.

Asserted per turn: the decode instance's greedy tokens equal plain vLLM's; from turn 2 the hit
covers >= 90 % of the prompt; the bytes the gateways read equal hit blocks x Full Block bytes.
"""

from __future__ import annotations

import asyncio

import pytest

from tools.vllm_engines import agent_text_tokens, datapath_overrides, start_pd_plain
from common.kv import block_keys_from_tokens
from tests.helpers import until
from tests.test_datapath import BT, plan, report
from tests.vllm_env import require_vllm
from tools.cluster.inprocess import local_datapath

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

TURNS = 6
GEN = 16
# an agent's turns: a long context, short appends (tool results); from turn 2 the hit is every
# full block of the previous prompt + output, >= 90 % of the prompt once appends stay < ~60
# tokens; turn 6 reaches 1,250 + 5 x (16 + 40) + 16 = 1,546 tokens of context
FIRST = 1250
APPEND = 40


def bytes_read(c) -> float:
    return sum(g.counters().get("bytes_read", 0.0) for g in c.gateways.values())


@pytest.mark.parametrize("side", ["pe", "de"])
async def test_multi_turn_greedy_outputs_equal_plain_vllm(tmp_path, side):
    _, model = require_vllm()
    text = agent_text_tokens(model)
    overrides = datapath_overrides(tmp_path)
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=overrides) as c:
        engines = await start_pd_plain(model, tmp_path)
        prefill, decode, plain = engines
        try:
            await run_conversation(c, prefill, decode, plain, text, side)
        finally:
            for e in engines:
                await e.stop()


async def run_conversation(c, prefill, decode, plain, text, side) -> None:
    block_bytes = c.spec.full_block_bytes
    prompt, cursor = text[:FIRST], FIRST
    for turn in range(TURNS):
        keys = block_keys_from_tokens(prompt, BT)
        hit_blocks = min(await c.stored_prefix(keys), (len(prompt) - 1) // BT)
        rid = f"{side}-t{turn}"
        before = bytes_read(c)
        c.pe["p0"].submit_plan(plan(c, rid, prompt, hit_blocks, side if hit_blocks else "none",
                                    gen=GEN, deadline=900.0))
        pre, dec, ref = await asyncio.gather(
            prefill.generate(prompt, 1, {"request_id": rid, "hit_tokens": hit_blocks * BT}),
            decode.generate(prompt, GEN, {"request_id": rid}),
            plain.generate(prompt, GEN))
        assert dec["tokens"] == ref["tokens"], f"turn {turn}: decode output != plain vLLM"
        assert pre["tokens"][0] == ref["tokens"][0], f"turn {turn}: prefill's first token"
        await until(lambda rid=rid: report(c.de["d0"], rid, "finished") is not None, timeout=300,
                    what=f"{rid} finished on the DE")
        if turn > 0:
            assert hit_blocks * BT >= 0.9 * len(prompt), f"turn {turn}: hit {hit_blocks * BT}"
        assert bytes_read(c) - before == hit_blocks * block_bytes
        last_context = len(prompt) + GEN
        # next turn: this prompt + its output + new text (an agent's tool result)
        prompt = prompt + dec["tokens"] + text[cursor:cursor + APPEND]
        cursor += APPEND
    assert last_context >= 1500
