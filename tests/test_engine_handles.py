"""The engine handles are declared once (services/engine_api/handles.py) and every
implementation follows that declaration: the in-process adapters, the remote handles (one
engine message per call), the local store of the vLLM connector; the blocking bridge gives the
same calls, blocking. No sockets here: the remote client is a recording stand-in."""

from __future__ import annotations

import asyncio
import gc
import inspect
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from common.errors import DeadlineExceeded, InvalidArgument, NotFound
from common.kv import KVSpec
from common.protocol import (ArenaSlot, BlockOpened, DecodeAssigned, EngineOk, EnginePrompt,
                             EngineRequest, LayerReady, PrefillAssigned, union_members)
from common.portal import Portal, PortalStopped
from services.engine_api.blocking import Blocking
from services.engine_api.decode import DecodePort, DecodeRequest
from services.engine_api.handles import (CollectiveSignals, DecodeHandle, DecodeQueue,
                                         GeneratedBlock, PrefillHandle, PrefillQueue)
from services.engine_api.prefill import PrefillPort, PrefillRequest
from services.engine_api.remote_async import (RemoteDecodePort, RemoteDecodeRequest,
                                              RemotePrefillHandle, RemotePrefillPort)

REPO = Path(__file__).resolve().parents[1]
SPEC = KVSpec("t", 2, 16)
PROMPT = EnginePrompt("r1", 3, "s", 70, 64, 2, ["ab" * 16], [1] * 6, 64, "pe", ["ab" * 16], None)


def _methods(proto: type) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(proto).items()
            if inspect.isfunction(f) and not n.startswith("_")}


def _properties(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if isinstance(v, property)}


def _follows(impl: type, proto: type) -> list[str]:
    """What ``impl`` does differently from ``proto``'s methods (async-ness, parameters)."""
    wrong = []
    for name, want in _methods(proto).items():
        got = getattr(impl, name, None)
        if got is None:
            wrong.append(f"{name} missing")
            continue
        if inspect.iscoroutinefunction(got) != inspect.iscoroutinefunction(getattr(proto, name)):
            wrong.append(f"{name}: async-ness differs")
        params = inspect.signature(got).parameters
        for p in want.parameters.values():
            if p.name not in params:
                wrong.append(f"{name}: no parameter {p.name}")
            elif (p.default is inspect.Parameter.empty) != (
                    params[p.name].default is inspect.Parameter.empty):
                wrong.append(f"{name}: {p.name} optional in one, required in the other")
    return wrong


