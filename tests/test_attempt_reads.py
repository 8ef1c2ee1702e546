"""What a failed attempt read, counted end to end (docs/frontend-api.md "Retried attempts
re-read"): a split read is read by two nodes, and when it fails part-way the attempt is charged
both parts — the bytes the two gateways really read — not the larger of the two reports."""

from __future__ import annotations

import pytest

from common import faults
from common.kv import block_keys_from_tokens
from common.protocol import RequestFinished
from services.scheduler.client.client import SchedulerClient
from tests.test_datapath import BT, SPLIT, no_leaks, tokens
from tools.cluster.inprocess import local_datapath


@pytest.fixture(autouse=True)
def _disarm():
    yield
    faults.arm("")


def _bytes_read(c) -> int:
    return sum(g.store.stats()["bytes_read"] for g in c.gateways.values())


async def test_a_split_read_that_fails_part_way_is_charged_both_parts(tmp_path):
    async with local_datapath(tmp_path, overrides=SPLIT) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched:
        first = tokens(5 * BT + 20, 3)
        ev = await sched.run("t0", "sess", len(first), 10, token_ids=first, deadline_s=30)
        assert isinstance(ev, RequestFinished), ev
        prompt = first + ev.output_token_ids + tokens(40, 4)
        stored = await c.stored_prefix(block_keys_from_tokens(prompt, BT))
        assert stored >= 5
        # The DE fails sending its first pulled layers: its part was read, and the PE — which
        # waits for its own part and the DE's PrepareDecode reply before it pulls — has read
        # its part too, but never got the DE's first pull reply (so its own count lacks the
        # DE's). Both report their parts; the retry reads the whole hit again.
        faults.arm("de.pull.send=error@1")
        before, splits = _bytes_read(c), c.scheduler.core.reads.split_reads
        ev = await sched.run("t1", "sess", len(prompt), 10, token_ids=prompt, deadline_s=30)
        assert isinstance(ev, RequestFinished), ev
        assert faults.fired("de.pull.send") == 1
        assert c.scheduler.core.reads.split_reads > splits
        failed, last = ev.attempts[0], ev.attempts[-1]
        assert (failed.outcome, failed.read_side, last.outcome) == ("failed", "split",
                                                                    "finished")
        block = c.spec.full_block_bytes
        assert ev.hit_tokens == stored * BT
        read = _bytes_read(c) - before
        # every byte the gateways read is accounted for: the final attempt's hit + the
        # failed attempt's two parts (each > 0, so the larger alone would fall short)
        assert read == stored * block + failed.read_bytes, (read, failed)
        assert stored * block == failed.read_bytes
        await no_leaks(c)
