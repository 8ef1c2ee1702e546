"""Real vLLM through dualpath when it cannot start: a model whose KV spec is not the
cluster's, a node service that is not there. (Services killed mid-request under real engines:
tests/test_vllm_faults.py.)
"""

from __future__ import annotations

import asyncio

import pytest

from tests.vllm_env import require_vllm
from tools.cluster.inprocess import local_datapath
from tools.vllm_engines import Engine, datapath_overrides

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


def overrides(tmp_path) -> dict:
    return datapath_overrides(tmp_path, buffer_mib=96)


async def test_kv_spec_mismatch_and_missing_node_refuse_to_start(tmp_path):
    """A connector whose cluster preset is not the model's KV (bf16 preset, fp32 model) or
    whose node socket has no service behind it: vLLM does not start, and the log names both
    specs / the socket."""
    _, model = require_vllm()
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=overrides(tmp_path)):
        # both at once (a load is mostly one core's work): each must refuse on its own
        spec, nowhere = await asyncio.gather(
            Engine.start(model, "prefill", tmp_path, "--socket", str(tmp_path / "p0.sock"),
                         "--engine-id", "p0.e0", "--preset", "smollm2-135m"),
            Engine.start(model, "decode", tmp_path, "--socket",
                         str(tmp_path / "nowhere.sock"), "--engine-id", "d0.e0"),
            return_exceptions=True)
        for started in (e for e in (spec, nowhere) if isinstance(e, Engine)):
            await started.stop()          # a regression: it started; stop it, then fail
    assert isinstance(spec, RuntimeError), spec
    assert "KVSpecMismatch" in str(spec) or "1536" in str(spec), str(spec)[-2000:]
    assert "768" in str(spec)
    assert isinstance(nowhere, RuntimeError), nowhere
    assert "nowhere.sock" in str(nowhere), str(nowhere)[-2000:]
