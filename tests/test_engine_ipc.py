"""The engine API across processes (docs/engine-api.md "Cross-process").

Engines in other processes (``tests/engine_proc.py``, ``SyncEngineClient``) attach to a PE
receiver's and a DE loader's Unix sockets and move real bytes through the nodes' ``/dev/shm``
arenas: the prefill engine sees exactly the stored hit on both read paths, the decode engine
gets stored hit + the new KV the prefill engine wrote. An engine killed with SIGKILL
mid-request frees every page it held; the scheduler re-plans the request, and a restarted
engine re-attaches and finishes it. Every bad input gets a typed error, and the node and its
other engines carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from common.errors import (AlreadyExists, Cancelled, DualpathError, InvalidArgument, KVSpecMismatch,
                           NotFound, PeerFailed, Unavailable, VersionMismatch)
from common.kv import KVSpec, block_keys_from_tokens
from common.protocol import (AbandonRequest, ArenaSlot, Assigned, AttachEngine, BlockOpened, ClaimRequest,
                             CollectiveBegin, CollectiveEnd, DecodeAssigned, EngineAlive, EngineAttached, EngineOk,
                             EnginePrompt,
                             EngineReply, EngineRequest, FailRequest, FinishDecode,
                             FinishPrefill, LayerReady, NewBlock, NextRequest, PrefillAssigned,
                             PutBlock, PutLayer, ReportCounters, RequestFinished,
                             SecondToken, TookKV,
                             WaitLayer, union_members)
from common.rpc import check_handler_coverage
import services.engine_api.server
from services.engine_api.prompt import next_block_key
from services.engine_api.remote import EngineClient
from services.scheduler.client.client import SchedulerClient
from tests.helpers import until
from tests.test_datapath import BT, no_leaks, plan, report, stored_bytes, tokens
from tools.cluster.emulated import attach_remote_engines
from tools.cluster.inprocess import local_datapath
from tools.engine_sim.engines import DecodeEngineSim
from tools.engine_sim.kv_pattern import fill_tokens, full_block

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sockets(tmp_path) -> dict:
    return {"pe_receiver": {"engine_socket": str(tmp_path / "p0.sock")},
            "de_loader": {"engine_socket": str(tmp_path / "d0.sock")}}


async def engine_proc(what: str, sock, engine_id: str, spec: KVSpec, out="-",
                      claim: str | None = None) -> asyncio.subprocess.Process:
    args = [sys.executable, "-m", "tests.engine_proc", what, str(sock), engine_id,
            msgspec.json.encode(spec).decode(), str(out)]
    if claim:
        args += ["--claim", claim]
    return await asyncio.create_subprocess_exec(*args, cwd=ROOT, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)


async def finished(proc: asyncio.subprocess.Process, timeout: float = 30.0) -> str:
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode == 0, (out.decode(), err.decode()[-3000:])
    return out.decode()


async def line_starting(proc: asyncio.subprocess.Process, prefix: bytes) -> bytes:
    """The first stdout line of ``proc`` that starts with ``prefix`` (log lines skipped)."""
    while line := await proc.stdout.readline():
        if line.startswith(prefix):
            return line
    raise AssertionError(f"process ended before printing {prefix!r}")


async def holding(stack: contextlib.AsyncExitStack, sched: SchedulerClient, sock, spec: KVSpec,
                  rid: str) -> tuple[asyncio.subprocess.Process, asyncio.Future]:
    """A ``hold`` engine process attached as p0.e0 at ``sock`` holding request ``rid``
    (submitted through ``sched``, running as the returned future) after its first layer.
    On ``stack``'s exit the process is resumed if stopped, killed and reaped, the run
    cancelled."""
    holder = await engine_proc("hold", sock, "p0.e0", spec)

    async def end() -> None:
        with contextlib.suppress(ProcessLookupError):
            holder.send_signal(signal.SIGCONT)
            holder.kill()
        await holder.wait()

    stack.push_async_callback(end)
    toks = tokens(2 * BT + 30, 3)
    run = asyncio.ensure_future(sched.run(rid, f"s-{rid}", len(toks), 3, token_ids=toks,
                                          deadline_s=60))
    stack.callback(run.cancel)
    line = await asyncio.wait_for(line_starting(holder, b"holding"), 30)
    assert line.startswith(b"holding " + rid.encode()), line
    return holder, run


async def client(tmp_path, engine_id: str = "p0.e0", role: str = "prefill", spec=None,
                 **kw) -> EngineClient:
    node = "p0" if role == "prefill" else "d0"
    return await EngineClient.connect(str(tmp_path / f"{node}.sock"), engine_id=engine_id,
                                      role=role, kv_spec=spec or KVSpec("test-small", 4, 256),
                                      timeout_s=5.0, **kw)


# ---------------------------------------------------------------- schema

SAMPLE_PROMPT = EnginePrompt("r1", 0, "s", 130, 64, 3, ["ab" * 16], [1, 2], 64, "pe",
                             ["ab" * 16, "cd" * 16], "ef" * 16)
SLOT = ArenaSlot(4096, 1024)
SAMPLES = [
    AttachEngine("p0.e0", "prefill", KVSpec("x", 4, 256), replace=True),
    NextRequest(1.0, 4), ClaimRequest("r1", 2.0), WaitLayer("r1", 0, 3, 1.0),
    PutLayer("r1", 0, 3), FinishPrefill("r1", 0, 7), TookKV("r1", 0), SecondToken("r1", 0),
    NewBlock("r1", 0, list(range(64))), PutBlock("r1", 0, 2), FinishDecode("r1", 0, [1, 2]),
    FailRequest("r1", 0, "gave up"), AbandonRequest("r1", "refused", 2.0), ReportCounters({"verified_requests": 3.0}),
    CollectiveBegin(), CollectiveEnd(), EngineAlive(),
    EngineAttached("p0", "p0.e0", KVSpec("x", 4, 256), "dualpath-" + "0" * 32, 1 << 20, 60.0,
                   1.0, 15.0),
    Assigned([PrefillAssigned(SAMPLE_PROMPT, 64)],
             [DecodeAssigned(SAMPLE_PROMPT, 64, 5, [SLOT, SLOT])]),
    LayerReady("r1", 2, SLOT, SLOT, SLOT), BlockOpened("r1", 3, "ab" * 16, SLOT), EngineOk("r1"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_engine_message_round_trips(msg):
    union = EngineRequest if type(msg) in union_members(EngineRequest) else EngineReply
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=union) == msg


def test_every_engine_request_has_a_handler_and_every_member_is_sampled():
    from services.engine_api.server import EngineApiServer
    assert check_handler_coverage(
        EngineApiServer.handlers(EngineApiServer.__new__(EngineApiServer)), EngineRequest) == []
    members = set(union_members(EngineRequest)) | set(union_members(EngineReply))
    assert members - {type(m) for m in SAMPLES} == {union_members(EngineReply)[-1]}  # ErrorReply


def test_the_client_imports_no_ucxx_transport_or_node_service():
    code = ("import sys, services.engine_api.remote\n"
            "print([m for m in sys.modules if m.startswith(('ucxx', 'common.transport', "
            "'services.pe_receiver', 'services.de_loader', 'services.node', "
            "'services.scheduler', 'storage_gateway', 'tools'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------- real bytes, other processes

@pytest.mark.parametrize("side,claim", [("pe", False), ("de", True)])
async def test_engines_in_other_processes_see_stored_hit_and_decode_gets_hit_plus_new(
        tmp_path, side, claim):
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        toks = tokens(3 * BT + 63, 5)          # tail 63 + the first token: one generated block
        keys = block_keys_from_tokens(toks, BT)
        await c.store_blocks(keys[:3])
        rid = f"x-{side}"
        pe_out, de_out = tmp_path / "pe.npz", tmp_path / "de.npz"
        procs = [await engine_proc("prefill", tmp_path / "p0.sock", "p0.e0", c.spec, pe_out,
                                   rid if claim else None),
                 await engine_proc("decode", tmp_path / "d0.sock", "d0.e0", c.spec, de_out,
                                   rid if claim else None)]
        await until(lambda: len(c.pe["p0"].engine_api.sessions) == 1
                    and len(c.de["d0"].engine_api.sessions) == 1, what="both engines attached")
        c.pe["p0"].submit_plan(plan(c, rid, toks, 3, side))
        for p in procs:
            await finished(p)
        seen, got = np.load(pe_out), np.load(de_out)
        stored = await stored_bytes(c, keys[:3])
        assert int(seen["hit"]) == 3 * BT and int(got["first"]) == 11
        for layer in range(c.spec.num_layers):
            want_hit = stored[:, layer].reshape(3 * BT, -1)
            assert np.array_equal(seen[f"seen{layer}"], want_hit)                 # PE: storage
            assert np.array_equal(got[f"prompt{layer}"][:3 * BT], want_hit)       # DE: hit
            assert np.array_equal(got[f"prompt{layer}"][3 * BT:], seen[f"written{layer}"])
        await until(lambda: report(c.de["d0"], rid, "finished") is not None, what="finished")
        assert report(c.de["d0"], rid, "finished").output_token_ids == [11, 12, 13]
        assert (c.de["d0"].counters["layers_pulled"] > 0) == (side == "de")
        # the decode engine wrote the generated block through NewBlock/PutBlock: it is stored
        # under the chained key of (tail ids + first token), with the bytes the engine wrote
        gen_key = next_block_key(keys[-1], toks[3 * BT:] + [11], BT)
        assert await c.stored_prefix(keys + [gen_key]) == 4    # durable before "finished"
        assert np.array_equal((await stored_bytes(c, [gen_key]))[0].reshape(-1),
                              full_block(c.spec, gen_key))
        await no_leaks(c)
        await until(lambda: not c.pe["p0"].engine_api.sessions, what="engines detached")


@pytest.mark.reliability
async def test_killed_engine_frees_its_pages_and_a_restarted_one_finishes_the_replan(
        tmp_path, reliability):
    """SIGKILL mid-request: pages back, the attempt fails retryable, the scheduler re-plans
    it and takes the dead engine out of placement (``EngineLoad.attached``); the restarted
    engine re-attaches under the same id (the node kept running), is placed on again and
    finishes the request."""
    async with local_datapath(tmp_path, engines=False, overrides=sockets(tmp_path)) as c, \
            SchedulerClient("127.0.0.1", c.scheduler.port) as sched, \
            contextlib.AsyncExitStack() as stack:
        pe, spec = c.pe["p0"], c.spec
        # the decode engine over d0's socket too: a node with an engine socket reports an
        # engine with nothing attached as not attached, and the scheduler places nothing there
        await attach_remote_engines(stack, c.de["d0"], c.cfg)
        counts = c.scheduler.counters
        holder, run = await holding(stack, sched, tmp_path / "p0.sock", spec, "k1")
        assert pe.pool.used_pages > 0
        detached = counts["engines_detached"]
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        await until(lambda: pe.engine_api.counters["detaches"] == 1
                    and not pe.engine_api.sessions, what="the killed engine detached")
        first = c.scheduler.core.attempt_base           # this scheduler epoch's first attempt
        await until(lambda: not any(a.info.attempt == first for a in pe.attempts.values()),
                    what="the first attempt released")
        await until(lambda: counts["engines_detached"] > detached
                    and "p0.e0" not in {r.engine_id for r in c.scheduler.core.engine_reports()},
                    what="the scheduler took the dead engine out of placement")
        attached = counts["engines_attached"]
        restarted = await engine_proc("prefill", tmp_path / "p0.sock", "p0.e0", spec,
                                      tmp_path / "pe.npz")
        ev = await asyncio.wait_for(run, 60)
        await finished(restarted)
        assert counts["engines_attached"] > attached
        # re-planned once: the node's failure report names the detached engine, which leaves
        # placement before the request re-plans (before protocol v6 a held fetch could put it
        # on the dead engine again: a second re-plan, docs/engine-api.md)
        assert isinstance(ev, RequestFinished) and ev.attempt == first + 1, ev
        assert (ev.attempts[0].hop, ev.attempts[0].code) == ("engine", "PEER_FAILED"), ev
        assert pe.engine_api.counters["requests_failed_on_detach"] == 1
        await no_leaks(c)
        reliability.record("fault", "kill -9 an engine process holding a prefill request",
                           "pages freed, re-planned, finished by the restarted engine "
                           "(same id, node not restarted)", lost=0, leaked_pages=0)


async def test_the_vllm_workers_engine_source_attaches_again_once_its_node_dropped_it(tmp_path):
    """A node reports an engine with nothing attached as such, and the scheduler places
    nothing on it: so the vLLM worker's engine source re-attaches by itself (once a second)
    when the node's connection is lost — here another attach replaced it, then went away —
    instead of waiting for a claim that would never come."""
    from integrations.vllm.engine_source import EngineSource
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        api = c.pe["p0"].engine_api
        src = EngineSource(str(tmp_path / "p0.sock"), "p0.e0", "prefill", c.spec, 5.0)
        try:
            await asyncio.to_thread(src.keep_attached)
            assert "p0.e0" in api.sessions
            other = await client(tmp_path, spec=c.spec, replace=True)
            await until(lambda: api.counters["detaches"] == 1, what="the source replaced")
            await other.close()
            await until(lambda: api.counters["detaches"] == 2 and "p0.e0" in api.sessions,
                        what="the source attached again by itself")
        finally:
            await asyncio.to_thread(src.close)
        await until(lambda: not api.sessions, what="closed: detached")


# ---------------------------------------------------------------- bad input

@pytest.mark.reliability
async def test_attach_refusals_are_typed_and_name_both_specs(tmp_path, reliability):
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        with pytest.raises(KVSpecMismatch) as e:
            await client(tmp_path, spec=KVSpec("other", 61, 656))
        assert "61 layers" in e.value.message and "4 layers" in e.value.message
        with pytest.raises(NotFound):
            await client(tmp_path, engine_id="p0.e9")
        with pytest.raises(Unavailable):                     # no node there: bounded wait
            await EngineClient.connect(str(tmp_path / "nobody.sock"), engine_id="p0.e0",
                                       role="prefill", kv_spec=c.spec, timeout_s=0.5)
        with pytest.raises(InvalidArgument):                 # a decode engine on a PE node
            await EngineClient.connect(str(tmp_path / "p0.sock"), engine_id="p0.e0",
                                       role="decode", kv_spec=c.spec, timeout_s=5.0)
        first = await client(tmp_path)
        with pytest.raises(AlreadyExists):
            await client(tmp_path)
        second = await client(tmp_path, replace=True)        # takes the id over
        with pytest.raises(PeerFailed):
            await first.next_prefill(0.0)
        assert await second.next_prefill(0.0) is None
        await first.close()
        await second.close()
        assert c.pe["p0"].engine_api.counters["attach_refused"] == 4
        reliability.record("input", "engine attach: other KV spec, unknown engine id, wrong "
                           "role, id already attached", "KV_SPEC_MISMATCH naming both specs, "
                           "NOT_FOUND, INVALID_ARGUMENT, ALREADY_EXISTS (replace=True takes "
                           "over); node serving")


async def test_wrong_versions_are_refused(tmp_path, monkeypatch):
    import common.rpc_client
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        rpc = c.pe["p0"].engine_api
        with pytest.raises(VersionMismatch):     # the channel's own version, in the attach
            from common.rpc_client import RpcClient
            from common.config import RpcConfig
            raw = RpcClient(RpcConfig(), "", 0, role="engine", node_id="x",
                            reply_type=EngineReply, unix_path=str(tmp_path / "p0.sock"))
            try:
                await raw.call(AttachEngine("p0.e0", "prefill", c.spec, api_version=99), 5)
            finally:
                await raw.close()
        monkeypatch.setattr(common.rpc_client, "PROTOCOL_VERSION", 99)
        with pytest.raises(VersionMismatch):     # the RPC hello
            await client(tmp_path)
        assert not rpc.sessions


async def test_a_claim_of_a_request_that_failed_before_it_is_answered_at_once(tmp_path,
                                                                            monkeypatch):
    """The node failed the request before the engine claimed it (its deadline passed while it
    waited for an engine): the claim gets Cancelled with the reason at once — not NotFound
    after its whole timeout — so a P/D engine (the vLLM connector) computes without dualpath
    instead of hanging. An id the node never had a plan for is refused after the unknown-id
    grace (InvalidArgument), not after the claim's timeout either."""
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        pe = c.pe["p0"]
        pe.submit_plan(plan(c, "gone", tokens(3 * BT, 7), 0, "none", deadline=2.0))
        await until(lambda: report(pe, "gone", "failed") is not None, timeout=60,
                    what="the plan failed")
        eng = await client(tmp_path)
        try:
            with pytest.raises(Cancelled, match="failed on p0"):    # the claim may wait 300 s
                await asyncio.wait_for(eng.claim_prefill("gone", 300.0), 60.0)
            with pytest.raises(NotFound):                 # never seen: still a plain NotFound
                await eng.claim_prefill("never", 0.2)
            # ... until the unknown-id grace is over: then refused (not its whole timeout)
            monkeypatch.setattr(services.engine_api.server, "UNKNOWN_GRACE_S", 0.5)
            with pytest.raises(InvalidArgument, match="unknown to p0"):
                await asyncio.wait_for(eng.claim_prefill("never", 300.0), 60.0)
        finally:
            await eng.close()


