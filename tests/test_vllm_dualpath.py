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
import json
import os
import subprocess

import pytest

from common.kv import block_keys_from_tokens
from tests.helpers import until
from tests.test_datapath import BT, plan, report
from tests.test_engine_ipc import sockets
from tests.vllm_env import REPO, require_vllm
from tools.cluster.inprocess import local_datapath

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

TURNS = 6
GEN = 16
MiB = 1 << 20


class Engine:
    """One engine_worker.py process: a JSON line in, a JSON line out."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str) -> None:
        self.proc, self.role = proc, role

    @classmethod
    async def start(cls, python, model, role: str, socket: str = "", engine_id: str = ""):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO))
        proc = await asyncio.create_subprocess_exec(
            str(python), str(REPO / "tests" / "vllm_checks" / "engine_worker.py"),
            "--role", role, "--model", str(model), "--socket", socket, "--engine-id", engine_id,
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, limit=1 << 24)
        engine = cls(proc, role)
        await engine._expect_ready()
        return engine

    async def _expect_ready(self) -> None:
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 900)
            if not line:
                raise AssertionError(f"vLLM {self.role} exited before READY")
            if line.strip() == b"READY":
                return

    async def generate(self, prompt: list[int], max_tokens: int, dualpath=None) -> dict:
        self.proc.stdin.write((json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                           "dualpath": dualpath}) + "\n").encode())
        await self.proc.stdin.drain()
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 300)
            if not line:
                raise AssertionError(f"vLLM {self.role} died")
            if line.startswith(b"{"):
                return json.loads(line)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 60)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def conversation_text(python, model) -> list[int]:
    code = (
        "import json\nfrom transformers import AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({str(model)!r})\n"
        "text = ' '.join(f'Tool call {i}: read_file(\"src/pkg/mod_{i}.py\") returned {i*13} "
        "lines; the function parse_{i} calls helper_{i % 7} with limit {i*3}.' for i in range(90))\n"
        "print(json.dumps(tok(text)['input_ids']))\n")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300,
                         check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bytes_read(c) -> float:
    return sum(g.counters().get("bytes_read", 0.0) for g in c.gateways.values())


@pytest.mark.parametrize("side", ["pe", "de"])
async def test_multi_turn_greedy_outputs_equal_plain_vllm(tmp_path, side):
    python, model = require_vllm()
    text = conversation_text(python, model)
    overrides = {**sockets(tmp_path), "kv": {"preset": "smollm2-135m"},
                 "pe_receiver": {"buffer_bytes": 192 * MiB, "engines": 1,
                                 "engine_socket": str(tmp_path / "p0.sock")},
                 "de_loader": {"buffer_bytes": 192 * MiB, "engines": 1,
                               "engine_socket": str(tmp_path / "d0.sock")},
                 "gateway_service": {"staging_bytes": 32 * MiB, "max_batch_bytes": 8 * MiB}}
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=overrides) as c:
        engines = await asyncio.gather(
            Engine.start(python, model, "prefill", str(tmp_path / "p0.sock"), "p0.e0"),
            Engine.start(python, model, "decode", str(tmp_path / "d0.sock"), "d0.e0"),
            Engine.start(python, model, "plain"))
        prefill, decode, plain = engines
        try:
            await run_conversation(c, prefill, decode, plain, text, side)
        finally:
            for e in engines:
                await e.stop()


async def run_conversation(c, prefill, decode, plain, text, side) -> None:
    block_bytes = c.spec.full_block_bytes
    prompt, cursor = text[:400], 400
    for turn in range(TURNS):
        keys = block_keys_from_tokens(prompt, BT)
        hit_blocks = min(await c.stored_prefix(keys), (len(prompt) - 1) // BT)
        rid = f"{side}-t{turn}"
        before = bytes_read(c)
        c.pe["p0"].submit_plan(plan(c, rid, prompt, hit_blocks, side if hit_blocks else "none",
                                    gen=GEN, deadline=120.0))
        pre, dec, ref = await asyncio.gather(
            prefill.generate(prompt, 1, {"request_id": rid, "hit_tokens": hit_blocks * BT}),
            decode.generate(prompt, GEN, {"request_id": rid}),
            plain.generate(prompt, GEN))
        assert dec["tokens"] == ref["tokens"], f"turn {turn}: decode output != plain vLLM"
        assert pre["tokens"][0] == ref["tokens"][0], f"turn {turn}: prefill's first token"
        await until(lambda rid=rid: report(c.de["d0"], rid, "finished") is not None, timeout=60,
                    what=f"{rid} finished on the DE")
        if turn > 0:
            assert hit_blocks * BT >= 0.9 * len(prompt), f"turn {turn}: hit {hit_blocks * BT}"
        assert bytes_read(c) - before == hit_blocks * block_bytes
        last_context = len(prompt) + GEN
        # next turn: this prompt + its output + new text (an agent's tool result)
        prompt = prompt + dec["tokens"] + text[cursor:cursor + 230]
        cursor += 230
    assert last_context >= 1500
