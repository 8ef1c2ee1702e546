"""Data path in one process: gateways, scheduler, PE receiver, DE loader and engines on
loopback with real UCX (``tools.cluster.inprocess``).

Checks the issue's claims: the prefill engine sees exactly the stored hit KV on both read
paths; the DE's full prompt KV is stored hit + computed new KV; write-back makes the next
turn hit exactly the expected prefix; a missing block shortens the hit; deadline, bad input
and revocation leave every page pool empty. Conditions are polled, never slept for.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common.errors import (DeadlineExceeded, DualpathError, InvalidArgument, KVSpecMismatch,
                           NotFound)
from common.kv import block_keys_from_tokens
from common.protocol import (AbortDecode, DataPathReply, Endpoint, LayerSlots, PrepareDecode,
                             PullLayers, RequestFinished, RequestPlan, Revocation)
from common.rpc import RpcClient
from services.engine_api.decode import DecodePort
from services.engine_api.prefill import PrefillPort
from tools.engine_sim.kv_pattern import fill_tokens, token_id
from tools.cluster.inprocess import local_datapath
from services.scheduler.client.client import SchedulerClient
from tests.helpers import until

BT = 64


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


def endpoint(svc) -> Endpoint:
    return Endpoint(svc.node_id, svc.name, "127.0.0.1", svc.rpc_port, *svc.ucx_address)


def plan(c, rid: str, toks: list[int], hit_blocks: int, read_side: str, *, gen: int = 3,
         deadline: float = 10.0, attempt: int = 0, split_blocks: int = 0) -> RequestPlan:
    """``read_side`` "split": the DE reads the leading ``split_blocks``, the PE the rest."""
    keys = block_keys_from_tokens(toks, BT)
    n_full = len(toks) // BT
    de = c.de["d0"]
    read_node = {"pe": "p0", "de": "d0", "split": "p0"}.get(read_side, "")
    return RequestPlan(rid, attempt, "sess", "p0.e0", "p0", "d0.e0", "d0", read_side, read_node,
                       hit_blocks * BT, len(toks) - hit_blocks * BT, gen, 1 << 20,
                       keys[:hit_blocks], keys[hit_blocks:], endpoint(de), None, deadline,
                       toks[n_full * BT:], split_tokens=split_blocks * BT)


def report(svc, rid: str, stage: str):
    return next((r for r in svc.reports if r.request_id == rid and r.stage == stage), None)


async def no_leaks(c) -> None:
    await until(lambda: not any(c.leaks().values()) and not c.pe["p0"].attempts
                and not c.de["d0"].attempts, timeout=30,
                what=lambda: f"pools empty (used pages {c.leaks()}, attempts "
                             f"{list(c.pe['p0'].attempts)} / {list(c.de['d0'].attempts)})")


# ---------------------------------------------------------------- through the scheduler

# every page by one-sided RMA: reads from the gateways (not pread into the node's segment),
# PE -> DE forwards, DE -> PE pulls and write-backs (docs/datapath.md "One-sided RMA")
RMA = {"transport": {"kv_mode": "rma", "same_host": "ucx"}, "gateway": {"shm": False}}
# every hit read on both links at once (docs/datapath.md "Split reads"). The split levels the
# two links' keys, which the scheduler's own count and the gateways' read-queue reports set:
# with the write-back charge off (write_weight 0) and no reports after the first (one per
# hour), the keys differ by under a block whatever order the sessions are placed in, so every
# later turn's hit splits. (A stale report — p0's queue sampled mid-read, arriving after the
# reads were done — kept one hit on one link beside the real-engine tests.)
QUIET_QUEUES = {"telemetry_interval_s": 3600.0}
SPLIT = {"scheduler": {"policy": "dualpath", "split_reads": True, "split_min_blocks": 1,
                       "write_weight": 0.0},
         "pe_receiver": QUIET_QUEUES, "de_loader": QUIET_QUEUES}


@pytest.mark.parametrize("paths", [{}, RMA, SPLIT], ids=["default", "rma", "split"])
async def test_turns_hit_what_the_previous_turns_wrote_on_both_paths(tmp_path, paths):
    """Two sessions x 3 turns (``dpl``: read sides alternate; ``split``: each hit read on
    both links): every hit is measured from storage and equals the prefix the earlier turns'
    write-back predicts, byte-checked."""
    overrides = {**paths, **{svc: {**paths.get(svc, {}), "engines": 2}
                             for svc in ("pe_receiver", "de_loader")}}
    async with local_datapath(tmp_path, overrides=overrides) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched:
        prompts = {s: tokens(300 + 40 * s, s) for s in range(2)}
        stored: dict[int, int] = {s: 0 for s in prompts}     # blocks the test expects stored
        sides = set()
        for turn in range(3):
            async def one(s: int, turn: int = turn):  # awaited in this turn; bound for clarity
                toks = prompts[s]
                keys = block_keys_from_tokens(toks, BT)
                expect_hit = min(stored[s], (len(toks) - 1) // BT) * BT
                assert await c.stored_prefix(keys) >= stored[s]
                ev = await sched.run(f"s{s}t{turn}", f"sess{s}", len(toks), 70, token_ids=toks,
                                     deadline_s=30)
                assert isinstance(ev, RequestFinished), ev
                assert ev.hit_tokens == expect_hit
                out = ev.output_token_ids
                assert len(out) == 70 and out[0] == token_id(f"sess{s}", len(toks))
                # stored now: the prompt's full blocks + blocks of (tail + output[:-1])
                stored[s] = (len(toks) + len(out) - 1) // BT
                assert await c.stored_prefix(
                    block_keys_from_tokens(toks + out, BT)) == stored[s]
                prompts[s] = toks + out + tokens(50, 100 * turn + s)
            await asyncio.gather(*(one(s) for s in prompts))
        for svc in c.pe.values():
            sides.update(r.stage for r in svc.reports)
        counters = c.engine_counters()
        assert counters["verified_requests"] == 6 and counters.get("prompt_mismatches", 0) == 0
        assert counters["verified_layers"] > 0 and counters.get("hit_mismatches", 0) == 0
        assert c.de["d0"].counters["layers_pulled"] > 0          # the DE path ran
        assert c.gateways["p0"].store.stats()["bytes_read"] > 0  # the PE path ran
        if paths is SPLIT:
            assert c.scheduler.core.reads.split_reads == 4          # the later turns' hits
            assert c.gateways["d0"].store.stats()["bytes_read"] > 0
        elif paths:
            services = [*c.pe.values(), *c.de.values(), *c.gateways.values()]
            got = {s.node_id + "/" + type(s).__name__: s.transport.stats() for s in services}
            receivers = [c.pe["p0"], c.de["d0"], c.gateways["d0"]]   # d0's takes write-backs
            assert all(s.transport.stats()["rma_transfers_received"] > 0 for s in receivers), got
            assert all(st["messages_received"] == 0 for st in got.values()), got
            assert sum(st["rma_transfers_received"] for st in got.values()) == \
                sum(st["rma_transfers_sent"] for st in got.values())
        await no_leaks(c)


async def six_sessions_finish(sched, prefix: str, seed: int) -> None:
    """Six 256-token sessions submitted at once through the scheduler; every one finishes."""
    toks = [tokens(4 * BT, seed + i) for i in range(6)]
    events = await asyncio.gather(*(sched.run(f"{prefix}{i}", f"s{i}", len(t), 3, token_ids=t,
                                              deadline_s=30) for i, t in enumerate(toks)))
    assert all(isinstance(ev, RequestFinished) for ev in events), events


async def test_the_scheduler_sends_a_pe_no_more_prompts_than_its_buffer_holds(tmp_path,
                                                                             monkeypatch):
    """``pe_buffer_admission`` (on by default). A PE buffer of 8 pages (64 KiB; a 256-token
    test-small prompt's KV fills 4) and a β that would admit every request: six sessions at
    once all finish, and the PE never held more than two attempts — the rest waited in the
    scheduler's PE queue. (Without the check all six reach the PE, and four wait at its pool,
    each up to ``alloc_timeout_s``, then fail and are re-planned, three times at most.)"""
    from services.pe_receiver.service import PEReceiverService
    held: list[int] = []
    real = PEReceiverService.submit_plan

    def counting(self, plan):
        att = real(self, plan)
        held.append(len(self.attempts))
        return att

    monkeypatch.setattr(PEReceiverService, "submit_plan", counting)
    cfg = {"pe_receiver": {"buffer_bytes": 8 * 64 * 1024},
           "scheduler": {"beta_tokens": 10**6, "pe_buffer_admission": True}}
    async with local_datapath(tmp_path, overrides=cfg) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched:
        pe = c.pe["p0"]
        assert pe.engine_hbm() == 8 * pe.pool.page_bytes == 8 * 64 * 1024
        await six_sessions_finish(sched, "b", 40)
        assert len(held) == 6 and max(held) <= 2, held
        await no_leaks(c)
        assert [load.free_hbm_bytes for load in pe.engine_loads()] == [pe.engine_hbm()]


async def test_pe_telemetry_reports_its_buffer_share_less_what_its_attempts_hold(tmp_path):
    async with local_datapath(tmp_path, scheduler=False, engines=False) as c:
        pe = c.pe["p0"]
        share, page = pe.engine_hbm(), pe.pool.page_bytes
        toks = tokens(2 * BT + 9, 21)              # 137 tokens x 1 KiB: 3 pages of 64 KiB
        pe.submit_plan(plan(c, "fb", toks, 0, "none"))
        [load] = pe.engine_loads()
        assert (load.engine_id, load.seq, load.free_hbm_bytes) == ("p0.e0", 1, share - 3 * page)
        h = await asyncio.wait_for(pe.ports["p0.e0"].next_request(), 5)
        await h.fail(None)
        await no_leaks(c)
        assert pe.engine_loads()[0].free_hbm_bytes == share


@pytest.mark.parametrize("engines", [1, 2])
async def test_the_scheduler_binds_a_decode_node_no_more_prompts_than_its_buffer_holds(
        tmp_path, monkeypatch, engines):
    """The decode side of buffer admission: a DE buffer of 9 pages (a 256-token test-small
    prompt's KV fills 4, its HBM need with the generated tokens a little more), a PE buffer and
    a β that would take every request: six sessions at once all finish, and no binding ever
    committed the buffer past its 9 pages (pages held plus those of bound attempts not yet
    allocated) — the rest waited in the scheduler's DE group queue. (Without the check all six
    are bound at once, 24 pages; those past the buffer wait at its pool while their PE's
    ``PrepareDecode`` runs out of time: seen in ``bench engine_agents``.) With two decode
    engines on the node, each is free to take the whole buffer until the scheduler counts
    their bindings off the one buffer figure (protocol v7). An attempt whose region is already
    freed may still be live, so live attempts are not the measure."""
    from services.de_loader.service import DELoaderService
    committed: list[int] = []
    real = DELoaderService.bind

    def counting(self, b):
        att = real(self, b)
        per_token = self.spec.bytes_per_token
        pending = sum(self.pool.pages_for(a.binding.prompt_tokens * per_token)
                      for a in self.attempts.values()
                      if a.region is None and a.binding is not None and not a.done)
        committed.append(self.pool.num_pages - self.pool.free_pages + pending)
        return att

    monkeypatch.setattr(DELoaderService, "bind", counting)
    cfg = {"de_loader": {"buffer_bytes": 9 * 64 * 1024, "engines": engines},
           "pe_receiver": {"buffer_bytes": 64 * 64 * 1024},
           "scheduler": {"beta_tokens": 10**6}}
    async with local_datapath(tmp_path, overrides=cfg) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched:
        de = c.de["d0"]
        assert de.pool.num_pages * de.pool.page_bytes == 9 * 64 * 1024
        await six_sessions_finish(sched, "d", 60)
        assert len(committed) == 6 and max(committed) <= 9, committed
        await no_leaks(c)
        # registered as the buffer (smaller than the engine's HBM here), reported free
        assert [(load.free_hbm_bytes, load.buffer_free_bytes) for load in de.engine_loads()] \
            == [(de.engine_hbm(), 9 * 64 * 1024)] * engines and de.engine_hbm() == 9 * 64 * 1024
        # a prompt whose KV the buffer cannot hold is refused typed at submit, never bound
        big = tokens(10 * BT, 99)
        with pytest.raises(InvalidArgument, match="DE buffer"):
            await sched.run("too-big", "s-big", len(big), 3, token_ids=big, deadline_s=30)


async def test_de_telemetry_reports_its_hbm_and_its_nodes_free_buffer_less_what_is_bound(
        tmp_path):
    """Each decode engine's own HBM (registered as at most the node's DE buffer) less what is
    bound to it, and — protocol v7 — the node's free buffer less the pages of bound attempts
    not allocated yet, which the scheduler holds all of the node's engines to."""
    from common.protocol import DecodeBinding

    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides={"de_loader": {"engines": 2}}) as c:
        de = c.de["d0"]
        page, free = de.pool.page_bytes, de.pool.num_pages * de.pool.page_bytes
        hbm = de.settings.hbm_capacity_bytes
        assert free < hbm and de.engine_hbm() == free
        assert [(load.free_hbm_bytes, load.buffer_free_bytes) for load in de.engine_loads()] \
            == [(free, free)] * 2
        need = 137 * de.spec.bytes_per_token + 3 * 1024  # 137 prompt tokens x 1 KiB: 3 pages
        att = de.bind(DecodeBinding("tb", 0, "sess", "d0.e0", 137, 0, 3, need, deadline_s=30.0))
        loads = {load.engine_id: load for load in de.engine_loads()}
        assert (loads["d0.e0"].seq, loads["d0.e0"].free_hbm_bytes) == (1, free - need)
        assert (loads["d0.e1"].seq, loads["d0.e1"].free_hbm_bytes) == (0, free)
        assert {load.buffer_free_bytes for load in loads.values()} == {free - 3 * page}
        att.drop("test: released")
        await until(lambda: not de.attempts, timeout=10, what="the attempt to end")
        assert [(load.free_hbm_bytes, load.buffer_free_bytes) for load in de.engine_loads()] \
            == [(free, free)] * 2


