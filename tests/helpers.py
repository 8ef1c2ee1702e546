"""Shared test helpers: polls with a deadline, and virtual time for rate limiters.

Tests wait for a condition, never for a fixed time (docs/contributing.md, 'Tests poll'): a poll
returns as soon as the condition holds, so a loaded CI machine only makes it slower, never flaky,
and the deadline only guards against hangs. A failing poll names what it waited for.

Rate limiters (``common.rate.TokenBucket`` and what is built on it) take an injected clock;
``VirtualTime`` is that clock plus a ``sleep`` that moves it, so a test asserts the exact
schedule instead of a rate measured on the wall clock (speed belongs to benchmarks).
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

# The scheduler's hit lookup budget in multi-process test clusters whose tests assert a turn's
# hit: they check what was stored, not how fast the index answers. The product's 1 s gives up
# (hit 0, recomputed: correct) when the whole VM stands still, and CI's host sampler has seen
# 3-7 s stalls beside the real-engine tests (ci122: 6.7 s); docs/contributing.md, flake table.
HIT_LOOKUP_S = 10.0


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then closed): a peer that died, a refused
    connect — never an address off this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


T = TypeVar("T")
What = str | Callable[[], str]

#: Generous: a deadline is there to end a hang, not to measure anything.
DEFAULT_TIMEOUT_S = 10.0


def _describe(what: What) -> str:
    return what() if callable(what) else what


def _failure(what: What, timeout: float) -> AssertionError:
    return AssertionError(f"timed out after {timeout:g}s waiting for {_describe(what)}")


async def _holds(cond: Callable[[], Any]) -> bool:
    result = cond()
    if inspect.isawaitable(result):
        result = await result
    return bool(result)


async def apoll(cond: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT_S, *,
                interval: float = 0.005) -> bool:
    """Whether ``cond`` held within ``timeout`` (checked every ``interval``; may be async).

    For a wait whose outcome a later assertion judges; most tests want ``until``.
    """
    end = time.monotonic() + timeout
    while not await _holds(cond):
        if time.monotonic() > end:
            return False
        await asyncio.sleep(interval)
    return True


async def until(cond: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT_S,
                what: What = "condition", *, interval: float = 0.005) -> None:
    """Poll ``cond`` (a callable, may return an awaitable) until true.

    ``what`` (a string, or a callable evaluated only on failure so it can show the state
    reached) names the condition in the AssertionError raised after ``timeout``.
    """
    if not await apoll(cond, timeout, interval=interval):
        raise _failure(what, timeout)


def poll(cond: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT_S, *,
         interval: float = 0.01) -> bool:
    """Blocking ``apoll``: whether ``cond`` held within ``timeout``."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(interval)
    return True


def wait_until(cond: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT_S,
               what: What = "condition", *, interval: float = 0.01) -> None:
    """Blocking ``until``, for sync tests (subprocesses, threads)."""
    if not poll(cond, timeout, interval=interval):
        raise _failure(what, timeout)


class VirtualTime:
    """A clock that moves only to the next sleeper's wake-up, and the ``sleep`` that moves it.

    Pass ``clock`` to a ``TokenBucket``/``LinkShaper`` and patch its module's ``sleep`` with
    ``sleep``; ``run(aw)`` then drives ``aw``: whenever the tasks have settled it wakes the
    earliest sleeper (ties in the order they slept) and sets ``now`` to its wake time. Time
    never moves while nobody sleeps, nor while a call wrapped by :meth:`real_io` is pending
    (``run`` then waits for it in real time), so the schedule is exact whatever the host's
    speed. ``sleeps`` lists every requested delay in order.

    Why :meth:`real_io`: "settled" is ten turns of the loop, and work in a thread pool is not
    on the loop — under load a write's thread outlasted them, the clock jumped through the
    reads' sleeps meanwhile, and the write's next charge came late in virtual time (a
    full-duplex link took 10 block times instead of 7, once in CI).
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self._real_io = 0                    # calls of real_io-wrapped functions pending
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(0.0, delay), next(self._seq), fut))
        await fut

    def real_io(self, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        """``fn`` (an async function that waits on real I/O: a thread pool, a socket) with
        time standing still while a call of it is pending."""
        async def tracked(*args: Any, **kwargs: Any) -> T:
            self._real_io += 1
            try:
                return await fn(*args, **kwargs)
            finally:
                self._real_io -= 1
        return tracked

    async def run(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` with this clock driving every sleep it makes."""
        task = asyncio.ensure_future(aw)
        while not task.done():
            for _ in range(10):              # let every runnable task reach its next await
                await asyncio.sleep(0)
            if (self._real_io or not self._wake_next()) and not task.done():
                await asyncio.sleep(0.001)   # real I/O is pending: wait for it
        return await task

    def _wake_next(self) -> bool:
        while self._sleepers:
            wake, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():               # a cancelled sleeper is skipped
                self.now = max(self.now, wake)
                fut.set_result(None)
                return True
        return False