@pytest.mark.reliability
async def test_bad_calls_get_typed_errors_and_leave_the_node_serving(tmp_path, reliability):
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        pe = c.pe["p0"]
        # garbage on the socket: that connection is closed, nothing else happens
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "p0.sock"))
        await reader.readexactly(4)
        writer.write(b"\x00\x00\x00\x05junk!")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) is not None
        writer.close()
        eng = await client(tmp_path)
        with pytest.raises(NotFound):                              # never assigned
            await eng.claim_prefill("nobody", 0.3)
        with pytest.raises(NotFound):                              # not held
            await eng.call(WaitLayer("nobody", 0, 0, 0.1), 0.1)
        with pytest.raises(InvalidArgument):                       # bad timeout
            await eng.call(NextRequest(float("nan"), 1))
        for busy in (float("nan"), float("inf"), -1.0):           # a beat's bad step age
            with pytest.raises(InvalidArgument, match="busy_s"):
                await eng.call(EngineAlive(busy))
        with pytest.raises(InvalidArgument, match="steps"):
            await eng.call(EngineAlive(0.0, -3))
        assert "p0.e0" in pe.engine_api.sessions                   # still attached
        claim = asyncio.ensure_future(eng.claim_prefill("b1", 10.0))   # before the plan
        await until(lambda: "b1" in pe.engine_api.claims_waiting, what="b1's claim waiting")
        pe.submit_plan(plan(c, "b1", tokens(BT + 9, 4), 0, "none"))
        h = await claim
        with pytest.raises(InvalidArgument):                       # output before layer
            h.output(0)
        with pytest.raises(InvalidArgument):                       # layer out of range
            await h.layer(99, 1.0)
        await h.layer(0, 5.0)
        with pytest.raises(InvalidArgument):                       # out of order
            await h.put_layer(1)
        info = h.info
        for layer in range(c.spec.num_layers):
            await h.layer(layer, 5.0)
            fill_tokens(h.output(layer), c.spec, info.block_keys, info.tail_key, layer, 0,
                        info.prompt_tokens)
            await h.put_layer(layer)
        dec = asyncio.ensure_future(DecodeEngineSim(c.de["d0"].ports["d0.e0"], c.spec,
                                                    c.cfg.engine_sim).run())
        try:
            await h.finish(5)
            with pytest.raises(NotFound):                          # finishing twice
                await eng.call(FinishPrefill("b1", 0, 5))
            await until(lambda: report(c.de["d0"], "b1", "finished") is not None,
                        what="finished")
        finally:
            dec.cancel()
            await asyncio.gather(dec, return_exceptions=True)
        await eng.close()
        await no_leaks(c)
        assert pe.status.value == "running"
        reliability.record("input", "engine channel: garbage frame, unknown / never-assigned "
                           "request, NaN timeout, output before layer, layer out of range, "
                           "out of order, finish twice", "typed error to that engine; the "
                           "request still finished; no page leaked", leaked_pages=0)