# ---------------------------------------------------------------- byte-exact, engine API level

class RecordingEngines:
    """A prefill and a decode engine written against the engine API that keep every byte."""

    def __init__(self, c) -> None:
        self.c, self.spec = c, c.spec
        self.seen: dict[int, np.ndarray] = {}
        self.written: dict[int, np.ndarray] = {}
        self.prompt_kv: list[np.ndarray] = []
        self.hit = None
        self.tasks = [asyncio.ensure_future(self.prefill(c.pe["p0"].ports["p0.e0"])),
                      asyncio.ensure_future(self.decode(c.de["d0"].ports["d0.e0"]))]

    async def prefill(self, port: PrefillPort) -> None:
        h = await port.next_request()
        self.hit, info = h.hit_tokens, h.info
        for layer in range(self.spec.num_layers):
            self.seen[layer] = (await h.layer(layer)).copy()
            fill_tokens(h.output(layer), self.spec, info.block_keys, info.tail_key, layer,
                        h.hit_tokens, info.prompt_tokens)
            self.written[layer] = h.output(layer).copy()
            await h.put_layer(layer)
        await h.finish(first_token_id=11)

    async def decode(self, port: DecodePort) -> None:
        req = await port.next_ready()
        self.prompt_kv = [req.layer(layer).copy() for layer in range(self.spec.num_layers)]
        await req.took_kv()
        await req.second_token()
        await req.finish([req.first_token_id, 12, 13])

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def stored_bytes(c, keys: list[str]) -> np.ndarray:
    """The Full Blocks as the store holds them, read back ``[n, L, T, B]``."""
    spec = c.spec
    buf = np.zeros((len(keys), spec.full_block_bytes), np.uint8)
    res = await c.gateways["p0"].store.read_blocks(keys, [buf[i] for i in range(len(keys))])
    assert all(res.found)
    return buf.reshape(len(keys), spec.num_layers, BT, spec.kv_bytes_per_token_per_layer)


