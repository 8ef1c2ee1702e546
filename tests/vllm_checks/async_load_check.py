"""The connector's asynchronous-load state machine with a fake KV source (vLLM venv, no model).

Run by tests/test_vllm_async_load.py: the scheduler half (``SchedulerHalf``) and the off-step
claims and loads (``OffStep``) driven through vLLM's own types, every outcome checked; prints
``RESULT {...}``. Claims are held open by events, so "pending" is a state, not a race.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace as NS

from vllm.v1.outputs import KVConnectorOutput

from common.errors import NotFound
from common.kv import KVSpec
from integrations.vllm.counters import ConnectorCounters
from integrations.vllm.metadata import DualPathWorkerMeta
from integrations.vllm.off_step import LayoutRefused, OffStep, Sessions
from integrations.vllm.scheduler_half import SchedulerHalf
from integrations.vllm.sessions import ClaimStopped

SPEC = KVSpec("t", 2, 16)


class FakeSession:
    def __init__(self, hit: int, broken: bool = False, side: str = "pe") -> None:
        self.hit_tokens, self.broken, self.failed, self.took = hit, broken, None, False
        self.info = NS(read_side=side)

    def fail(self, reason: str) -> None:
        self.failed = reason

    def took_kv(self) -> None:                # a decode request (wrapped in a DecodeSession)
        self.took = True


class LateSession(FakeSession):
    """Its claim answers, then it holds ``_usable_hit`` until ``gate`` (vLLM gives the request
    up meanwhile); ``fail`` notes whether another thread could take ``lock`` then."""

    def __init__(self, hit: int, gate: threading.Event, lock) -> None:
        super().__init__(hit)
        self._hit, self._gate, self._lock = hit, gate, lock
        self.asked = threading.Event()
        self.lock_free_in_fail: bool | None = None

    @property  # type: ignore[override]
    def hit_tokens(self) -> int:
        self.asked.set()
        assert self._gate.wait(10)
        return self._hit

    @hit_tokens.setter
    def hit_tokens(self, value: int) -> None:
        pass

    def fail(self, reason: str) -> None:
        got: list[bool] = []

        def probe() -> None:
            free = self._lock.acquire(timeout=1.0)
            if free:
                self._lock.release()
            got.append(free)

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        self.lock_free_in_fail = got[0]
        super().fail(reason)


class FakeSource:
    """Claims wait on ``release[rid]``; ``outcome[rid]`` is a session or an exception."""

    spec = SPEC

    def __init__(self) -> None:
        self.release: dict[str, threading.Event] = {}
        self.outcome: dict[str, object] = {}
        self.abandoned: list[str] = []

    def planned_hit(self, params, token_ids) -> int:
        return int(params.get("hit_tokens", len(token_ids) - 1))

    def _claim(self, rid: str, stop) -> FakeSession:
        ev = self.release.setdefault(rid, threading.Event())
        while not ev.wait(0.01):
            if stop():
                raise ClaimStopped(f"{rid} given up")
        out = self.outcome[rid]
        if isinstance(out, Exception):
            raise out
        assert isinstance(out, FakeSession)
        return out

    def open_prefill(self, rid, token_ids, planned_hit, timeout_s, stop=lambda: False,
                     attempt=None):
        return self._claim(rid, stop)

    def open_decode(self, rid, token_ids, timeout_s, stop=lambda: False, attempt=None):
        return self._claim(rid, stop)

    def abandon(self, rid: str, reason: str, attempt=None) -> None:
        self.abandoned.append(rid)


def request(rid: str, n: int = 300, hit: int | None = None) -> NS:
    params = {"request_id": rid} if hit is None else {"request_id": rid, "hit_tokens": hit}
    return NS(request_id=rid, kv_transfer_params={"dualpath": params},
              prompt_token_ids=list(range(n)), output_token_ids=[])


def until(cond, what: str) -> None:
    end = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.005)


class Rig:
    """One role's two halves, wired the way vLLM wires them (metadata both ways)."""

    def __init__(self, decode: bool) -> None:
        self.source = FakeSource()
        self.sessions = Sessions()
        self.copied: list[tuple[str, int]] = []
        self.layout_ok = True
        self.sched = SchedulerHalf(self.source, decode)
        self.counters = ConnectorCounters()
        self.off = OffStep(self.source, self.sessions, decode=decode, claim_timeout_s=30,
                           num_layers=SPEC.num_layers, check_layout=self._layout,
                           copy_hit=self._copy, threads=4, counters=self.counters)

    def _layout(self) -> None:
        if not self.layout_ok:
            raise LayoutRefused("isa 'neon' not verified")

    def _copy(self, session, layer, start, stop, blocks) -> None:
        if session._req.broken:
            raise RuntimeError("layer timeout")
        self.copied.append((session, layer))

    def step(self, **output) -> list:
        """One scheduler → worker → scheduler round: the opens and loads of the metadata start
        off the step; what ended comes back as vLLM would hand it."""
        meta = self.sched.build_meta(NS(num_scheduled_tokens={}, scheduled_new_reqs=[],
                                        scheduled_cached_reqs=NS(req_ids=[])))
        for op in meta.opens:
            self.off.open(op)
        for load in meta.loads:
            self.off.load(load)
        return [meta]

    def counted(self) -> dict[str, float]:
        """The counters since the last call, claim wait seconds checked and left out."""
        got = self.counters.take()
        assert got.pop("claim_wait_seconds", 0.0) >= 0.0, got
        return got

    def report(self) -> None:
        opened, received, failed = self.off.drain()
        self.sched.worker_output(KVConnectorOutput(
            finished_recving=received, failed_recving=failed,
            kv_connector_worker_meta=DualPathWorkerMeta(opened) if opened else None))