async def test_a_request_of_another_engine_is_refused_at_once(tmp_path):
    over = sockets(tmp_path)
    over["pe_receiver"]["engines"] = 2
    async with local_datapath(tmp_path, scheduler=False, engines=False, overrides=over) as c:
        e0, e1 = await client(tmp_path, "p0.e0"), await client(tmp_path, "p0.e1")
        c.pe["p0"].submit_plan(plan(c, "o1", tokens(BT + 3, 6), 0, "none"))   # for p0.e0
        with pytest.raises(InvalidArgument, match="p0.e0"):
            await e1.claim_prefill("o1", 5.0)
        h = await e0.claim_prefill("o1", 5.0)
        with pytest.raises(NotFound):                              # e1 cannot drive it
            await e1.call(PutLayer("o1", 0, 0))
        await h.fail("test gives up")
        await until(lambda: report(c.pe["p0"], "o1", "failed") is not None, what="failed")
        assert report(c.pe["p0"], "o1", "failed").retryable
        for e in (e0, e1):
            await e.close()
        await no_leaks(c)


@pytest.mark.reliability
async def test_an_engine_that_disconnects_fails_its_requests_retryable(tmp_path, reliability):
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        eng = await client(tmp_path)
        c.pe["p0"].submit_plan(plan(c, "d1", tokens(2 * BT + 3, 7), 0, "none"))
        h = await eng.claim_prefill("d1", 5.0)
        await h.layer(0, 5.0)
        assert c.pe["p0"].pool.used_pages > 0
        await eng.close()
        await until(lambda: report(c.pe["p0"], "d1", "failed") is not None, what="failed")
        failed = report(c.pe["p0"], "d1", "failed")
        assert failed.retryable and failed.hop == "engine", failed
        await no_leaks(c)
        with pytest.raises(DualpathError):
            await h.put_layer(0)
        reliability.record("fault", "engine disconnects holding a prefill request",
                           "PEER_FAILED retryable (hop engine), pages freed", leaked_pages=0)