@pytest.mark.parametrize("side", ["pe", "de", "split"])
async def test_engines_see_stored_hit_and_decode_gets_hit_plus_new(tmp_path, side):
    """Split: the DE reads block 0 and streams it, the PE reads blocks 1-2 and forwards them
    with the new tokens — each gateway read only its part, and both engines see every byte."""
    async with local_datapath(tmp_path, scheduler=False, engines=False) as c:
        toks = tokens(3 * BT + 40, 5)
        keys = block_keys_from_tokens(toks, BT)
        await c.store_blocks(keys[:3])
        read_before = {n: g.store.stats()["bytes_read"] for n, g in c.gateways.items()}
        eng = RecordingEngines(c)
        try:
            c.pe["p0"].submit_plan(plan(c, "r1", toks, 3, side, split_blocks=int(side == "split")))
            await asyncio.wait_for(asyncio.gather(*eng.tasks), 10)
        finally:
            await eng.close()
        read = {n: g.store.stats()["bytes_read"] - read_before[n] for n, g in c.gateways.items()}
        stored = await stored_bytes(c, keys[:3])
        assert eng.hit == 3 * BT
        for layer in range(c.spec.num_layers):
            want_hit = stored[:, layer].reshape(3 * BT, -1)
            assert np.array_equal(eng.seen[layer], want_hit)                 # PE saw storage
            assert np.array_equal(eng.prompt_kv[layer][:3 * BT], want_hit)   # DE: stored hit
            assert np.array_equal(eng.prompt_kv[layer][3 * BT:], eng.written[layer])  # + new
        await until(lambda: report(c.de["d0"], "r1", "finished") is not None, what="finished")
        fin = report(c.de["d0"], "r1", "finished")
        assert fin.tokens == 3 and fin.output_token_ids == [11, 12, 13]
        assert report(c.pe["p0"], "r1", "prefill_done") is not None
        assert report(c.pe["p0"], "r1", "read_done") is not None
        assert (c.de["d0"].counters["layers_pulled"] > 0) == (side != "pe")
        block = c.spec.full_block_bytes
        assert read == {"pe": {"p0": 3 * block, "d0": 0}, "de": {"p0": 0, "d0": 3 * block},
                        "split": {"p0": 2 * block, "d0": block}}[side]
        await no_leaks(c)


