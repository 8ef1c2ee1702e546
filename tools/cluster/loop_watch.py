"""Who held the loop: a watchdog thread for an event loop that must keep running.

Every ``dualpath serve`` process runs one (``[logging] loop_stall_s``,
:meth:`tools.cluster.serve.Serving.watch_loop`): a node whose loop stands still misses its
heartbeats and loses its lease. An in-process cluster (:mod:`tools.cluster.inprocess`) runs
every service in the caller's loop, so one synchronous stretch anywhere — a copy, a checksum,
a blocking call — stops all of them at once: heartbeats, transfers, the scheduler's sweeps.
The scheduler no longer holds such a stall against its nodes
(``SchedulerService._lease_loop``), but the stall itself is a defect worth finding.
:class:`LoopStallWatch` ticks in the loop every ``tick_s``; a thread checks the last tick and,
when the loop has not run for ``threshold_s`` (it sleeps until then, not tick by tick), logs
``event_loop_blocked`` once per stall with the loop thread's stack at that moment (the code
holding it) and, when the loop runs again, ``event_loop_resumed`` with the stall's length.
``stalls`` keeps the latest stalls' lengths for a test or tool to read, :meth:`stats` the
counts of all of them (a service's ``/metrics``).

That watcher is a Python thread: it needs the GIL, so a loop thread stuck *inside a C call
that holds the GIL* (a blocking call in an extension) stops it too, and it can only report
the stall afterwards, with the stack of wherever the loop thread is by then (seen in CI: a
40-s stall reported at its end). So with ``dump_to`` each tick also pushes back a POSIX
timer (:class:`StallAlarm`: ``timer_settime``, one syscall); a loop that has not ticked for
``dump_after_s`` lets it fire, and ``faulthandler``'s C signal handler writes every thread's
Python stack to that file *during* the stall, without the GIL. (A first version re-armed
``faulthandler.dump_traceback_later`` on every tick instead: each re-arm joins one watchdog
thread and starts another while holding the GIL, and under CI's load one re-arm itself held
the loop 1.2 s.) The signal's handler is one per process: it writes to the newest watch's file.

Python stacks say where the loop thread entered the kernel, not why it stayed there (seen in
CI: 50.9 s and 28.2 s inside a non-blocking ``socket.send``). So the watcher also reads what
the kernel says of the loop thread (:func:`thread_kernel_state`, Linux ``/proc``): at the
stall's start and on every tick while it lasts. ``event_loop_resumed`` then carries the loop
thread's CPU and run-queue seconds over the stall (from the watcher's first reading in it
on: ``measured_s``) and the kernel's last word (state, wchan, kernel stack where readable).
``runqueue_s`` near the stall's length means it was runnable but got no CPU; ``cpu_s`` near
it means it ran (in the kernel, if the stack says so); neither, in state S or D, means it
slept in the kernel where ``wchan`` says; neither in state R means its CPU itself did not
run (a virtual CPU its host had stopped: the guest counts that as steal time, not as the
thread's). Beside it, ``host_cpu_s`` says what all of the machine's ``host_cpus`` CPUs did
over ``measured_s`` (``/proc/stat``: ``busy``, ``idle``, ``iowait``, ``steal``): a loop
thread waiting on the run queue while the CPUs were ``busy`` lost them to other work of this
machine; with ``steal`` the hypervisor ran something else; with ``idle`` the wait was not
for a CPU; ``top_cpu`` names the processes that used the most CPU meanwhile
(``/proc/<pid>/stat``, read once at each end of the window: a few ms, once per stall). The
kernel charges a wait on the run queue when the thread next gets a CPU, the whole wait at
once, so ``runqueue_s`` may exceed ``measured_s`` (it began before the first reading):
compare it with ``stalled_s``. (The project's CI on 2026-12-07: every stall of 1-5 s read
state R, ``cpu_s`` 0 and ``runqueue_s`` 0.5-2.9 s: a loop thread starved of CPU on the 2
cores.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import structlog

from tools.host_sampler import TICKS_PER_S, command, cpu_times, process_cpu

log = structlog.get_logger("loop_watch")

# where an in-process cluster's stall dumps go, in its root (tools/cluster/inprocess.py); a
# failed real-engine test's report carries its tail (tests/log_digest.py)
LOOP_STALLS_FILE = "loop-stalls.log"
# the signal of the stall dumps: a real-time one no library here uses
STALL_SIGNAL = signal.SIGRTMIN + 5
STALLS_KEPT = 64            # LoopStallWatch.stalls: the latest stalls' lengths
TOP_CPU_USERS = 5           # processes named in a stall's resume line (top_cpu)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Sigevent(ctypes.Structure):      # struct sigevent (Linux): 64 bytes
    _fields_ = [("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int),
                ("sigev_notify", ctypes.c_int), ("_pad", ctypes.c_int * 12)]


_CLOCK_MONOTONIC, _SIGEV_THREAD_ID = 1, 4

# The dump files of the watches alive now, newest last. faulthandler has one handler for the
# signal: it writes to the newest watch's file, and is removed only with the last watch (the
# signal's default action would end the process should another watch's timer fire).
_dump_files: list[IO[str]] = []
_dump_files_lock = threading.Lock()


def _register_dump(file: IO[str]) -> None:
    with _dump_files_lock:
        _dump_files.append(file)
        faulthandler.register(STALL_SIGNAL, file=file, all_threads=True)


def _unregister_dump(file: IO[str]) -> None:
    with _dump_files_lock:
        _dump_files.remove(file)
        if _dump_files:
            faulthandler.register(STALL_SIGNAL, file=_dump_files[-1], all_threads=True)
        else:
            faulthandler.unregister(STALL_SIGNAL)


def thread_kernel_state(native_id: int) -> dict[str, Any]:
    """What the kernel says of one thread of this process (Linux ``/proc``; empty elsewhere):
    ``state`` (R running or runnable, S sleeping, D uninterruptible), ``cpu_s`` and
    ``runqueue_s`` so far (``schedstat``: on a CPU; runnable but waiting for one), ``wchan``
    (where it sleeps in the kernel) and, where readable (root), ``kernel_stack``."""
    task = Path(f"/proc/self/task/{native_id}")
    out: dict[str, Any] = {}
    try:
        stat = (task / "stat").read_text()
        out["state"] = stat[stat.rindex(")") + 2]
        on_cpu, waiting = (task / "schedstat").read_text().split()[:2]
        out["cpu_s"], out["runqueue_s"] = int(on_cpu) / 1e9, int(waiting) / 1e9
        out["wchan"] = (task / "wchan").read_text().strip() or "-"
        frames = (task / "stack").read_text().splitlines()
    except (OSError, ValueError, IndexError):
        return out
    # "[<0>] tcp_sendmsg+0x2c/0x50" -> "tcp_sendmsg", innermost first
    out["kernel_stack"] = " < ".join(f.split("] ", 1)[-1].split("+", 1)[0] for f in frames[:10])
    return out


def host_cpu_times() -> dict[str, float]:
    """What every CPU of this (virtual) machine did since boot, in seconds (``/proc/stat``;
    empty elsewhere): ``busy`` (user, nice, system, irq, softirq), ``idle``, ``iowait`` and
    ``steal`` (time the hypervisor ran something else on a virtual CPU that had work)."""
    ticks = cpu_times()
    if not ticks:
        return {}
    busy = sum(ticks.get(k, 0) for k in ("user", "nice", "system", "irq", "softirq"))
    return {"busy": busy / TICKS_PER_S, "idle": ticks.get("idle", 0) / TICKS_PER_S,
            "iowait": ticks.get("iowait", 0) / TICKS_PER_S,
            "steal": ticks.get("steal", 0) / TICKS_PER_S}


def top_cpu_users(before: dict[int, tuple[str, int, int]], after: dict[int, tuple[str, int, int]],
                  n: int = TOP_CPU_USERS) -> list[str]:
    """The ``n`` processes that used the most CPU between two :func:`process_cpu` snapshots:
    ``"<cpu seconds> <pid> <command>"``, most first (who held the CPUs a stalled loop waited
    for)."""
    used = sorted(((ticks - before[pid][1], pid, name)
                   for pid, (name, ticks, _) in after.items() if pid in before), reverse=True)
    return [f"{d / TICKS_PER_S:.2f} {pid} {command(pid, name, 60)}"
            for d, pid, name in used[:n] if d > 0]


class StallAlarm:
    """A one-shot POSIX timer on the monotonic clock that sends :data:`STALL_SIGNAL` to the
    thread ``thread_id`` (a native id: Linux's ``SIGEV_THREAD_ID``) — the watcher's, so the
    signal never interrupts a system call of the stalled code; :meth:`push` re-arms it (a
    syscall: no thread, nothing waited for), :meth:`close` deletes it. Linux only."""

    def __init__(self, thread_id: int) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._timer = ctypes.c_void_p()
        event = _Sigevent(sigev_signo=STALL_SIGNAL, sigev_notify=_SIGEV_THREAD_ID)
        event._pad[0] = thread_id               # the union's _tid
        if self._libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event),
                                   ctypes.byref(self._timer)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timer_create: {os.strerror(err)}")

    def push(self, after_s: float) -> None:
        """Fire ``after_s`` from now (0: never), replacing any earlier arming."""
        whole = int(after_s)
        spec = _Itimerspec(it_value=_Timespec(whole, int((after_s - whole) * 1e9)))
        self._libc.timer_settime(self._timer, 0, ctypes.byref(spec), None)

    def close(self) -> None:
        if self._timer:
            self._libc.timer_delete(self._timer)
            self._timer = ctypes.c_void_p()


class LoopStallWatch:
    """Report the stack of a loop thread that stopped running callbacks (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, threshold_s: float = 1.0,
                 tick_s: float | None = None, dump_to: Path | int | None = None,
                 dump_after_s: float = 10.0) -> None:
        """``tick_s``: how often the loop marks that it runs (None: a quarter of
        ``threshold_s``, at most 0.25 s — a stall's length is known to a tick). ``dump_to``:
        a file (appended to) or a file descriptor (duplicated: a service's stderr, its log)
        that every thread's stack is written to during a stall of ``dump_after_s``; None: no
        dump."""
        self.loop, self.threshold_s = loop, threshold_s
        self.tick_s = min(threshold_s / 4, 0.25) if tick_s is None else tick_s
        self.dump_to, self.dump_after_s = dump_to, dump_after_s
        self._dump_file: IO[str] | None = None
        self._alarm: StallAlarm | None = None
        # seconds, one per stall past the threshold: the latest STALLS_KEPT (a service runs for
        # months); every stall is counted in the totals
        self.stalls: deque[float] = deque(maxlen=STALLS_KEPT)
        self.stall_count, self.stall_s_total, self.stall_max_s = 0, 0.0, 0.0
        self._last = time.monotonic()
        # the stall the watcher saw and the loop has not closed yet; the lock makes "the loop
        # ticked" and "the watcher saw a stall" exclusive (the watcher's /proc reads release
        # the GIL: without it a tick could slip between its check and its mark)
        self._stall: _Stall | None = None
        self._lock = threading.Lock()
        self._loop_thread = threading.get_ident()
        self._loop_native_id = threading.get_native_id()
        self._stop = threading.Event()
        self._handle: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._watch, name="loop-stall-watch",
                                        daemon=True)

    def start(self) -> None:
        """Start from the loop's own thread (its stack is the one reported)."""
        self._loop_thread = threading.get_ident()
        self._loop_native_id = threading.get_native_id()
        if isinstance(self.dump_to, int):     # a dup: stop() closes it, never the fd itself
            self._dump_file = os.fdopen(os.dup(self.dump_to), "a")
        elif self.dump_to is not None:
            self._dump_file = open(self.dump_to, "a")     # noqa: SIM115 -- closed in stop()
        if self._dump_file is not None:
            _register_dump(self._dump_file)
        self._thread.start()
        if self._dump_file is not None:
            assert self._thread.native_id is not None       # set once started
            self._alarm = StallAlarm(self._thread.native_id)
        self._tick()

    def stats(self) -> dict[str, float]:
        """The stalls so far, for ``/metrics`` (``dualpath_stat{service="event_loop"}``):
        their number, summed and longest length, and whether the loop stands still now."""
        return {"loop_stalls": self.stall_count, "loop_stall_s_total": self.stall_s_total,
                "loop_stall_max_s": self.stall_max_s,
                "loop_stalled_now": float(self._stall is not None)}

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._alarm is not None:
            self._alarm.close()           # (Linux drops a signal of it still pending)
            self._alarm = None
        if self._dump_file is not None:
            _unregister_dump(self._dump_file)
            self._dump_file.close()
            self._dump_file = None
        self._thread.join(timeout=5 * self.tick_s + 1.0)

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            stall, self._stall, self._last = self._stall, None, now
        if stall is not None:                     # the watcher saw this stall: close it
            stalled = now - stall.since
            self.stalls.append(stalled)
            self.stall_count += 1
            self.stall_s_total += stalled
            self.stall_max_s = max(self.stall_max_s, stalled)
            # (the process scan only where the watcher's own one ended: it runs on the loop)
            kernel = stall.kernel_report(thread_kernel_state(self._loop_native_id), now,
                                         host_cpu_times(),
                                         process_cpu() if stall.first_procs else None)
            log.warning("event_loop_resumed", stalled_s=round(stalled, 3), **kernel)
            if self._dump_file is not None and stalled >= self.dump_after_s:
                self._dump_file.write(f"== the loop stood still {stalled:.1f} s "
                                      f"until {time.strftime('%H:%M:%S')} (stacks above: "
                                      f"written {self.dump_after_s:g} s into it); the loop "
                                      f"thread in the kernel: {kernel}\n")
                self._dump_file.flush()
        if self._alarm is not None:            # the loop ran: push the C dump back
            self._alarm.push(self.dump_after_s)
        self._handle = self.loop.call_later(self.tick_s, self._tick)

    def _watch(self) -> None:
        # wakes when the loop would have been silent threshold_s (not every tick): an idle
        # service's watcher wakes about once per threshold_s
        wait = self.tick_s
        while not self._stop.wait(wait):
            wait = self.tick_s
            with self._lock:
                stall, idle = self._stall, time.monotonic() - self._last
                fresh = stall is None and idle >= self.threshold_s
                if fresh:                       # the stall began at the last tick
                    stall = self._stall = _Stall(self._last)
            if stall is None:
                wait = max(self.threshold_s - idle, self.tick_s)
                continue
            stall.latest = thread_kernel_state(self._loop_native_id)
            if not fresh:                       # still stalled: the kernel's latest word
                continue
            # the window starts at the first reading, not at the detection: under load the
            # watcher may wait long for the GIL between the two (a spinning loop thread that
            # the kernel has preempted holds it), and a window counted from the detection
            # would be longer than the one the readings span
            # (one assignment: the loop may resume between any two, and must see all three
            # or none; the process scan, slower, is published after them)
            stall.first = (time.monotonic(), stall.latest, host_cpu_times())
            stall.first_procs = process_cpu()
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            log.warning("event_loop_blocked", blocked_s=round(idle, 3), kernel=stall.first[1],
                        stack=stack)