class FakeClient:
    """Stands in for EngineClient: records every message, answers like the node."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.arena = np.zeros(1 << 16, np.uint8)
        self.kv_spec = SPEC
        self.engine_id = "p0.e0"
        self.max_wait_s = 1.0
        self.fail_with: Exception | None = None
        self.waits: dict[str, float] = {}
        self.loaded: dict[int, asyncio.Event] = {}    # WaitLayer(l) answers once set

    async def call(self, msg, wait_s: float = 0.0):
        self.sent.append(msg)
        self.waits[type(msg).__name__] = wait_s
        name = type(msg).__name__
        if name == "WaitLayer" and msg.layer in self.loaded:
            await self.loaded[msg.layer].wait()
        if self.fail_with is not None:
            raise self.fail_with
        if name == "WaitLayer":
            return LayerReady(msg.request_id, msg.layer, ArenaSlot(0, 64 * 16),
                              ArenaSlot(1024, 6 * 16), ArenaSlot(0, 70 * 16))
        if name == "NewBlock":
            return BlockOpened(msg.request_id, 1, "cd" * 16, ArenaSlot(4096, 2 * 64 * 16))
        return EngineOk(getattr(msg, "request_id", ""))

    def view(self, slot: ArenaSlot) -> np.ndarray:
        return self.arena[slot.offset:slot.offset + slot.nbytes].reshape(-1, 16)


def remote_pair(client: FakeClient) -> tuple[RemotePrefillHandle, RemoteDecodeRequest]:
    return (RemotePrefillHandle(client, PrefillAssigned(PROMPT, 64)),  # type: ignore[arg-type]
            RemoteDecodeRequest(client, DecodeAssigned(PROMPT, 64, 5,  # type: ignore[arg-type]
                                                       [ArenaSlot(0, 1120), ArenaSlot(1120, 1120)])))


# ---------------------------------------------------------------- one declaration

def test_each_handle_protocol_is_declared_once_in_the_tree():
    for name in ("PrefillHandle", "DecodeHandle", "PrefillQueue", "DecodeQueue"):
        hits = [p for d in ("common", "services", "storage_gateway", "sim", "tools", "bench",
                            "integrations") for p in (REPO / d).rglob("*.py")
                if re.search(rf"^class {name}\b", p.read_text(), re.M)]
        assert [p.relative_to(REPO).as_posix() for p in hits] == \
            ["services/engine_api/handles.py"], name


@pytest.mark.parametrize("impl,proto", [
    (PrefillRequest, PrefillHandle), (RemotePrefillHandle, PrefillHandle),
    (DecodeRequest, DecodeHandle), (RemoteDecodeRequest, DecodeHandle),
    (PrefillPort, PrefillQueue), (RemotePrefillPort, PrefillQueue),
    (DecodePort, DecodeQueue), (RemoteDecodePort, DecodeQueue),
    (PrefillPort, CollectiveSignals), (RemotePrefillPort, CollectiveSignals),
    (DecodePort, CollectiveSignals), (RemoteDecodePort, CollectiveSignals)],
    ids=lambda x: x.__name__)
def test_every_implementation_follows_the_declaration(impl, proto):
    assert _follows(impl, proto) == []


def test_the_local_store_session_is_a_prefill_handle():
    pytest.importorskip("msgspec")
    from integrations.vllm.local_store import LocalPrefillSession
    assert _follows(LocalPrefillSession, PrefillHandle) == []


def test_remote_handles_are_handles_at_run_time():
    pre, dec = remote_pair(FakeClient())
    assert isinstance(pre, PrefillHandle) and isinstance(dec, DecodeHandle)
    assert _properties(PrefillHandle) <= set(dir(pre)) and _properties(DecodeHandle) <= set(dir(dec))


# ---------------------------------------------------------------- one message per call

async def test_every_request_scoped_message_is_one_handle_call():
    client = FakeClient()
    pre, dec = remote_pair(client)
    await pre.layer(0)
    pre.output(0)[:] = 1
    await pre.put_layer(0)
    await pre.finish(7)
    blk = await dec.new_block(list(range(64)))
    await dec.took_kv()
    await dec.second_token()
    await dec.put_block(blk)
    await dec.finish([5, 6])
    pre2, _ = remote_pair(client)
    await pre2.fail("gave up")
    sent = [type(m).__name__ for m in client.sent]
    assert sent == ["WaitLayer", "PutLayer", "FinishPrefill", "NewBlock", "TookKV",
                    "SecondToken", "PutBlock", "FinishDecode", "FailRequest"]
    assert all((m.request_id, m.attempt) == ("r1", 3) for m in client.sent)
    # request-scoped: the attempt is required (a claim or give-up names it only optionally,
    # before any handle exists: the engine client's calls, not a handle's)
    scoped = {t.__name__ for t in union_members(EngineRequest)
              if {"request_id", "attempt"} <= _required(t)}
    assert scoped == set(sent)


def _required(t) -> set[str]:
    fields = t.__struct_fields__
    return set(fields[:len(fields) - len(t.__struct_defaults__)])


async def test_the_remote_ports_send_one_collective_message_per_call():
    client = FakeClient()
    for port in (RemotePrefillPort(client), RemoteDecodePort(client)):  # type: ignore[arg-type]
        await port.collective_begin()
        await port.collective_end()
    assert [type(m).__name__ for m in client.sent] == ["CollectiveBegin", "CollectiveEnd"] * 2


async def test_the_in_process_port_holds_its_nodes_gate_and_closing_releases_it():
    from services.engine_api.collectives import Collectives
    from services.node.arbiter import ArbiterConfig, EgressArbiter
    arb = EgressArbiter(ArbiterConfig())
    shared = Collectives(arb, max_hold_s=30.0)
    a, b = PrefillPort("p0.e0", shared), PrefillPort("p0.e1", shared)
    await a.collective_begin()
    await b.collective_begin()
    await a.collective_end()
    assert arb.high_active and shared.active == ["p0.e1"]    # any engine of the node holds it
    b.close()                                                # its engine is gone
    assert not arb.high_active and shared.active == []
    lone = DecodePort("d0.e0")                               # no node gate: calls are no-ops
    await lone.collective_begin()
    await lone.collective_end()


async def test_a_decode_confirmation_waits_as_long_as_the_node_says_a_call_may():
    """TookKV's answer gates the load (none: recompute) and SecondToken's deadline would mark
    the attempt lost: a node that is only slow must get the wait it states, not the bare RPC
    margin (a CI run: TookKV unanswered within 5 s on a full host -> a load error)."""
    client = FakeClient()
    _, dec = remote_pair(client)
    await dec.took_kv()
    await dec.second_token()
    assert client.waits == {"TookKV": client.max_wait_s, "SecondToken": client.max_wait_s}


async def test_a_failed_call_drops_the_request_but_a_prefill_deadline_does_not():
    client = FakeClient()
    pre, dec = remote_pair(client)
    client.fail_with = DeadlineExceeded("slow")
    with pytest.raises(DeadlineExceeded):
        await pre.layer(0, 0.0)
    assert not pre.dropped
    with pytest.raises(DeadlineExceeded):
        await dec.took_kv()
    assert dec.cancelled
    client.fail_with = NotFound("gone")
    with pytest.raises(NotFound):
        await pre.put_layer(0)
    assert pre.dropped
    await pre.fail(None)                   # swallowed: the node is gone
    await pre.fail(None)                   # once ended: nothing sent
    assert [type(m).__name__ for m in client.sent].count("FailRequest") == 1


async def test_a_pipelined_put_failure_is_raised_by_the_next_call_and_finish_drains():
    client = FakeClient()
    pre, _ = remote_pair(client)
    await pre.layer(0)
    await pre.put_layer(0, wait=False)
    await pre.finish(1)                    # waits for the put before finishing
    assert [type(m).__name__ for m in client.sent] == ["WaitLayer", "PutLayer", "FinishPrefill"]
    pre, _ = remote_pair(client)
    client.fail_with = InvalidArgument("layers are put in order")
    await pre.put_layer(1, wait=False)
    await asyncio.sleep(0)
    with pytest.raises(InvalidArgument, match="in order"):
        await pre.layer(2)


async def test_layer_reads_the_next_layer_ahead_and_a_late_one_can_be_asked_again():
    """``layer(l)`` asks for ``l + 1`` as it returns, so the engine's next ``layer()`` costs
    no round trip when the KV is there; a read-ahead still waiting when the engine's timeout
    runs out raises DeadlineExceeded and goes on for the next ask."""
    client = FakeClient()
    layer1_loaded = client.loaded[1] = asyncio.Event()   # the node has not loaded layer 1 yet
    pre, _ = remote_pair(client)
    await pre.layer(0)
    await until_sent(client, 2)
    assert [(type(m).__name__, m.layer) for m in client.sent] == [   # type: ignore[attr-defined]
        ("WaitLayer", 0), ("WaitLayer", 1)]
    with pytest.raises(DeadlineExceeded, match="layer 1 .*ask again"):
        await pre.layer(1, 0.05)
    layer1_loaded.set()
    assert (await pre.layer(1, 1.0)).shape == (64, 16)
    assert len(client.sent) == 2                     # answered by the read-ahead: no new call
    await pre.fail("done")                           # nothing left ahead (layer 1 is the last)
    assert not pre._ahead


async def test_ending_a_handle_cancels_its_read_ahead():
    client = FakeClient()
    client.loaded[1] = asyncio.Event()               # never set: layer 1 never loads
    pre, _ = remote_pair(client)
    await pre.layer(0)
    ahead = pre._ahead[1]
    await until_sent(client, 2)
    await pre.fail("given up")
    await asyncio.sleep(0)
    assert ahead.cancelled() and not pre._ahead


async def test_a_failed_read_ahead_nobody_asks_for_is_not_reported_as_unretrieved():
    """The client closed under a handle: its read-ahead fails and nobody asks for that
    layer; dropping the handle must not log "Task exception was never retrieved"."""
    client = FakeClient()
    client.loaded[1] = asyncio.Event()
    pre, _ = remote_pair(client)
    await pre.layer(0)
    ahead = pre._ahead[1]
    await until_sent(client, 2)
    client.fail_with = NotFound("the node detached this engine")
    client.loaded[1].set()
    await asyncio.wait({ahead})                     # failed (NotFound); nobody asked
    assert ahead.done() and not ahead.cancelled()
    unretrieved: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    try:
        client.fail_with = None                     # its traceback holds the handle
        del pre, ahead
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert not unretrieved, unretrieved


async def until_sent(client: FakeClient, n: int) -> None:
    for _ in range(100):
        if len(client.sent) >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{n} calls expected, sent {client.sent}")


# ---------------------------------------------------------------- the in-process adapters

class PrefillBackendStub:
    def __init__(self) -> None:
        from services.engine_api.prompt import PromptInfo
        self.info = PromptInfo("r1", 0, "s", 70, 64, 2, ("ab" * 16,), None, 64)
        self.engine_id, self.hit_tokens, self.calls = "p0.e0", 64, []
        self.gate = asyncio.Event()

    async def wait_layer(self, layer):
        await self.gate.wait()
        return np.zeros((64, 16), np.uint8)

    def output_view(self, layer):
        return np.zeros((6, 16), np.uint8)

    def region_layer(self, layer):
        return np.zeros((70, 16), np.uint8)

    async def put_layer(self, layer):
        self.calls.append(("put", layer))

    async def finish(self, first):
        self.calls.append(("finish", first))

    async def fail(self, error):
        self.calls.append(("fail", error))

    def dropped(self):
        return False


async def test_the_in_process_prefill_handle_adapts_its_backend():
    b = PrefillBackendStub()
    h = PrefillRequest(b)
    assert isinstance(h, PrefillHandle) and (h.request_id, h.new_tokens) == ("r1", 6)
    with pytest.raises(DeadlineExceeded, match="ask again"):
        await h.layer(0, 0.01)
    b.gate.set()
    assert (await h.layer(0)).shape == (64, 16)
    await h.put_layer(0)
    await h.fail("engine said no")
    await h.fail("twice")
    assert b.calls[0] == ("put", 0) and len(b.calls) == 2
    assert "engine said no" in str(b.calls[1][1])


async def test_the_in_process_decode_handle_calls_its_backend_with_itself():
    calls = []

    class Backend:
        def dropped(self):
            return False

        def __getattr__(self, name):
            async def call(req, *args):
                calls.append((name, req, args))
                if name == "new_block":
                    return GeneratedBlock(1, "k", tuple(args[0]), np.zeros(1))
            return call

    class Region:
        def layer(self, layer):
            return np.zeros((70, 16))

        def whole(self):
            return None

    from services.engine_api.prompt import PromptInfo
    req = DecodeRequest(PromptInfo("r1", 0, "s", 70, 64, 2, (), None, 64), "d0.e0", 64, 5,
                        Region(), Backend())
    assert isinstance(req, DecodeHandle)
    await req.took_kv()
    blk = await req.new_block([1, 2])
    await req.put_block(blk)
    await req.finish((5, 6))
    assert [(n, r is req, a) for n, r, a in calls] == [
        ("took_kv", True, ()), ("new_block", True, ([1, 2],)), ("put_block", True, (blk,)),
        ("finish", True, ([5, 6],))]


# ---------------------------------------------------------------- the blocking bridge

def test_the_blocking_bridge_waits_for_calls_and_returns_handles_blocking():
    client = FakeClient()
    pre, dec = remote_pair(client)

    class Source:
        async def claim(self):
            return pre

        async def nothing(self):
            return None

    portal = Portal("test")
    try:
        src = Blocking(Source(), portal)
        h = src.claim()
        assert isinstance(h, Blocking) and src.nothing() is None
        assert h.hit_tokens == 64 and h.layer(0, 1.0).shape == (64, 16)
        h.put_layer(0, False)              # pipelined: returns at once
        h.finish(3)
        client.fail_with = NotFound("gone")
        with pytest.raises(NotFound):
            Blocking(dec, portal).took_kv()
    finally:
        portal.stop()
    # layer(0) asked for layer 1 ahead (read-ahead) before the pipelined put went out
    assert [type(m).__name__ for m in client.sent] == ["WaitLayer", "WaitLayer", "PutLayer",
                                                       "FinishPrefill", "TookKV"]
    assert [m.layer for m in client.sent[:2]] == [0, 1]                 # type: ignore[attr-defined]


def test_a_portal_stopping_under_its_callers_strands_none_of_them():
    """A call on its way when the portal stops (or handed over as it stops) raises
    PortalStopped; none waits forever. (Seen in CI: a vLLM worker's step failed a session
    through the attachment another thread was closing after its node died; ``loop.stop()``
    dropped the call and the step, and with it the instance, hung.)"""
    for round_ in range(20):
        outcomes = _stop_under_callers(Portal("test"), on_loop_first=bool(round_ % 2))
        assert len(outcomes) == 4, f"round {round_}: a caller hangs: {outcomes}"
        # the quick calls answer or are refused; the waits that cannot finish never return
        assert all(o in ("stopped", "0", "2") for o in outcomes), outcomes


def _stop_under_callers(portal: Portal, *, on_loop_first: bool) -> list[str]:
    """Four threads call at once (two wait forever on the loop) while ``portal`` stops."""
    never = asyncio.Event()
    started = threading.Barrier(5)
    outcomes: list[str] = []

    def caller(i: int) -> None:
        started.wait()
        try:
            outcomes.append(str(portal.call(never.wait() if i % 2 else asyncio.sleep(0, i))))
        except PortalStopped:
            outcomes.append("stopped")

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    deadline = time.monotonic() + 10.0
    while on_loop_first and len(portal._inflight) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)                 # until the two endless calls are on their way
    portal.stop()
    for t in threads:
        t.join(10.0)
    with pytest.raises(PortalStopped):    # afterwards: refused at once
        portal.call(asyncio.sleep(0))
    return outcomes


def test_a_stuck_loop_does_not_hold_its_callers_past_stop(monkeypatch):
    """A loop blocked in a callback: stop() gives up on its thread after JOIN_S and fails the
    calls still waiting for it."""
    monkeypatch.setattr(Portal, "JOIN_S", 0.2)
    portal = Portal("test")
    release = threading.Event()
    portal.loop.call_soon_threadsafe(release.wait, 10.0)     # the loop is blocked
    got: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(got, portal.call, asyncio.sleep(0)), daemon=True)
    t.start()
    deadline = time.monotonic() + 10.0
    while not portal._inflight and time.monotonic() < deadline:    # the call was handed over
        time.sleep(0.001)
    portal.stop()
    t.join(10.0)
    release.set()
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], PortalStopped)


def test_failing_a_handle_of_a_closed_client_is_a_no_op_like_a_gone_node():
    """``fail`` swallows a gone node's errors; a stopped portal is one (closing the client
    detached the engine and the node failed its attempts): a worker's error path that fails
    a session must not raise from there. Other calls raise PortalStopped (a PeerFailed)."""
    client = FakeClient()
    pre, _ = remote_pair(client)
    portal = Portal("test")
    handle = Blocking(pre, portal)
    portal.stop()
    assert handle.fail("save failed") is None
    with pytest.raises(PortalStopped):
        handle.layer(0, 1.0)
    assert client.sent == []


def _catch(into: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 -- the test looks at it
        into.append(e)