@pytest.mark.parametrize("side, split", [("pe", 0), ("de", 0), ("split", 2), ("split", 3)])
async def test_missing_block_shortens_the_hit_and_is_recomputed(tmp_path, side, split):
    """A split read at block 2 loses the PE's part (its first block is gone); at block 3 the
    DE's part ends at the gap, and the PE's part behind it is not used."""
    async with local_datapath(tmp_path, scheduler=False) as c:
        toks = tokens(5 * BT + 10, 9)
        keys = block_keys_from_tokens(toks, BT)
        await c.store_blocks(keys[:4])
        assert await c.gateways["p0"].store.delete(keys[2])           # evicted since lookup
        c.pe["p0"].submit_plan(plan(c, "r2", toks, 4, side, split_blocks=split))
        await until(lambda: report(c.de["d0"], "r2", "finished") is not None, what="finished")
        svc = c.pe["p0"] if side == "pe" or split == 2 else c.de["d0"]
        assert svc.counters["hit_shortened"] == 1
        counters = c.engine_counters()
        assert counters["verified_requests"] == 1 and counters.get("prompt_mismatches", 0) == 0
        assert counters["verified_layers"] == c.spec.num_layers          # 2 blocks, checked
        assert await c.stored_prefix(keys) == 5                          # rewritten from 2 on
        await no_leaks(c)


