"""KV egress arbiter: the synthetic high-priority flow keeps at least ``1 - kv_share`` of the
emulated link while KV competes (shares of bytes granted, never wall-clock speeds)."""

from __future__ import annotations

import asyncio

import pytest

from common.config import build_config
from common.errors import ConfigError
from common.kv import block_keys_from_tokens
from common.protocol import Endpoint, RequestPlan
from services.node.arbiter import ArbiterConfig, EgressArbiter, run_collective
from tools.cluster.inprocess import local_datapath
from tests.helpers import until

MiB = 1 << 20
BT = 64


async def _compete(arb: EgressArbiter, collective_bytes: int, chunk: int) -> float:
    """Greedy KV flow vs one collective; the collective's share of the bytes granted while
    it ran."""
    stop = asyncio.Event()

    async def kv_flow():
        while not stop.is_set():
            await arb.kv(chunk)

    flow = asyncio.ensure_future(kv_flow())
    await arb.kv(chunk)                           # KV is already flowing when it starts
    kv0, hi0 = arb.counters["kv_bytes"], arb.counters["high_bytes"]
    await run_collective(arb, collective_bytes, chunk)
    kv, hi = arb.counters["kv_bytes"] - kv0, arb.counters["high_bytes"] - hi0
    stop.set()
    await flow
    return hi / (hi + kv)


async def test_high_priority_keeps_its_share_while_kv_competes():
    cfg = ArbiterConfig(enabled=True, link_rate_bytes_per_s=64 * MiB, link_burst_bytes=256 << 10,
                        kv_share=0.1, chunk_bytes=256 << 10)
    share = await _compete(EgressArbiter(cfg), 12 * MiB, 256 << 10)
    assert share >= 1 - cfg.kv_share - 0.05, share


async def test_without_the_cap_kv_takes_a_fair_half():
    cfg = ArbiterConfig(enabled=False, link_rate_bytes_per_s=64 * MiB,
                        link_burst_bytes=256 << 10, kv_share=0.1, chunk_bytes=256 << 10)
    share = await _compete(EgressArbiter(cfg), 8 * MiB, 256 << 10)
    assert share < 0.75, share          # contention is real: the cap is what protects it


async def test_an_engines_collective_engages_the_cap():
    """Production caller of ``high_priority()``: an engine's announced collective
    (``services.engine_api.collectives``) caps KV at ``kv_share``; its end lifts the cap."""
    from services.engine_api.collectives import Collectives
    cfg = ArbiterConfig(enabled=True, link_rate_bytes_per_s=64 * MiB, link_burst_bytes=256 << 10,
                        kv_share=0.1, chunk_bytes=256 << 10)
    arb = EgressArbiter(cfg)
    collectives = Collectives(arb, max_hold_s=30.0)
    await arb.kv(256 << 10)
    assert arb.counters["kv_capped_waits"] == 0
    collectives.begin("p0.e0")
    await arb.kv(256 << 10)
    assert arb.counters["kv_capped_waits"] == 1 and arb.stats()["arbiter_high_active"] == 1
    collectives.end("p0.e0")
    await arb.kv(256 << 10)
    assert arb.counters["kv_capped_waits"] == 1 and not arb.high_active
    stop = asyncio.Event()
    granted: list[int] = []

    async def collective():               # the high flow an engine's collective sends
        collectives.begin("p0.e0")
        try:
            await arb.high(24 * MiB)
        finally:
            # the bytes granted while it ran (as ``_compete``): KV's next chunk, uncapped
            # once it ended, is not the cap's (ci104 counted it: 0.842 on the loaded host)
            granted[:] = [arb.counters["kv_bytes"] - kv0, arb.counters["high_bytes"] - hi0]
            collectives.end("p0.e0")
        stop.set()

    async def kv_flow():
        while not stop.is_set():
            await arb.kv(256 << 10)

    kv0, hi0 = arb.counters["kv_bytes"], arb.counters["high_bytes"]
    await asyncio.gather(collective(), kv_flow())
    kv, hi = granted
    assert hi / (hi + kv) >= 1 - cfg.kv_share - 0.05, (hi, kv)


