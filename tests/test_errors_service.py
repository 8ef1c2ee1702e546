"""Typed errors ↔ wire codes, and the Service lifecycle."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import (DualpathError, ErrorCode, InternalError, Overloaded, all_error_classes,
                           error_from_code)
from common.service import Service, Status, Supervisor
from tests.helpers import until


def test_every_code_has_exactly_one_class():
    classes = all_error_classes()
    assert {c.code for c in classes} == set(ErrorCode)
    for cls in classes:
        e = error_from_code(cls.code.value, "m", retry_after_s=1.5)
        assert type(e) is cls and e.message == "m" and e.retry_after_s == 1.5
        assert isinstance(e, DualpathError)


def test_unknown_code_from_a_newer_peer_maps_to_internal():
    assert isinstance(error_from_code("SOMETHING_NEW", "x"), InternalError)


def test_retryable_flags():
    assert Overloaded("x").retryable and not InternalError("x").retryable


class _Svc(Service):
    name = "svc"

    def __init__(self, fail_start=False, fail_loop=False):
        super().__init__("n1", drain_timeout_s=0.2)
        self.events: list[str] = []
        self.fail_start, self.fail_loop = fail_start, fail_loop

    async def on_start(self):
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("boom")

    def loops(self):
        async def tick():
            self.events.append("loop")
            if self.fail_loop:
                raise RuntimeError("loop died")
            await asyncio.Event().wait()
        return [tick]

    async def on_stop(self):
        self.events.append("stop")


async def test_lifecycle_is_idempotent_and_ordered():
    svc = _Svc()
    async with svc:
        await svc.start()
        assert svc.status is Status.RUNNING
        await until(lambda: "loop" in svc.events, what="the fixed loop to start")
        slow = svc.requests.spawn(asyncio.sleep(10))
    await svc.stop()
    assert svc.status is Status.CLOSED and slow.cancelled()
    assert svc.events == ["start", "loop", "stop"]


async def test_failed_start_cleans_up():
    svc = _Svc(fail_start=True)
    with pytest.raises(RuntimeError):
        await svc.start()
    assert svc.status is Status.FAILED and svc.events == ["start", "stop"]


async def test_a_dying_loop_fails_the_service_loudly():
    svc = _Svc(fail_loop=True)
    await svc.start()
    await asyncio.wait_for(svc.wait_stopped(), 5)
    assert svc.status is Status.FAILED and svc.events[-1] == "stop"


async def test_supervisor_isolates_failures_and_bounds_tasks():
    sup = Supervisor("t", limit=2)

    async def bad():
        raise ValueError("x")

    t1 = sup.spawn(bad())
    t2 = sup.spawn(asyncio.sleep(10))
    with pytest.raises(Overloaded):
        sup.spawn(asyncio.sleep(0))
    await asyncio.wait([t1])
    assert sup.failed == 1 and not t2.done()
    await sup.drain(0.01)
    assert t2.cancelled() and len(sup) == 0