async def test_de_path_pulls_stay_within_the_lookahead_of_the_engine(tmp_path):
    """DE→PE streaming is paced by consumption: never more than lookahead layers ahead."""
    cfg = {"pe_receiver": {"lookahead_layers": 1, "layers_per_pull": 1, "pulls_in_flight": 1}}
    async with local_datapath(tmp_path, scheduler=False, engines=False, overrides=cfg) as c:
        toks = tokens(2 * BT + 3, 13)
        keys = block_keys_from_tokens(toks, BT)
        await c.store_blocks(keys[:2])
        att = c.pe["p0"].submit_plan(plan(c, "la", toks, 2, "de"))
        h = await asyncio.wait_for(c.pe["p0"].ports["p0.e0"].next_request(), 5)
        await h.layer(0)                                    # consumed: layer 0
        await until(lambda: att.layer_arrival[1] is not None, what="layer 1 (look-ahead)")
        for _ in range(20):                                 # let it run: no third pull may start
            await asyncio.sleep(0)
        assert att.layer_requested[2] is None               # 1 consumed + 1 ahead, no more
        await h.layer(1)
        await until(lambda: att.layer_requested[2] is not None, what="layer 2 pulled")
        assert att.layer_requested[3] is None
        await h.fail(None)
        await no_leaks(c)