# ---------------------------------------------------------------- collectives cap KV egress

async def test_collective_begin_holds_the_arbiter_high_until_its_end(tmp_path):
    """CollectiveBegin → the node's arbiter is in high-priority mode (KV capped);
    CollectiveEnd → released; a nested begin needs its own end; both roles."""
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        for node, role, eid in ((c.pe["p0"], "prefill", "p0.e0"),
                                (c.de["d0"], "decode", "d0.e0")):
            eng = await client(tmp_path, eid, role)
            try:
                assert not node.arbiter.high_active
                await eng.collective_begin()
                assert node.arbiter.high_active and node.stats()["arbiter_high_active"] == 1
                await eng.port.collective_begin()            # nested
                await eng.collective_end()
                assert node.arbiter.high_active
                await eng.port.collective_end()
                assert not node.arbiter.high_active
                await eng.collective_end()                    # nothing open: counted, no error
                stats = node.stats()
                assert stats["collectives_begun"] == stats["collectives_ended"] == 2
                assert stats["collective_ends_unmatched"] == 1
            finally:
                await eng.close()


@pytest.mark.reliability
async def test_a_disconnect_or_the_deadline_releases_an_open_collective(tmp_path, reliability):
    over = {**sockets(tmp_path), "arbiter": {"collective_max_s": 0.3}}
    async with local_datapath(tmp_path, scheduler=False, engines=False, overrides=over) as c:
        pe = c.pe["p0"]
        eng = await client(tmp_path)
        await eng.collective_begin()
        assert pe.arbiter.high_active
        await eng.close()                                     # the engine goes away mid-collective
        await until(lambda: not pe.arbiter.high_active, what="the cap released on detach")
        assert pe.collectives.counters["collectives_ended_on_detach"] == 1
        hung = await client(tmp_path)                         # attached, but never ends it
        try:
            await hung.collective_begin()
            assert pe.arbiter.high_active
            await until(lambda: not pe.arbiter.high_active, 5.0, "the hold to expire")
            assert pe.collectives.counters["collectives_expired"] == 1
            await hung.collective_end()                       # late: harmless
        finally:
            await hung.close()
        reliability.record("fault", "engine disconnects / hangs inside a collective",
                           "KV cap released (detach, collective_max_s)", held_forever=0)


