"""The one-sided RMA path of the page transport (``transport.kv_mode``,
``common/transport/rma_path.py``, docs/datapath.md "One-sided RMA"): byte-exact transfers
put straight into the receiver's registered arena, which links and transfers take it, and a
peer killed mid-transfer on either side (real child processes). The bindings themselves:
tests/test_transport_rma.py.

On this host UCX has no one-sided transport (the puts go over tcp/lo and are written by the
target's progress), so ``kv_mode = "auto"`` never picks RMA here and these tests set
``"rma"``; same-host links keep the one-copy path unless ``same_host = "ucx"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal

import numpy as np
import pytest

from common.buffers import PagePool
from common.config import TransportConfig
from common.errors import PeerFailed
from common.transport import PageTransport
from common.transport.plan import TransferHello, rma_link
from common.transport import rma_path
from common.transport.rma_path import tls_allows_ib
from tests.helpers import until
from tests.peer_proc import PeerProc, gapped
from tests.test_transport_shm import move as shm_move
from tests.transport_peer import gather, pattern

KIB, MIB = 1024, 1024 * 1024
PAGE = 64 * KIB
RMA = {"staging_bytes": 32 * MIB, "kv_mode": "rma", "same_host": "ucx"}


@pytest.fixture
def pools():
    made = [PagePool(PAGE, 256, name=f"r{i}") for i in range(2)]
    try:
        yield made
    finally:
        for p in made:
            assert p.counters()[f"{p.name}_allocations_live"] == 0, "pages leaked"
            p.close()


@contextlib.asynccontextmanager
async def pair(pools, cfg_a: dict | None = None, cfg_b: dict | None = None):
    a = PageTransport(TransportConfig(**(cfg_a or RMA)), "a", shm_arena=pools[0].arena)
    b = PageTransport(TransportConfig(**(cfg_b or RMA)), "b", shm_arena=pools[1].arena)
    async with a, b:
        yield a, b


async def move(rx: PageTransport, tx: PageTransport, arena: np.ndarray, slots, seed: int,
               split: int = 1) -> None:
    await shm_move(rx, tx, arena, slots, seed, split, deadline_s=20.0)   # puts over tcp/lo


def _hello(mode: str, dma: bool = False, rkey: bytes = b"k") -> TransferHello:
    return TransferHello(1, "n", "h", 1, 1, 1, rma_mode=mode, rma_dma=dma, rma_rkey=rkey)


def test_which_links_use_rma():
    assert rma_link(_hello("rma"), _hello("rma"))
    assert not rma_link(_hello("rma"), _hello("tag"))
    assert not rma_link(_hello("rma"), _hello(""))            # a peer without RMA
    assert not rma_link(_hello("auto"), _hello("auto"))       # no verbs: tags are faster
    assert rma_link(_hello("auto", True), _hello("rma", True))
    assert not rma_link(_hello("auto", True), _hello("auto", False))


def test_auto_counts_a_lane_as_one_sided_only_where_its_transports_include_verbs(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert not tls_allows_ib("tcp,sm,self")          # the default KV lane: no verbs used
    assert tls_allows_ib("rc,tcp,sm,self") and tls_allows_ib("dc_mlx5,self")
    assert tls_allows_ib(None) and tls_allows_ib("all")
    assert tls_allows_ib("^tcp") and not tls_allows_ib("^rc,ud,dc")
    monkeypatch.setattr(rma_path, "verbs_loaded", lambda: False)
    assert not rma_path.one_sided_here("rc")          # never without UCX's verbs transports
    monkeypatch.setattr(rma_path, "verbs_loaded", lambda: True)
    assert rma_path.one_sided_here("rc") and not rma_path.one_sided_here("tcp,sm,self")
    monkeypatch.setenv("UCX_TLS", "rc,sm")           # the environment wins, as in UCX
    assert tls_allows_ib("tcp,sm,self") and rma_path.one_sided_here("tcp,sm,self")


async def test_rma_transfers_are_byte_exact_both_ways(pools):
    async with pair(pools) as (a, b):
        cases = [([(0, 3 * MIB)], 1), (gapped(40, 41_984), 3), (gapped(6, MIB // 2), 5),
                 ([(7, 1), (100, 9_999)], 2)]
        for seed, (slots, split) in enumerate(cases):
            await move(a, b, pools[0].arena, slots, seed, split)     # b puts into a
            await move(b, a, pools[1].arena, slots, seed + 10, split)
        for t in (a, b):
            s = t.stats()
            assert s["rma_transfers_received"] == len(cases) == s["rma_transfers_sent"]
            assert s["messages_received"] == 0 and s["rma_links"] == 1
        assert [p["send"] for p in a.links.paths()] == ["rma"]
        # an arena outside the registered region: the same link takes tag messages
        private = np.zeros(MIB, np.uint8)
        await move(a, b, private, [(0, MIB // 2)], 99)
        assert a.stats()["rma_transfers_received"] == len(cases)
        assert a.stats()["messages_received"] >= 1


@pytest.mark.parametrize("other", [{"kv_mode": "tag"}, {"kv_mode": "auto"}])
async def test_a_peer_without_rma_gets_tag_messages(pools, other):
    async with pair(pools, cfg_b={**RMA, **other}) as (a, b):
        await move(a, b, pools[0].arena, gapped(8, 100_000), 1, 2)
        await move(b, a, pools[1].arena, gapped(8, 100_000), 2, 2)
        for t in (a, b):
            assert t.stats()["rma_transfers_received"] == 0 and t.stats()["rma_links"] == 0
        assert [p["send"] for p in a.links.paths()] == ["tag"]


@pytest.mark.slow
async def test_a_sender_killed_mid_transfer_fails_the_receive_and_the_receiver_serves_on(pools):
    """The peer pauses before each put; killed after its first put landed, our receive fails
    typed (the link's close callback, not the deadline) and we receive from another peer."""
    async with PageTransport(TransportConfig(**RMA), "survivor",
                             shm_arena=pools[0].arena) as t:
        victim = PeerProc({**RMA, "slow_put_s": 0.05})
        try:
            alloc = pools[0].alloc(64 * PAGE, "doomed")
            slots = [(off, n) for off, n in alloc.slots()]
            slots = [(slots[0][0] + i * PAGE, PAGE) for i in range(64)]
            first = pools[0].arena[slots[0][0]:slots[0][0] + PAGE]
            first[:] = 0
            tid = t.new_transfer_id()
            handle = await t.expect(victim.address, tid, pools[0].arena, slots, 60.0)
            victim.call("send", peer=list(t.address), tid=tid, slots=slots, seed=9,
                        deadline=60.0)
            await until(lambda: first.any(), 20.0, "the peer's first put landed")
            victim.kill()
            with pytest.raises(PeerFailed):
                await asyncio.wait_for(handle.wait(), 30)
            assert t.stats()["rma_transfers_received"] == 0
            alloc.free()
        finally:
            victim.kill()
        other = PeerProc(RMA)
        try:
            alloc = pools[0].alloc(8 * PAGE, "next")
            slots = alloc.slots()
            tid = t.new_transfer_id()
            handle = await t.expect(other.address, tid, pools[0].arena, slots, 30.0)
            reply = await other.request("send", peer=list(t.address), tid=tid, slots=slots,
                                        seed=4)
            assert reply["ok"], reply
            await handle.wait()
            assert np.array_equal(gather(pools[0].arena, slots),
                                  pattern(4, sum(n for _, n in slots)))
            assert t.stats()["rma_transfers_received"] == 1
            alloc.free()
        finally:
            other.close()


@pytest.mark.slow
async def test_a_receiver_killed_mid_transfer_fails_the_send_and_the_sender_serves_on(pools):
    async with PageTransport(TransportConfig(**RMA), "survivor",
                             shm_arena=pools[0].arena) as t:
        victim = PeerProc({**RMA, "shm_arena_bytes": 64 * MIB})
        try:
            slots = gapped(32, MIB)
            tid = (await victim.request("new_id"))["tid"]
            futs = victim.call("expect", peer=list(t.address), tid=tid,
                               arena_bytes=64 * MIB, slots=slots, deadline=60.0)
            await victim.reply(futs, "posted")
            os.kill(victim.pid, signal.SIGSTOP)              # the puts cannot finish now
            send = asyncio.ensure_future(t.send(victim.address, tid, [pattern(3, 32 * MIB)],
                                                slots, 60.0))
            await until(lambda: t.stats()["transfers_active"] >= 1, 10.0, "send under way")
            victim.kill()
            with pytest.raises(PeerFailed):
                await asyncio.wait_for(send, 30)
        finally:
            victim.kill()
        other = PeerProc({**RMA, "shm_arena_bytes": 16 * MIB})
        try:
            slots = gapped(4, MIB)
            tid = (await other.request("new_id"))["tid"]
            futs = other.call("expect", peer=list(t.address), tid=tid, arena_bytes=16 * MIB,
                              slots=slots, deadline=30.0)
            await other.reply(futs, "posted")
            data = pattern(5, 4 * MIB)
            await t.send(other.address, tid, [data], slots, 30.0)
            reply = await other.reply(futs, "done")
            assert reply["ok"] and reply["digest"] == hashlib.sha256(data.tobytes()).hexdigest()
            assert t.stats()["rma_transfers_sent"] == 1
        finally:
            other.close()