# ---------------------------------------------------------------- failures and bad input

async def test_deadline_during_the_de_read_fails_retryable_and_frees_both(tmp_path):
    async with local_datapath(tmp_path, scheduler=False) as c:
        stuck = asyncio.Event()

        async def never(region, info):
            stuck.set()
            await asyncio.Event().wait()

        c.de["d0"].hit_source = never
        toks = tokens(3 * BT + 1, 3)
        c.pe["p0"].submit_plan(plan(c, "r3", toks, 3, "de", deadline=0.5))
        await until(stuck.is_set, what="DE read started")
        await until(lambda: report(c.pe["p0"], "r3", "failed") is not None, what="failure")
        failed = report(c.pe["p0"], "r3", "failed")
        assert failed.code == "DEADLINE_EXCEEDED" and failed.retryable
        assert failed.hop == "de_loader"
        await no_leaks(c)


async def test_bad_plans_and_calls_allocate_nothing(tmp_path):
    async with local_datapath(tmp_path, scheduler=False) as c:
        pe, de = c.pe["p0"], c.de["d0"]
        toks = tokens(2 * BT + 5, 4)
        good = plan(c, "r4", toks, 1, "de")
        import msgspec
        with pytest.raises(InvalidArgument, match="engine"):
            pe.submit_plan(msgspec.structs.replace(good, pe_engine="p0.e9"))
        with pytest.raises(InvalidArgument, match="DE loader"):
            pe.submit_plan(msgspec.structs.replace(good, de_loader=None))
        with pytest.raises(InvalidArgument):
            pe.submit_plan(msgspec.structs.replace(good, hit_tokens=70))
        assert pe.pool.used_pages == 0 and not pe.attempts

        keys = block_keys_from_tokens(toks, BT)
        prep = PrepareDecode("r5", 0, "s", "d0.e0", "p0", "de", len(toks), BT, 3, keys[:1],
                             keys[1:], *pe.ucx_address, toks[2 * BT:], None, 5.0)
        async with RpcClient(c.cfg.rpc, "127.0.0.1", de.rpc_port, role="test", node_id="t",
                             reply_type=DataPathReply, kv_fingerprint=c.spec.fingerprint()) as rpc:
            with pytest.raises(InvalidArgument, match="engine"):
                await rpc.call(msgspec.structs.replace(prep, de_engine="d0.e7"))
            with pytest.raises(InvalidArgument):
                await rpc.call(msgspec.structs.replace(prep, hit_tokens=5 * BT))
            with pytest.raises(NotFound):
                await rpc.call(PullLayers("nope", 0, []))
            assert de.pool.used_pages == 0
            await c.store_blocks(keys[:1])
            await rpc.call(prep)
            assert de.pool.used_pages > 0
            att = de.attempts[("r5", 0)]
            await until(lambda: att.core.read_done, what="DE read done")
            with pytest.raises(InvalidArgument, match="out of range"):
                await rpc.call(PullLayers("r5", 0, [LayerSlots(99, 1, [(0, BT * 256)])]))
            with pytest.raises(InvalidArgument, match="hit"):
                await rpc.call(PullLayers("r5", 0, [LayerSlots(0, 1, [(0, 10)])]))
            assert (await rpc.call(AbortDecode("r5", 0, "test"))).aborted
        other = "0" * 16                                 # another model's KV layout
        bad = RpcClient(c.cfg.rpc, "127.0.0.1", de.rpc_port, role="test", node_id="t2",
                        reply_type=DataPathReply, kv_fingerprint=other)
        with pytest.raises(KVSpecMismatch):
            await bad.call(msgspec.structs.replace(prep, request_id="r8"))
        await bad.close()
        assert ("r8", 0) not in de.attempts
        await no_leaks(c)


