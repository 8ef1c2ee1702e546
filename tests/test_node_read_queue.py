"""The read queue a node sends the scheduler with each FetchWork (paper §5.1's read_q) is never
older than the node's last read: a telemetry sample the gateway took mid-read (the read still
counted) must not ride on FetchWork after that read is done — the scheduler has released the
read by then, and the stale sample would put it back on the link (docs/datapath.md "Split
reads"). The read's own reply states the queue after the read left it; telemetry and replies
share one connection, in order, so the node takes the reply's value."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

from common.protocol import Endpoint, ReadBlocksReply
from services.node.base import NodeBase
from services.node.gateway import NodeGateways
from storage_gateway.client import layout_slots
from tests.helpers import until
from tests.test_gateway_service import BB, SPEC, blocks, chain, cluster


async def test_the_node_takes_the_read_queue_its_read_reply_states(tmp_path):
    """A shaped read (~0.4 s) while telemetry streams every 20 ms on the same connection: the
    samples taken during the read count it; when ``read_hit`` returns, the node's read queue
    is already the reply's (0), whatever sample arrived last."""
    shaped = {"link_rate_bytes_per_s": 2e6, "link_burst_bytes": BB, "link_chunk_bytes": BB}
    async with cluster(tmp_path, gateway=shaped) as c:
        n = 12
        keys = chain(n)
        await c.client.write_blocks("w", keys, blocks(n), 30.0)
        node = SimpleNamespace(read_q=None)
        local = ("127.0.0.1", c.gw.rpc_port)
        gateways = NodeGateways(c.cfg.rpc, c.tr, c.arena, SPEC, node_id="p0", role="pe_receiver",
                                local=local,
                                on_local_read_q=lambda t: NodeBase._note_read_q(node, t))
        gateways._clients[local] = c.client          # the node's one connection to its gateway
        samples: list[int] = []

        async def watch() -> None:                  # what NodeBase._read_q_loop does
            async for t in c.client.watch_telemetry(0.02):
                node.read_q = t.read_q_tokens
                samples.append(t.read_q_tokens)

        watcher = asyncio.create_task(watch())
        try:
            await until(lambda: samples, what="first telemetry sample")
            slots = layout_slots(SPEC, 0, n * SPEC.block_tokens, n)
            region = SimpleNamespace(block_dest=lambda j: slots[j])
            got = await gateways.read_hit(None, "r", keys, region, 20.0, 3 * BB, fault="test.read")
            assert node.read_q == 0                  # the reply's value, at once
            assert got == (n, n * BB)
            assert max(samples) > 0                  # samples mid-read did count the read
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def test_only_the_local_gateway_sets_it_and_only_while_telemetry_runs():
    """A read from another node's gateway says nothing about this node's link; without the
    telemetry watch (read_q None) the node reports none and the scheduler keeps its count."""
    told: list[int] = []

    class FakeClient:
        async def read_blocks(self, request_id, keys, dests, budget_s, batch_bytes, layer_major):
            return ReadBlocksReply(request_id, [True] * len(keys), len(keys), 0, len(keys) * BB,
                                   0.0, 0.0, 640)

    local = ("10.0.0.1", 7400)
    gateways = NodeGateways(None, None, None, SPEC, node_id="d0", role="de_loader", local=local,
                            on_local_read_q=told.append)
    gateways._clients[local] = FakeClient()
    gateways._clients[("10.0.0.2", 7400)] = FakeClient()
    region = SimpleNamespace(block_dest=lambda j: [])
    other = Endpoint("d1", "gateway", "10.0.0.2", 7400, "10.0.0.2", 7500)
    assert await gateways.read_hit(other, "a", ["ab" * 16], region, 5.0, BB, fault="t") == (1, BB)
    assert told == []
    mine = Endpoint("d0", "gateway", "10.0.0.1", 7400, "10.0.0.1", 7500)
    await gateways.read_hit(mine, "b", ["ab" * 16], region, 5.0, BB, fault="t")
    await gateways.read_hit(None, "c", ["ab" * 16], region, 5.0, BB, fault="t")
    assert told == [640, 640]

    node = SimpleNamespace(read_q=None)
    NodeBase._note_read_q(node, 640)
    assert node.read_q is None                       # no watch: no report
    node.read_q = 5
    NodeBase._note_read_q(node, 640)
    assert node.read_q == 640