async def test_a_pipelined_put_that_fails_is_raised_by_the_next_call(tmp_path):
    """``put_layer(wait=False)`` returns at once; its typed error comes out of the next call
    on the handle (here ``finish``), and the request can still be failed cleanly."""
    from services.engine_api.remote import SyncEngineClient
    async with local_datapath(tmp_path, scheduler=False, engines=False,
                              overrides=sockets(tmp_path)) as c:
        sync = await asyncio.to_thread(SyncEngineClient.connect, str(tmp_path / "p0.sock"),
                                       engine_id="p0.e0", role="prefill", kv_spec=c.spec)
        try:
            c.pe["p0"].submit_plan(plan(c, "w1", tokens(BT + 3, 9), 0, "none"))
            h = await asyncio.to_thread(sync.claim_prefill, "w1", 5.0)
            await asyncio.to_thread(h.layer, 0, 5.0)
            await asyncio.to_thread(h.put_layer, 1, False)         # out of order, not waited
            with pytest.raises(InvalidArgument, match="in order"):
                await asyncio.to_thread(h.finish, 3)
            await asyncio.to_thread(h.fail, "test")
            await until(lambda: report(c.pe["p0"], "w1", "failed") is not None, what="failed")
        finally:
            await asyncio.to_thread(sync.close)
        await no_leaks(c)