async def test_revocation_drops_both_sides_without_reporting(tmp_path):
    async with local_datapath(tmp_path, scheduler=False, engines=False) as c:
        toks = tokens(2 * BT + 5, 6)
        keys = block_keys_from_tokens(toks, BT)
        await c.store_blocks(keys[:2])
        c.pe["p0"].submit_plan(plan(c, "r6", toks, 2, "pe"))
        await until(lambda: len(c.pe["p0"].ports["p0.e0"]) == 1, what="queued for the engine")
        assert c.de["d0"].pool.used_pages > 0 and c.pe["p0"].pool.used_pages > 0
        for svc in (c.pe["p0"], c.de["d0"]):
            svc.revoke(Revocation("r6", 0, "re-planned"))
        await no_leaks(c)
        assert report(c.pe["p0"], "r6", "failed") is None
        assert report(c.de["d0"], "r6", "failed") is None


async def test_engine_failure_is_reported_with_its_hop(tmp_path):
    async with local_datapath(tmp_path, scheduler=False, engines=False) as c:
        toks = tokens(BT + 5, 8)
        c.pe["p0"].submit_plan(plan(c, "r7", toks, 0, "none"))
        h = await asyncio.wait_for(c.pe["p0"].ports["p0.e0"].next_request(), 5)
        await h.layer(0)
        await h.fail(DeadlineExceeded("engine ran out of time"))
        await until(lambda: report(c.pe["p0"], "r7", "failed") is not None, what="failure")
        failed = report(c.pe["p0"], "r7", "failed")
        assert failed.hop == "engine" and failed.retryable
        with pytest.raises(DualpathError):
            await h.put_layer(0)
        await no_leaks(c)


async def test_decode_engine_failure_is_reported_and_frees_the_de(tmp_path):
    async with local_datapath(tmp_path, scheduler=False, engines=False) as c:
        eng = RecordingEngines(c)
        eng.tasks[1].cancel()

        async def give_up():
            port = c.de["d0"].ports["d0.e0"]
            req = await port.next_ready()
            await req.fail(DeadlineExceeded("decode engine out of HBM time"))
            with pytest.raises(DualpathError):
                await req.took_kv()
        eng.tasks[1] = asyncio.ensure_future(give_up())
        try:
            c.pe["p0"].submit_plan(plan(c, "r9", tokens(BT + 9, 2), 0, "none"))
            await asyncio.wait_for(asyncio.gather(*eng.tasks), 10)
        finally:
            await eng.close()
        await until(lambda: report(c.de["d0"], "r9", "failed") is not None, what="failure")
        failed = report(c.de["d0"], "r9", "failed")
        assert failed.hop == "engine" and failed.code == "DEADLINE_EXCEEDED"
        await no_leaks(c)


async def test_scheduler_replans_a_failed_attempt_and_the_request_finishes(tmp_path,
                                                                          monkeypatch):
    """A retryable node-side failure re-plans: the next attempt finishes the request."""
    from common.errors import Unavailable
    from services.de_loader.attempt import DecodeAttempt

    real, calls = DecodeAttempt.prepare, []

    async def flaky(self, msg, info):
        calls.append(msg.attempt)
        if len(calls) == 1:
            raise Unavailable("DE buffer briefly unavailable (injected)")
        return await real(self, msg, info)

    monkeypatch.setattr(DecodeAttempt, "prepare", flaky)
    async with local_datapath(tmp_path) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched:
        toks = tokens(3 * BT + 9, 12)
        ev = await sched.run("w0", "sw", len(toks), 3, token_ids=toks, deadline_s=20)
        first = c.scheduler.core.attempt_base           # this scheduler epoch's first attempt
        assert isinstance(ev, RequestFinished) and ev.attempt == first + 1, ev
        assert calls == [first, first + 1]
        failed = report(c.pe["p0"], "w0", "failed")
        assert failed is None          # reports went to the scheduler, not kept locally
        await no_leaks(c)
