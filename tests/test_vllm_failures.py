"""Real vLLM through dualpath when things go wrong: a DE loader killed mid-request, a model
whose KV spec is not the cluster's, a node service that is not there.

One in-process data path and three vLLM processes per module (prefill attached to the PE
receiver, decode to the DE loader, plain vLLM as the reference), as tests/test_vllm_dualpath.py.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from common.kv import block_keys_from_tokens
from tests.helpers import until
from tests.test_datapath import BT, plan, report
from tests.vllm_env import require_vllm
from tools.cluster.inprocess import local_datapath, node_service
from tools.vllm_engines import Engine, agent_text_tokens, datapath_overrides, start_pd_plain

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

GEN = 8
FIRST = 700


def overrides(tmp_path) -> dict:
    return datapath_overrides(tmp_path, buffer_mib=96)


async def restart_de(c, stack_svc) -> object:
    """A new DE loader for node d0 on the same engine socket (the old one was stopped)."""
    cfg = c.cfg
    de_cfg = msgspec.structs.replace(cfg.de_loader, gateway_port=c.gateways["d0"].rpc_port,
                                     scheduler_port=0)
    svc = node_service("de_loader", msgspec.structs.replace(cfg, de_loader=de_cfg), "d0",
                       spec=c.spec)
    await svc.__aenter__()
    c.add_node(svc)
    stack_svc.append(svc)
    return svc


async def test_de_loader_killed_mid_request_then_restarted(tmp_path):
    """Turn 1 reads its hit on the DE side; the DE loader stops once the PE receiver holds the
    request (the prefill instance is waiting on its layers, the decode instance on its claim):
    both instances recompute and the output equals plain vLLM. A new DE loader on the same
    socket: the next turn's decode instance attaches again by itself (no vLLM restart) and
    loads through dualpath."""
    _, model = require_vllm()
    text = agent_text_tokens(model, n_items=60)
    restarted: list = []
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=overrides(tmp_path)) as c:
        engines = await start_pd_plain(model, tmp_path)
        prefill, decode, plain = engines
        try:
            prompt = text[:FIRST]
            out0 = await turn(c, prefill, decode, plain, "t0", prompt, "none", 0)
            prompt = prompt + out0 + text[FIRST:FIRST + 40]
            hit = await hit_blocks_of(c, prompt)
            assert hit * BT >= FIRST, "turn 0's write-back is not stored"
            rid = "t1"
            c.pe["p0"].submit_plan(plan(c, rid, prompt, hit, "de", gen=GEN, deadline=600.0))
            gen = asyncio.gather(
                prefill.generate(prompt, 1, {"request_id": rid, "hit_tokens": hit * BT}),
                decode.generate(prompt, GEN, {"request_id": rid}), plain.generate(prompt, GEN))
            await until(lambda: report(c.pe["p0"], rid, "allocated") is not None, timeout=300,
                        what="the PE receiver holds t1")
            await c.de.pop("d0").stop()                       # the DE loader dies mid-request
            pre, dec, ref = await gen
            assert dec["tokens"] == ref["tokens"], "decode output after the DE died"
            assert pre["tokens"][0] == ref["tokens"][0]
            assert report(c.pe["p0"], rid, "failed") is not None, "the PE saw no failure"
            # the node comes back; the decode instance re-attaches on its next request
            await restart_de(c, restarted)
            prompt2 = prompt + dec["tokens"] + text[FIRST + 40:FIRST + 80]
            stored = await hit_blocks_of(c, prompt2)
            await turn(c, prefill, decode, plain, "t2", prompt2, "pe" if stored else "none",
                       stored)
            assert report(c.de["d0"], "t2", "finished") is not None
        finally:
            for e in engines:
                await e.stop()
            for svc in restarted:
                await svc.__aexit__(None, None, None)


async def hit_blocks_of(c, prompt: list[int]) -> int:
    """Stored whole blocks of this prompt's prefix, below its last token."""
    return min(await c.stored_prefix(block_keys_from_tokens(prompt, BT)), (len(prompt) - 1) // BT)


async def turn(c, prefill, decode, plain, rid, prompt, side, hit_blocks) -> list[int]:
    c.pe["p0"].submit_plan(plan(c, rid, prompt, hit_blocks, side, gen=GEN, deadline=600.0))
    pre, dec, ref = await asyncio.gather(
        prefill.generate(prompt, 1, {"request_id": rid, "hit_tokens": hit_blocks * BT}),
        decode.generate(prompt, GEN, {"request_id": rid}), plain.generate(prompt, GEN))
    assert dec["tokens"] == ref["tokens"], f"{rid}: decode output != plain vLLM"
    assert pre["tokens"][0] == ref["tokens"][0]
    await until(lambda: report(c.de["d0"], rid, "finished") is not None, timeout=300,
                what=f"{rid} finished on the DE")
    return list(dec["tokens"])


async def test_kv_spec_mismatch_and_missing_node_refuse_to_start(tmp_path):
    """A connector whose cluster preset is not the model's KV (bf16 preset, fp32 model) or
    whose node socket has no service behind it: vLLM does not start, and the log names both
    specs / the socket."""
    _, model = require_vllm()
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=overrides(tmp_path)):
        with pytest.raises(RuntimeError) as e:
            await Engine.start(model, "prefill", tmp_path, "--socket",
                               str(tmp_path / "p0.sock"), "--engine-id", "p0.e0",
                               "--preset", "smollm2-135m")
        assert "KVSpecMismatch" in str(e.value) or "1536" in str(e.value), str(e.value)[-2000:]
        assert "768" in str(e.value)
        with pytest.raises(RuntimeError) as e:
            await Engine.start(model, "decode", tmp_path, "--socket",
                               str(tmp_path / "nowhere.sock"), "--engine-id", "d0.e0")
        assert "nowhere.sock" in str(e.value), str(e.value)[-2000:]