async def test_engine_socket_is_private_and_refuses_other_uids(tmp_path, reliability):
    """The socket is created 0600 even under a permissive umask (no chmod window), and a peer
    whose uid (SO_PEERCRED) is not allowed is closed and counted while the node keeps serving.
    A second uid is simulated by allowing only one that is not ours on the PE node."""
    stranger_only = sockets(tmp_path)
    stranger_only["pe_receiver"]["engine_socket_uids"] = [os.getuid() + 4242]
    old = os.umask(0)
    try:
        async with local_datapath(tmp_path, scheduler=False, engines=False,
                                  overrides=stranger_only) as c:
            for sock in ("p0.sock", "d0.sock"):
                assert stat.S_IMODE(os.stat(tmp_path / sock).st_mode) == 0o600, sock
            with pytest.raises((Unavailable, PeerFailed)):
                await EngineClient.connect(str(tmp_path / "p0.sock"), engine_id="p0.e0",
                                           role="prefill", kv_spec=c.spec, timeout_s=2.0)
            api = c.pe["p0"].engine_api
            await until(lambda: api.counters["peers_refused"] >= 1)
            assert not api.sessions
            ok = await client(tmp_path, engine_id="d0.e0", role="decode", spec=c.spec)
            await ok.close()
            assert c.de["d0"].engine_api.counters["peers_refused"] == 0
    finally:
        os.umask(old)
    reliability.record("security", "engine socket: 0600 under umask 0; a peer uid outside "
                       "engine_socket_uids", "refused and counted (peers_refused); the "
                       "node's other engines keep attaching")