def holders(obj: Any, depth: int = 4, limit: int = 40) -> str:
    """What keeps ``obj`` alive, as a tree of its referrers (type, and a frame's function or a
    dict's first keys) ``depth`` levels up — for a leak assertion's message, so a leak seen
    once on a loaded CI machine can be traced from its log alone."""
    import gc
    import types

    gc.collect()
    lines: list[str] = []
    seen = {id(lines)}
    here = inspect.currentframe()

    def describe(r: Any) -> str:
        if isinstance(r, types.FrameType):
            return f"frame {r.f_code.co_name} ({r.f_code.co_filename}:{r.f_lineno})"
        if isinstance(r, dict):
            return f"dict keys={list(r)[:6]}"
        if isinstance(r, (list, tuple, set)):
            return f"{type(r).__name__} of {len(r)}"
        return type(r).__qualname__

    def walk(o: Any, level: int) -> None:
        refs = gc.get_referrers(o)
        seen.add(id(refs))                   # the walker's own lists are not holders
        for r in refs:
            if len(lines) >= limit or id(r) in seen or r is here:
                continue
            if isinstance(r, types.FrameType) and r.f_code in (walk.__code__, holders.__code__):
                continue
            seen.add(id(r))
            lines.append("  " * level + describe(r))
            if level + 1 < depth and not isinstance(r, types.ModuleType):
                walk(r, level + 1)

    seen.add(id(obj))
    walk(obj, 0)
    return "held by: " + (" | ".join(lines) or "nothing (only the weakref)")


def ready_line(proc: Any) -> dict[str, Any]:
    """The JSON ready line a ``dualpath serve`` child prints once serving (lines before it
    skipped); fails with its stderr's tail when it ended without one."""
    import json
    line = proc.stdout.readline()
    while line and not line.startswith('{"event": "ready"'):
        line = proc.stdout.readline()
    assert line, proc.stderr.read()[-3000:]
    return json.loads(line)


def reap(proc: Any) -> None:
    """End a test's child process (kill if it is still running) and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def skip_or_fail(reason: str) -> NoReturn:
    """A real component a test needs is missing: skip loudly here — but fail under CI=true,
    where a skip would let CI go green without it (.ci/run installs every one)."""
    import os

    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; required under CI=true")
    pytest.skip(f"SKIPPED LOUDLY: {reason}")


def require_etcd() -> None:
    """Skip loudly where etcd cannot run — but fail under CI=true, where a skip would hide
    the election and failover tests (``make etcd`` installs it; .ci/run does)."""
    from tools.cluster.etcd_members import etcd_missing
    reason = etcd_missing()
    if reason is not None:
        skip_or_fail(reason)


def require_namespaces() -> None:
    """Skip loudly where namespace hosts cannot be made (not root, no ``ip netns``) — but fail
    under CI=true (.ci/run runs as root), where a skip would hide the multi-host tests."""
    from tools.hosts.netns import namespaces_available
    ok, reason = namespaces_available()
    if not ok:
        skip_or_fail(f"namespace hosts unavailable: {reason}")


async def two_turns_second_hits(sched: Any) -> None:
    """Two turns of one session through a scheduler client: the first (200 tokens) misses,
    the second hits the 3 full blocks (192 tokens) the first wrote back."""
    toks = [(i * 31) % 50_000 for i in range(200)]
    first = await sched.run("t1", "s", 200, 2, token_ids=toks, deadline_s=30, check=True)
    assert first.hit_tokens == 0
    second = await sched.run("t2", "s", 260, 2, token_ids=toks + [7] * 60, deadline_s=30,
                             check=True)
    assert second.hit_tokens == 192, second
