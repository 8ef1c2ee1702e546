"""The data path with a node's page pool in GPU memory (``device = "cuda"``): needs cupy and a
CUDA device, skipped elsewhere (marker ``gpu``; ``bench/gpu_check.sh`` runs it on a GPU host).

Sessions of two turns through an in-process 1P1D cluster whose PE receiver holds its buffer on
the device: the second turn of each hits the blocks the first wrote back, and the ``dpl``
policy alternates its read side, so one session's hit is read by the PE (gateway → device pool)
and the next one's by the DE (gateway → DE host buffer → the PE's device pool over the
transport's CUDA lanes). The emulated engines verify every byte (``check=True``). The KV lane
sends direct messages only (``pack_below_bytes = 0``): a device arena takes no packed ones.

Then the same with the DE loader's buffer on the device: the gateway's reads and the PE's
returns land in it through pinned staging (host senders), its sends to the PE leave from
device memory, and its write-backs copy device views to host memory before the gateway gets
them (``NodeGateways.host_payloads``). Every receive into a device pool from a host sender
goes through the transport's pinned staging and one H2D copy per message
(``common.transport.device_staging``): both tests check it did, and that the write-backs
landed (the second turn's hit is what the first wrote back).
"""

from __future__ import annotations

import pytest

from common.protocol import RequestFinished
from services.scheduler.client.client import SchedulerClient
from tools.cluster.inprocess import local_datapath

pytestmark = [pytest.mark.gpu]

UCX_CUDA = {"TLS": "tcp,sm,self,cuda_copy,cuda_ipc", "NET_DEVICES": "lo"}


def device_overrides(role: str) -> dict:
    return {role: {"device": "cuda"}, "scheduler": {"policy": "dpl"},
            "transport": {"pack_below_bytes": 0,
                          "traffic_classes": {"kv": {"options": UCX_CUDA}}}}


def require_cuda() -> None:
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("no CUDA device")


async def sessions_until_both_read_sides(sched: SchedulerClient, most: int = 6) -> set[str]:
    """Two-turn sessions until a hit was read on each side (``dpl`` alternates them)."""
    sides: set[str] = set()
    for n in range(most):
        toks = [(i * 31 + n * 7) % 50_000 for i in range(200)]
        first = await sched.run(f"s{n}-t1", f"s{n}", 200, 2, token_ids=toks, deadline_s=60,
                                check=True)
        assert isinstance(first, RequestFinished) and first.hit_tokens == 0, first
        second = await sched.run(f"s{n}-t2", f"s{n}", 260, 2, token_ids=toks + [7] * 60,
                                 deadline_s=60, check=True)
        assert isinstance(second, RequestFinished) and second.hit_tokens == 192, second
        sides.add(second.attempts[-1].read_side)
        if {"pe", "de"} <= sides:
            break
    return sides


def staged(svc) -> float:
    return svc.transport.stats()["device_staged_messages"]


async def test_the_pe_pool_on_the_device_takes_both_read_paths(tmp_path):
    require_cuda()
    async with local_datapath(tmp_path, overrides=device_overrides("pe_receiver")) as c:
        assert all(type(s.pool.arena).__module__.startswith("cupy") for s in c.pe.values())
        async with SchedulerClient("127.0.0.1", c.scheduler.port, rpc=c.cfg.rpc) as sched:
            assert await sessions_until_both_read_sides(sched) == {"pe", "de"}
        # the gateway (host memory) -> the PE's device pool: staged; the DE's host buffer is
        # a host sender too
        assert all(staged(s) > 0 for s in c.pe.values())
        assert all(staged(s) == 0 for s in c.de.values())


async def test_a_de_pool_on_the_device_takes_both_read_paths(tmp_path):
    require_cuda()
    async with local_datapath(tmp_path, overrides=device_overrides("de_loader")) as c:
        assert all(type(s.pool.arena).__module__.startswith("cupy") for s in c.de.values())
        async with SchedulerClient("127.0.0.1", c.scheduler.port, rpc=c.cfg.rpc) as sched:
            assert await sessions_until_both_read_sides(sched) == {"pe", "de"}
        for de in c.de.values():
            assert staged(de) > 0                    # gateway reads, PE returns
            assert de.counters["blocks_written"] > 0 and de.counters["writeback_failed"] == 0
        assert all(staged(s) == 0 for s in c.pe.values())