class _Stall:
    """One stall the watcher saw: when it began (the loop's last tick), when the watcher saw
    it, and what the kernel said of the loop thread then and last."""

    def __init__(self, since: float) -> None:
        self.since = since
        # the watcher's first reading in the stall: when, the loop thread's state, the CPUs'
        self.first: tuple[float, dict[str, Any], dict[str, float]] = (since, {}, {})
        self.latest: dict[str, Any] = {}
        self.first_procs: dict[int, tuple[str, int, int]] = {}

    def kernel_report(self, now_state: dict[str, Any], now: float,
                      now_host: dict[str, float] | None = None,
                      now_procs: dict[int, tuple[str, int, int]] | None = None
                      ) -> dict[str, Any]:
        """The loop thread's CPU and run-queue seconds from the watcher's first reading in
        the stall until ``now`` (``measured_s``), what the machine's CPUs did meanwhile
        (``host_cpu_s``) and which processes used them (``top_cpu``), and the kernel's latest
        word during it (module doc)."""
        (first_at, first, first_host), out = self.first, {}
        for key in ("cpu_s", "runqueue_s"):
            if key in first and key in now_state:
                out[key] = round(max(0.0, now_state[key] - first[key]), 3)
        if now_host and first_host:
            out["host_cpu_s"] = {k: round(max(0.0, now_host[k] - first_host[k]), 2)
                                 for k in now_host if k in first_host}
            out["host_cpus"] = os.cpu_count() or 0
        if now_procs and self.first_procs:
            out["top_cpu"] = top_cpu_users(self.first_procs, now_procs)
        if out:
            out["measured_s"] = round(now - first_at, 3)
        out.update({k: self.latest[k] for k in ("state", "wchan", "kernel_stack")
                    if k in self.latest})
        return out


@contextlib.contextmanager
def watching(threshold_s: float = 1.0, dump_to: Path | int | None = None,
             dump_after_s: float = 10.0) -> Iterator[LoopStallWatch]:
    """Watch the running loop for the ``with`` block (call from inside the loop);
    ``dump_to``: where every thread's stack goes when the loop stalls ``dump_after_s``."""
    watch = LoopStallWatch(asyncio.get_running_loop(), threshold_s=threshold_s,
                           dump_to=dump_to, dump_after_s=dump_after_s)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()