def test_arbiter_config_is_checked():
    with pytest.raises(ValueError):
        ArbiterConfig(enabled=True)                        # a share of what rate?
    with pytest.raises(ConfigError, match="kv_share"):
        build_config({"kv_share": 0}, ArbiterConfig, environ={})
    assert not EgressArbiter(ArbiterConfig()).active       # real fabric: no pacing at all


async def test_collective_keeps_its_share_against_real_de_path_kv(tmp_path):
    """DE→PE layer streams (real UCX) and a collective share the DE node's emulated CNIC."""
    arb = {"enabled": True, "link_rate_bytes_per_s": 24 * MiB, "link_burst_bytes": 64 << 10,
           "kv_share": 0.1, "chunk_bytes": 64 << 10, "charge_h2d": False}
    async with local_datapath(tmp_path, scheduler=False, overrides={"arbiter": arb}) as c:
        de, pe = c.de["d0"], c.pe["p0"]
        ep = Endpoint("d0", "de_loader", "127.0.0.1", de.rpc_port, *de.ucx_address)
        rids = []
        for i in range(6):
            toks = [(i * 131 + j) % 40_000 for j in range(8 * BT + 5)]
            keys = block_keys_from_tokens(toks, BT)
            await c.store_blocks(keys[:8])
            rids.append(f"q{i}")
            pe.submit_plan(RequestPlan(f"q{i}", 0, f"s{i}", "p0.e0", "p0", "d0.e0", "d0", "de",
                                       "d0", 8 * BT, 5, 2, 1 << 20, keys[:8], [], ep, None,
                                       30.0, toks[8 * BT:]))
        a = de.arbiter
        await until(lambda: a.counters["kv_bytes"] >= 256 << 10, 60, "the pulls to stream")
        start = a.counters["high_bytes"]
        collective = asyncio.ensure_future(run_collective(a, 12 * MiB, 64 << 10))
        # Steady state: KV reserved before the collective began drains first (a link
        # cannot take back bytes already on it), so the window opens 2 MiB in.
        await until(lambda: a.counters["high_bytes"] - start >= 2 * MiB, 60,
                    "the window to open 2 MiB into the collective", interval=0.002)
        kv0, hi0 = a.counters["kv_bytes"], a.counters["high_bytes"]
        await collective
        kv, hi = a.counters["kv_bytes"] - kv0, a.counters["high_bytes"] - hi0
        assert hi / (hi + kv) >= 1 - 0.1 - 0.05, (hi, kv)
        assert kv > 0                                       # KV is slowed, never starved
        await until(lambda: sum(r.stage == "finished" for r in de.reports) >= len(rids), 60,
                    "every request to finish", interval=0.01)
        counters = c.engine_counters()
        assert counters["verified_requests"] == len(rids)
        assert counters.get("prompt_mismatches", 0) == 0
        assert not any(c.leaks().values())


async def test_the_emulator_announces_its_collectives_per_layer_and_step(tmp_path):
    """``engine_sim.collective_fraction``: every emulated layer (prefill) and decode step
    begins and ends a collective on its node; none stays open; the bytes still verify."""
    async with local_datapath(tmp_path, scheduler=False,
                              overrides={"engine_sim": {"collective_fraction": 0.5}}) as c:
        de, pe = c.de["d0"], c.pe["p0"]
        ep = Endpoint("d0", "de_loader", "127.0.0.1", de.rpc_port, *de.ucx_address)
        toks = [(j * 7) % 40_000 for j in range(2 * BT + 5)]
        keys = block_keys_from_tokens(toks, BT)
        await c.store_blocks(keys[:2])
        pe.submit_plan(RequestPlan("c0", 0, "s0", "p0.e0", "p0", "d0.e0", "d0", "pe", "p0",
                                   2 * BT, 5, 3, 1 << 20, keys[:2], [], ep, None, 30.0,
                                   toks[2 * BT:]))
        await until(lambda: any(r.stage == "finished" for r in de.reports), 60, "finished")
        for node in (pe, de):
            stats = node.stats()
            assert stats["collectives_begun"] == stats["collectives_ended"] > 0
            assert stats["collectives_engines_active"] == 0 and not node.arbiter.high_active
        assert pe.stats()["collectives_begun"] == c.spec.num_layers     # one forward
        assert c.engine_counters()["verified_requests"] == 1
        assert not any(c.leaks().values())
