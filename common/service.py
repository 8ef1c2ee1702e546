"""The one ``Service`` base every dualpath process is built on.

Lifecycle INIT → RUNNING → CLOSING → CLOSED (or FAILED), with locked, idempotent ``start()`` and
``stop()`` and an async context manager. Fixed loops (accept, heartbeat, telemetry) run in one
``asyncio.TaskGroup`` owned by the service: if one dies, the service fails loudly instead of
limping on. Per-request work runs in a supervised set: one bad request or peer cannot cancel
the others, every task is referenced, and failures are logged with their traceback.

Shutdown order (docs/contributing.md, 'One owner per lifecycle'): stop accepting, drain requests up
to a grace period, cancel the rest, then ``on_stop`` closes endpoints and releases pools.

The process shell lives here too, once: :func:`serve_process` (signal handling, the ordered
stop, the one JSON ready line of :func:`announce_ready`), which ``dualpath serve`` runs every
role in.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import faulthandler
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import structlog

from common.errors import DualpathError, InternalError

log = structlog.get_logger(__name__)


class Status(enum.StrEnum):
    INIT = "init"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


class Supervisor:
    """A bounded set of per-request tasks that are referenced, logged and cancellable together."""

    def __init__(self, name: str, limit: int = 10_000):
        self.name = name
        self.limit = limit
        self._tasks: set[asyncio.Task] = set()
        self.failed = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        if len(self._tasks) >= self.limit:
            coro.close()
            from common.errors import Overloaded

            raise Overloaded(f"{self.name}: {self.limit} tasks already running", retry_after_s=0.1)
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failed += 1
            log.error("supervised_task_failed", supervisor=self.name, task=task.get_name(),
                      exc_info=exc)

    async def drain(self, timeout_s: float) -> None:
        """Wait for running tasks up to ``timeout_s``, then cancel the rest and wait for them."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)


class Service:
    """Base class: override ``on_start`` (bind, allocate), ``loops`` (fixed tasks), ``on_stop``."""

    name = "service"

    def __init__(self, node_id: str = "local", drain_timeout_s: float = 5.0):
        self.node_id = node_id
        self.status = Status.INIT
        self.drain_timeout_s = drain_timeout_s
        self.requests = Supervisor(f"{self.name}.requests")
        self._lock = asyncio.Lock()
        self._runner: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        self._stop_task: asyncio.Task | None = None
        self.log = log.bind(service=self.name, node_id=node_id)

    # ------------------------------------------------------------------ hooks
    async def on_start(self) -> None:
        """Bind listeners, allocate pools. Raise to fail the start (on_stop is still called)."""

    def loops(self) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        """Fixed loops run for the service's life (each returns only on shutdown)."""
        return []

    async def on_stop(self) -> None:
        """Close endpoints, release pools. Must be safe after a partial ``on_start``."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        async with self._lock:
            if self.status is not Status.INIT:
                return
            try:
                await self.on_start()
            except BaseException:
                self.status = Status.FAILED
                await self._safe_on_stop()
                self._stopped.set()
                raise
            self.status = Status.RUNNING
            self._runner = asyncio.get_running_loop().create_task(self._run_loops(),
                                                                  name=f"{self.name}.loops")
            self.log.info("service_started")

    async def _run_loops(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for fn in self.loops():
                    tg.create_task(fn(), name=f"{self.name}.{getattr(fn, '__name__', 'loop')}")
        except asyncio.CancelledError:
            raise
        except BaseException:
            self.log.exception("service_loop_failed")
            self.status = Status.FAILED
            self._request_stop()

    async def stop(self) -> None:
        async with self._lock:
            if self.status in (Status.CLOSED, Status.CLOSING):
                return
            failed = self.status is Status.FAILED
            self.status = Status.CLOSING
            if self._runner is not None:
                self._runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._runner
            await self.requests.drain(self.drain_timeout_s)
            await self._safe_on_stop()
            self.status = Status.FAILED if failed else Status.CLOSED
            self._stopped.set()
            self.log.info("service_stopped", status=self.status.value)

    async def _safe_on_stop(self) -> None:
        try:
            await self.on_stop()
        except Exception:
            self.log.exception("service_stop_failed")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> Service:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _request_stop(self) -> None:
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self.stop(), name=f"{self.name}.stop")


# --------------------------------------------------------------------------- process shell

class StopSignals:
    """SIGTERM/SIGINT as one stop event: the only signal handling a dualpath process has.

    Installed before anything starts and removed only after everything stopped, so a signal
    during start or during the ordered stop never kills the process half-way (default action).
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._event = asyncio.Event()
        self._installed: list[signal.Signals] = []

    def __enter__(self) -> StopSignals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not main thread
                loop.add_signal_handler(sig, self._on_signal, sig)
                self._installed.append(sig)
        return self

    def __exit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("signal_received", signal=sig.name)
        self.received = sig
        self._event.set()

    async def wait(self, service: Service) -> bool:
        """Until a signal arrives (True) or ``service`` stops on its own (False)."""
        tasks = [asyncio.ensure_future(self._event.wait()),
                 asyncio.ensure_future(service.wait_stopped())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
        return self._event.is_set()


def announce_ready(info: Mapping[str, Any], ready_file: Path | None = None) -> None:
    """The one ready line: JSON on stdout and, written atomically, in ``ready_file``.

    Scripts read the first stdout line, launchers poll the file; readers never see half a line.
    """
    line = json.dumps(dict(info))
    if ready_file is not None:
        tmp = ready_file.with_suffix(ready_file.suffix + ".tmp")
        tmp.write_text(line + "\n")
        tmp.replace(ready_file)
    print(line, flush=True)


StartFn = Callable[[contextlib.AsyncExitStack], Awaitable[tuple[Service, dict[str, Any]]]]


async def serve_process(start: StartFn, ready_file: Path | None = None) -> None:
    """The process shell: signals first, ``start`` (everything it enters into the exit stack
    stops in reverse order), one ready line, then wait for a signal or the service's end.

    ``start`` returns the main service and its ready info. A service that stops on its own
    (a fatal loop error) raises :class:`InternalError` after the ordered stop: exit status 1.
    """
    with StopSignals() as signals:
        async with contextlib.AsyncExitStack() as stack:
            svc, info = await start(stack)
            announce_ready(info, ready_file)
            if not await signals.wait(svc):
                raise InternalError(f"{info.get('service', svc.name)} stopped on its own "
                                    f"(status {svc.status.value})")


def run(main: Coroutine[Any, Any, Any], use_uvloop: bool = True) -> Any:
    """Run ``main`` on uvloop when asked (it roughly doubles small-message rates with ucxx)."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a hard dependency
            use_uvloop = False
    if use_uvloop:
        return uvloop.run(main)
    return asyncio.run(main)


def run_cli(prog: str, main: Coroutine[Any, Any, Any], use_uvloop: bool = True) -> int:
    """Run a service's ``main`` for a command line: its exit status, never a traceback.

    0 when it returned or was interrupted (Ctrl-C), 1 when it failed with a typed error or an
    OS error (port in use, unreadable file) — printed as one line prefixed by ``prog``.
    A fatal signal (SIGSEGV, SIGBUS, SIGABRT from a native library) writes every thread's
    Python stack to stderr — the service's log — so a crash is diagnosable after the fact.
    """
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    try:
        run(main, use_uvloop=use_uvloop)
    except DualpathError as e:
        print(f"{prog}: {type(e).__name__}: {e.message}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
