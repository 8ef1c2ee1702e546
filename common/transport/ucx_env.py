"""The UCX runtime environment of a process: variables set before ``ucxx`` is imported and
the event-loop progress driver of a UCX worker (this module does not import ucxx itself).

Measured on the 2-core loopback hosts (docs/performance.md, 'UCX facts'):

* Endpoints made by listeners/``create_endpoint`` use error handling; UCX then silently drops
  the posix/sysv shared-memory transports unless ``UCX_POSIX_ERROR_HANDLING=y`` and
  ``UCX_SYSV_ERROR_HANDLING=y`` — and everything runs over tcp/lo at a tenth of the speed.
* ``UCX_WARN_UNUSED_ENV_VARS=n`` silences a harmless warning about variables meant for
  transports this build lacks.
* Under endpoint error handling UCX never selects ``cma`` for rendezvous (it demands memory
  invalidation, which cma lacks), so large messages go "fragmented copy-in copy-out" through
  sysv in 8 KiB pieces: two copies and a progress round per fragment on both sides. Endpoints
  without error handling, made from the peer's worker address, get cma get-zcopy: one copy,
  by the receiver. :func:`single_copy_supported` says whether this process may use them
  (``DUALPATH_UCX_SINGLE_COPY=0`` turns them off); :func:`local_host_id` whether a peer
  shares the host (docs/performance.md, "Single copy").

Variables the user already set always win (operators tune UCX through its environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, MutableMapping
from typing import Any

UCX_PREFIX = "UCX_"
SINGLE_COPY_ENV = "DUALPATH_UCX_SINGLE_COPY"
_OFF = ("0", "n", "no", "false", "off")
_ON = ("1", "y", "yes", "true", "on")
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def ucx_env_defaults(shared_memory: bool) -> dict[str, str]:
    """The UCX variables dualpath wants (before the user's environment is applied)."""
    env = {"UCX_WARN_UNUSED_ENV_VARS": "n"}
    if shared_memory:
        env["UCX_POSIX_ERROR_HANDLING"] = "y"
        env["UCX_SYSV_ERROR_HANDLING"] = "y"
    return env


def apply_ucx_env(shared_memory: bool,
                  environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the defaults that are not set yet; returns what was set (for the start log)."""
    environ = os.environ if environ is None else environ
    applied = {}
    for key, value in ucx_env_defaults(shared_memory).items():
        if key not in environ:
            environ[key] = value
            applied[key] = value
    return applied


def options_overridden_by_env(options: dict[str, str],
                              environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Traffic-class option names whose ``UCX_<NAME>`` variable the user set (env wins)."""
    environ = os.environ if environ is None else environ
    return [name for name in options if UCX_PREFIX + name in environ]


def single_copy_supported(tls: str | None,
                          environ: MutableMapping[str, str] | None = None,
                          yama_path: str = _YAMA) -> tuple[bool, str]:
    """``(allowed, reason)``: may this process move data over cma single-copy endpoints?

    Off unless ``DUALPATH_UCX_SINGLE_COPY=1``: those endpoints have no UCX error handling, and
    when a peer is killed while this process reads its memory, UCX treats the failed
    ``process_vm_readv`` (ESRCH) as unhandled and aborts *this* process (seen under the chaos
    tests: a DE loader aborted when its PE was killed mid hand-off). A peer crash must never
    take a survivor with it, so the faster path is an explicit opt-in (docs/performance.md).
    ``tls`` is the traffic class's ``TLS`` option; ``UCX_TLS`` in the environment wins. Also
    off when the transports exclude cma, when CUDA transports are in play (device arenas
    would then meet an endpoint without error handling: not tested), or when Yama restricts
    ptrace (cma's ``process_vm_readv`` would be refused between unrelated processes).
    """
    environ = os.environ if environ is None else environ
    choice = environ.get(SINGLE_COPY_ENV, "").strip().lower()
    if choice in _OFF:
        return False, f"{SINGLE_COPY_ENV} is off"
    if choice not in _ON:
        return False, (f"off by default ({SINGLE_COPY_ENV}=1 turns it on): a peer killed "
                       "mid-transfer would abort this process")
    tls = environ.get(UCX_PREFIX + "TLS", tls) or "all"
    names = {t.strip().lower() for t in tls.lstrip("^").split(",")}
    if tls.startswith("^"):
        if names & {"sm", "cma"}:
            return False, f"UCX_TLS={tls} excludes cma"
    elif not names & {"all", "sm", "cma"}:
        return False, f"UCX_TLS={tls} has no cma"
    elif any(n.startswith("cuda") for n in names) or (names & {"all"} and cuda_present()):
        return False, f"UCX_TLS={tls} moves device memory: single copy is host-only"
    try:
        with open(yama_path) as f:
            scope = f.read().strip()
    except OSError:
        scope = "0"
    if scope != "0":
        return False, f"kernel.yama.ptrace_scope={scope} refuses cma between processes"
    return True, "cma single copy between processes of this host"


def cuda_present() -> bool:
    """Whether this process sees a CUDA device (cupy; False without it)."""
    from common.transport.plan import cuda_available
    return cuda_available()


def local_host_id() -> str:
    """Boot id + pid and ipc namespaces: equal for two processes that can use cma and shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = [str(os.stat(f"/proc/self/ns/{name}").st_ino) for name in ("pid", "ipc")]
    except OSError:
        return ""  # not Linux: no single copy
    return "/".join([boot, *ns])


def _proc_stat(pid: int) -> list[str]:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or []."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def local_process_id(pid: int | None = None) -> str:
    """``pid:start time`` of a process (start time in clock ticks since boot), or ""."""
    pid = os.getpid() if pid is None else pid
    fields = _proc_stat(pid)
    return f"{pid}:{fields[19]}" if len(fields) > 19 else ""


def process_gone(process_id: str) -> bool:
    """True only when the process ``local_process_id`` named is known to have ended
    (no such pid, another process under that pid, or a zombie)."""
    pid, _, start = process_id.partition(":")
    if not pid.isdigit() or not start:
        return False
    fields = _proc_stat(int(pid))
    return len(fields) <= 19 or fields[19] != start or fields[0] in ("Z", "X")


class WorkerProgress:
    """Event-driven progress of one UCX worker on the asyncio loop (0 % CPU when idle).

    Replaces ucxx's ``BlockingMode``, which never re-arms the worker after the first event:
    once a connection exists, the fd stays readable and the process spins at 100 % of a core
    (measured: 0.99-1.01 CPU idle, docs/performance.md). A round: progress until idle, wake
    the waiters, re-arm the worker (if UCX reports pending events, run again) and sleep on
    its fd. Polling instead of arming was measured slower here (1 MiB x 8: 1.7-8.2 vs
    9.4-10 GB/s; 42 KB x 1: 2-3x slower), so there is no spin.
    Posting code calls :meth:`kick`; a timer guards against lost wake-ups (5 ms while
    someone waits, 1 s when idle: ~0 CPU).
    """

    FAST_S = 0.005
    IDLE_S = 1.0

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._worker, self._loop = worker, loop
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        loop.add_reader(self._fd, self._run)
        self._scheduled = self._closed = False
        self._waiter: asyncio.Future | None = None
        self._busy = 0
        self.hooks: list[Callable[[], None]] = []   # run after each round (shm control)
        self._timer = loop.call_later(self.IDLE_S, self._on_timer)
        self.kick()

    def kick(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def tick(self) -> asyncio.Future:
        """A future resolved after the next progress round (shared by all waiters)."""
        if self._waiter is None:
            self._waiter = self._loop.create_future()
            if self._timer.when() - self._loop.time() > self.FAST_S:
                self._reschedule()
        return self._waiter

    @contextlib.contextmanager
    def busy(self):
        """Fast safety timer while ucxx's own (polling) coroutines run, e.g. a connect."""
        self._busy += 1
        self._reschedule()
        try:
            yield
        finally:
            self._busy -= 1

    def _run(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        self._worker.progress()
        for hook in self.hooks:
            hook()
        self._wake()
        if not self._worker.arm():
            self.kick()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_timer(self) -> None:
        self._run()
        self._reschedule()

    def _reschedule(self) -> None:
        if self._closed:
            return
        self._timer.cancel()
        fast = self._waiter is not None or self._busy
        self._timer = self._loop.call_later(self.FAST_S if fast else self.IDLE_S, self._on_timer)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._timer.cancel()
            self._loop.remove_reader(self._fd)
            self._wake()
