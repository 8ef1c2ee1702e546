"""Named failpoints (gofail / FoundationDB-buggify style) for fault-injection tests.

A service calls ``failpoint("de.read.batch")`` at a point of a request where a crash, a pause
or an error matters. Unarmed (the normal case) that is one dict lookup on an empty dict. The
environment arms points per process, so a test can crash exactly one service at exactly one
step of a request while everything else runs unchanged::

    DUALPATH_FAILPOINTS="de.read.batch=kill@2;pe.handoff.send=stop@1"

``NAME=ACTION[@N]``, ``;``-separated. Actions:

* ``kill``      — SIGKILL this process (a crash: no cleanup, no goodbye on any socket);
* ``stop``      — SIGSTOP this process (a pause: sockets stay open, nothing answers; the
  harness sends SIGCONT later);
* ``delay:S``   — block the whole process for S seconds (a stall, e.g. a GC or swap pause);
* ``error``     — raise ``Unavailable`` (retryable) at that point;
* ``partition:S`` — from that hit on, every hit raises ``Unavailable`` for S seconds (a node
  cut off from a peer, then healed; e.g. ``node.sched.call``: its scheduler calls);
* ``latency:S`` — from that hit on, every hit waits S seconds (a slow disk, ``gw.read``), until
  disarmed; only where the point is awaited (``afailpoint``), the process keeps running.

``@N`` fires on the N-th hit of that point in this process (default 1), once. A running
process can be (re-)armed without a restart: when ``DUALPATH_FAILPOINTS_FILE`` names a file,
SIGUSR1 makes the process re-read its spec from that file (the chaos harness arms one
victim this way at a chosen moment; hit counts restart from zero). Names are
checked against :data:`FAILPOINTS` and the spec is parsed when the module is imported and by
:func:`check_env` (``dualpath serve`` calls it before starting: a typo exits 2 with the
reason, it never silently injects nothing). Every fire is logged and counted
(:func:`fired`) before it acts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from common.errors import ConfigError, Unavailable

ENV = "DUALPATH_FAILPOINTS"
FILE_ENV = "DUALPATH_FAILPOINTS_FILE"

# Where each point sits (the request step it interrupts).
FAILPOINTS: dict[str, str] = {
    "pe.read.batch": "PE receiver, PE-path read: before asking its gateway for the hit blocks",
    "pe.pull.recv": "PE receiver, DE path: PullLayers sent, the DE loader's layers in flight",
    "pe.handoff.send": "PE receiver: sending a prefilled layer to the DE loader (PE→DE)",
    "de.read.batch": "DE loader, DE-path read: before asking its gateway for the hit blocks",
    "de.pull.send": "DE loader: sending pulled layers to the PE receiver (DE→PE)",
    "de.assemble": "DE loader: PrefillDone received, waiting for the PE's layers",
    "de.writeback": "DE loader: writing prompt/generated blocks back to its gateway",
    "de.decode": "DE loader: decode running (second token reported)",
    "gw.read": "storage gateway: a read checked and queued, about to read (UCX or shm path)",
    "gw.write": "storage gateway: a write's blocks received, about to be stored",
    "node.sched.call": "PE receiver / DE loader: any call to the scheduler (register, "
                       "heartbeat, fetch, report)",
    "vllm.step": "vLLM connector, worker side: a step bound its metadata, its forward about "
                 "to run (delay: a step that does not end while the client's thread beats)",
}
ACTIONS = ("kill", "stop", "delay", "error", "partition", "latency")
TIMED = ("delay", "partition", "latency")      # actions that take seconds: ACTION:S


@dataclass
class _Point:
    name: str
    action: str
    at: int = 1
    delay_s: float = 0.0
    hits: int = 0
    fired: int = 0
    until: float = 0.0              # partition: monotonic end

def parse(spec: str) -> dict[str, _Point]:
    """``NAME=ACTION[@N];...`` → points; ConfigError names the first bad entry."""
    out: dict[str, _Point] = {}
    for item in (s.strip() for s in spec.split(";")):
        if not item:
            continue
        name, sep, rest = item.partition("=")
        name = name.strip()
        if not sep or not rest:
            raise ConfigError(f"{ENV}: {item!r} is not NAME=ACTION[@N]")
        if name not in FAILPOINTS:
            raise ConfigError(f"{ENV}: unknown failpoint {name!r}; known: {sorted(FAILPOINTS)}")
        action, _, at = rest.strip().partition("@")
        kind, _, arg = action.partition(":")
        p = _Point(name, kind)
        if kind not in ACTIONS:
            raise ConfigError(f"{ENV}: {name}: unknown action {kind!r}; one of {ACTIONS}")
        if kind in TIMED:
            try:
                p.delay_s = float(arg)
            except ValueError:
                raise ConfigError(f"{ENV}: {name}: {kind} needs seconds, e.g. {kind}:0.5"
                                  ) from None
            if not 0 <= p.delay_s <= 3600:
                raise ConfigError(f"{ENV}: {name}: {kind} {p.delay_s} outside [0, 3600] s")
        elif arg:
            raise ConfigError(f"{ENV}: {name}: action {kind!r} takes no argument")
        if at:
            if not at.isdigit() or int(at) < 1:
                raise ConfigError(f"{ENV}: {name}: @N needs a hit number >= 1, got {at!r}")
            p.at = int(at)
        if name in out:
            raise ConfigError(f"{ENV}: failpoint {name!r} armed twice")
        out[name] = p
    return out


def _from_env() -> dict[str, _Point]:
    try:
        return parse(os.environ.get(ENV, ""))
    except ConfigError:
        return {}                      # check_env() reports it; importing never fails


_armed: dict[str, _Point] = _from_env()


def check_env() -> dict[str, str]:
    """Parse the environment's spec (ConfigError if bad); returns ``{name: action}`` armed.

    With ``DUALPATH_FAILPOINTS_FILE`` set, also installs the SIGUSR1 re-arm handler (call
    from the main thread, before the event loop starts)."""
    global _armed
    _armed = parse(os.environ.get(ENV, ""))
    if os.environ.get(FILE_ENV):
        signal.signal(signal.SIGUSR1, _reload)
    return {n: p.action for n, p in _armed.items()}


def _reload(signum: int = 0, frame: object = None) -> None:
    """SIGUSR1: arm what the file says now (a bad spec is reported and arms nothing)."""
    global _armed
    path = os.environ.get(FILE_ENV, "")
    try:
        with open(path, encoding="utf-8") as f:
            _armed = parse(f.read())
        msg = f"armed {sorted(_armed)}"
    except (OSError, ConfigError) as e:
        _armed = {}
        msg = f"not armed: {e}"
    sys.stderr.write(f"FAILPOINTS reload from {path}: {msg}\n")
    sys.stderr.flush()


def arm(spec: str) -> None:
    """Arm points in this process (tests); ``arm("")`` disarms everything."""
    global _armed
    _armed = parse(spec)


def fired(name: str) -> int:
    p = _armed.get(name)
    return p.fired if p is not None else 0


def failpoint(name: str) -> None:
    """Act if ``name`` is armed and this is its N-th hit; otherwise return at once."""
    if not _armed:
        return
    p = _armed.get(name)
    if p is None:
        return
    p.hits += 1
    if p.action == "partition" and p.fired:
        if time.monotonic() < p.until:
            raise Unavailable(f"failpoint {name}: partitioned", retry_after_s=0.1)
        return
    if p.hits != p.at:
        return
    p.fired += 1
    # Written straight to stderr (the service log): a kill leaves no chance to flush a logger.
    sys.stderr.write(f"FAILPOINT {name} {p.action} (hit {p.hits}) pid {os.getpid()}\n")
    sys.stderr.flush()
    if p.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif p.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif p.action == "delay":
        time.sleep(p.delay_s)          # the whole process stalls, on purpose
    elif p.action == "error":
        raise Unavailable(f"failpoint {name} injected an error", retry_after_s=0.1)
    elif p.action == "partition":
        p.until = time.monotonic() + p.delay_s
        raise Unavailable(f"failpoint {name}: partitioned", retry_after_s=0.1)


async def afailpoint(name: str) -> None:
    """``failpoint`` for a point on an event loop; ``latency:S`` waits there without
    stalling the process (every hit from the N-th on, until disarmed)."""
    p = _armed.get(name) if _armed else None
    if p is None or p.action != "latency":
        failpoint(name)
        return
    import asyncio
    p.hits += 1
    if p.hits < p.at:
        return
    if p.hits == p.at:
        p.fired += 1
        sys.stderr.write(f"FAILPOINT {name} {p.action} (hit {p.hits}) pid {os.getpid()}\n")
        sys.stderr.flush()
    await asyncio.sleep(p.delay_s)