def main() -> None:
    out: dict = {}
    # prefill: None while the claim waits; then the claimed (shortened) hit, loaded in forward
    p = Rig(decode=False)
    r = request("p1", hit=256)
    assert p.sched.matched(r, 0) == (None, False)
    p.step()
    assert p.sched.matched(r, 0) == (None, False)          # still pending: ask again
    p.source.outcome["p1"] = FakeSession(128, side="de")   # the node shortened the hit
    p.source.release["p1"].set()
    until(lambda: bool(p.off._opened), "p1 answered")
    p.report()
    assert p.sched.matched(r, 0) == (128, False), p.sched.matched(r, 0)
    out["prefill_hit_from_claim"] = 128
    counted: dict[str, dict[str, float]] = {"prefill": p.counted()}

    # decode: async load after the claim; a failed load recomputes (failed_recving)
    d = Rig(decode=True)
    ok, bad = request("d1"), request("d2")
    for x in (ok, bad):
        assert d.sched.matched(x, 0) == (None, False)
    d.source.outcome.update(d1=FakeSession(0), d2=FakeSession(0, broken=True))
    d.step()
    for rid in ("d1", "d2"):
        d.source.release.setdefault(rid, threading.Event()).set()
    until(lambda: len(d.off._opened) == 2, "decode claims answered")
    d.report()
    assert d.sched.matched(ok, 0) == (299, True)
    assert d.sched.matched(bad, 0) == (299, True)
    blocks = NS(get_block_ids=lambda: ([0, 1, 2],))
    d.sched.after_alloc(ok, blocks, 299)
    d.sched.after_alloc(bad, blocks, 299)
    d.step()
    until(lambda: len(d.off._received) == 2, "decode loads ended")
    assert d.off._failed == {"d2"}, d.off._failed
    d.report()
    assert d.sessions.get("d1")._req.took and d.sessions.get("d2") is None
    assert d.source.outcome["d2"].failed.startswith("load failed")
    assert d.sched.matched(ok, 0) == (0, False)            # loaded once: a preemption recomputes
    assert d.sched.matched(bad, 0) == (0, False)           # failed: plain vLLM
    out["decode_async"] = "ok"
    counted["decode"] = d.counted()

    # not opened: refused layout / claim NotFound → the node is told (abandon), hit 0
    n = Rig(decode=True)
    n.layout_ok = False
    r1 = request("n1")
    n.sched.matched(r1, 0)
    n.step()
    until(lambda: n.source.abandoned == ["n1"], "n1 abandoned")
    n.layout_ok = True
    r2 = request("n2")
    n.sched.matched(r2, 0)
    n.source.outcome["n2"] = NotFound("not assigned within 300 s")
    n.step()
    n.source.release.setdefault("n2", threading.Event()).set()
    until(lambda: n.source.abandoned == ["n1", "n2"], "n2 abandoned")
    n.report()
    assert n.sched.matched(r1, 0) == (0, False) and n.sched.matched(r2, 0) == (0, False)
    out["abandoned"] = n.source.abandoned
    counted["not_opened"] = n.counted()

    # given up while its claim waits: not reported to vLLM, claim stopped, node told
    g = Rig(decode=True)
    r3 = request("g1")
    g.sched.matched(r3, 0)
    g.step()
    delay, params = g.sched.finished(r3)
    assert delay is False and params is not None
    meta = g.step()[0]
    assert meta.finishes["g1"].report is False
    assert g.off.give_up("g1")
    until(lambda: g.source.abandoned == ["g1"], "g1 abandoned after give-up")
    assert not g.off.drain()[0]                            # nothing reported for it
    out["given_up"] = "ok"
    counted["given_up"] = g.counted()

    # given up after its claim answered: the session is failed (a round trip to the node) off
    # the lock the step takes to drain, give up and wait — under it the step would wait too
    q = Rig(decode=False)
    gate = threading.Event()
    late = LateSession(64, gate, q.off._cond)
    r5 = request("g2", hit=64)
    q.sched.matched(r5, 0)
    q.step()
    q.source.outcome["g2"] = late
    q.source.release.setdefault("g2", threading.Event()).set()
    until(lambda: late.asked.is_set(), "g2's claim answered")
    assert q.off.give_up("g2")
    gate.set()
    until(lambda: late.failed is not None, "g2's session failed")
    assert late.lock_free_in_fail is True, "the session was failed under the step's lock"
    assert late.failed == "request ended in vLLM before its first step", late.failed
    assert not q.off.drain()[0] and q.sessions.get("g2") is None
    out["given_up_after_claim"] = "ok"
    out["counted"] = counted
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
