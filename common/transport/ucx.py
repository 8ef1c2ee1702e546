"""The ucxx side of the page transport: the lazy ``ucxx`` import (with the handshake patch),
the UCX context of one traffic class, and the records of links and transfers that
:class:`~common.transport.links.Links` and :class:`~common.transport.transfers.Transfers`
keep (plain data: the logic is theirs).
"""

from __future__ import annotations

import asyncio
import collections
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import structlog

from common.errors import ConfigError
from common.transport import handshake
from common.transport.plan import MessagePlan
from common.transport.ucx_env import UCX_PREFIX, options_overridden_by_env

log = structlog.get_logger("common.transport")

Peer = tuple[str, int]
_OWN_PROGRESS = "dualpath.transport progress driver"
_ucx: SimpleNamespace | None = None
_reported_skips: set[tuple[str, tuple[str, ...]]] = set()  # warn once per process


def ucxx() -> SimpleNamespace:
    """Import ucxx lazily: the UCX environment must be set before the first import."""
    global _ucx
    if _ucx is None:
        import ucxx._lib.libucxx as lib
        from ucxx._lib.arr import Array
        from ucxx._lib_async import application_context as app
        from ucxx.types import Tag, TagMaskFull
        _ucx = SimpleNamespace(lib=lib, Array=Array, app=app, Tag=Tag, Mask=TagMaskFull,
                               Error=lib.UCXError)
        handshake.install()  # ucxx's own handshake frees buffers UCX still writes into
    return _ucx


def claim_progress(loop: asyncio.AbstractEventLoop) -> None:
    # ucxx starts its own (spinning) BlockingMode for a loop it has no entry for; our
    # driver does the work, so keep an entry there (a collected context clears the dict).
    ucxx().app.ProgressTasks.setdefault(loop, _OWN_PROGRESS)


def create_context(options: dict[str, str], traffic_class: str,
                   require: bool = False) -> tuple[Any, list[str]]:
    """The ucxx ApplicationContext for one traffic class, minus options UCX rejects.

    With ``require`` a rejected option is a :class:`ConfigError` raised before any context,
    worker or listener exists (nothing to release), naming the option and this UCX.
    """
    u = ucxx()
    from_env = options_overridden_by_env(options)
    if from_env:
        log.info("ucx_options_taken_from_environment", traffic_class=traffic_class,
                 options=from_env)
    opts = {k: v for k, v in options.items() if k not in from_env}
    try:
        if require:        # probe first: a refused start must not have made a context
            # the environment's values too: UCX ignores a UCX_<NAME> it has no use for
            # (unused variables are not even warned about, ucx_env), so probe them here
            env = {k: os.environ[UCX_PREFIX + k] for k in from_env}
            _check_all_apply({**opts, **env}, traffic_class)
        return u.app.ApplicationContext(opts, progress_mode="blocking"), []
    except u.Error as e:
        accepted, skipped = _probe_options(opts)
        if not skipped:
            raise ConfigError(f"UCX rejected traffic class {traffic_class!r} options {opts}: "
                              f"{type(e).__name__}: {e}") from e
        key = (traffic_class, tuple(skipped))
        report = log.debug if key in _reported_skips else log.warning
        _reported_skips.add(key)
        report("ucx_options_skipped", traffic_class=traffic_class, options=skipped,
               reason=f"{type(e).__name__}: this UCX build cannot apply them (the PyPI UCX "
                      "has no verbs: no IB/RoCE QoS; use a system UCX >= 1.19 with verbs)")
        return u.app.ApplicationContext(accepted, progress_mode="blocking"), skipped


def _check_all_apply(options: dict[str, str], traffic_class: str) -> None:
    """ConfigError naming the first option this UCX rejects (``require = true``)."""
    accepted, skipped = _probe_options(options)
    if not skipped:
        return
    names = ", ".join(f"transport.traffic_classes.{traffic_class}.options.{k} = "
                      f"{options[k]!r}" for k in skipped)
    raise ConfigError(
        f"UCX cannot apply {names}, and transport.traffic_classes.{traffic_class}.require is "
        f"true: refusing to start rather than send KV without its service level. This UCX: "
        f"{ucx_facts(accepted)}. Use a UCX built with verbs (docs/qos.md, 'A system UCX with "
        f"verbs') or set require = false to run without the option.")


def ucx_facts(options: dict[str, str] | None = None) -> str:
    """What ``ucx_info -v`` / ``ucx_info -d`` would say of the UCX this process loaded:
    version, library path, and the transports a context with ``options`` has."""
    u = ucxx()
    version = ".".join(str(x) for x in u.lib.get_ucx_version())
    try:
        resources = _resources(u.lib.UCXContext(options or {}).info)
    except u.Error as e:
        resources = [f"(none: {type(e).__name__})"]
    return (f"UCX {version} from {_loaded_library('libucp.so')}, transports "
            f"{', '.join(resources) or '(none)'}")


def _resources(info: str) -> list[str]:
    """``transport/device`` of every resource line of a UCP context's info text."""
    out = []
    for line in info.splitlines():
        if "resource" in line and "flags --" in line:
            out.append(line.split("flags --", 1)[1].strip())
    return out


def _loaded_library(name: str) -> str:
    """Path of the loaded shared library whose file name starts with ``name`` (or "?")."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith(name):
                    return path
    except OSError:
        return "? (not Linux: no /proc/self/maps)"
    return "? (not among this process's mappings)"


def _probe_options(options: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    u = ucxx()
    accepted: dict[str, str] = {}
    skipped: list[str] = []
    for key, value in options.items():
        try:
            u.lib.UCXContext({**accepted, key: value})
            accepted[key] = value
        except u.Error:
            skipped.append(key)
    return accepted, skipped


@dataclass(eq=False)
class Link:
    """One endpoint to a peer's transport (keyed by the peer's listener address).

    ``ep`` (error handling on) carries hellos, receives, commits and liveness; on a
    ``single_copy`` link the sender's messages go over the transport's endpoint to the peer's
    worker (kept by :class:`~common.transport.links.Links`), made without error handling
    (cma single copy). ``shm_out``/``shm_in``: the one-copy path in each direction
    (:mod:`common.transport.shm_transfers`); ``rma_out``/``rma_in``: the RMA path
    (:mod:`common.transport.rma_path`).
    """

    addr: Peer
    ep: Any
    node_id: str = ""
    failure: str | None = None
    single_copy: bool = False
    peer_worker_address: bytes = b""
    peer_process: str = ""
    shm_out: Any = None           # the peer's segment, mapped here: sends copy into it
    shm_in: bool = False          # the peer mapped ours: receives may come by copy
    peer_nonce: int = 0           # the peer's name in shm control messages
    rma_peer: bool = False        # the peer may ask for RMA: sends wait for its READY
    rma_out: Any = None           # the peer's registered arena (rma.RemoteRegion): sends put
    rma_in: bool = False          # the peer may put into our registered arena
    peer_device: bool = False     # the peer sends from device memory (its hello said so)

    @property
    def usable(self) -> bool:
        return self.failure is None and self.ep._ep is not None and not self.ep.closed


@dataclass(eq=False)
class Transfer:
    """Book-keeping of one transfer in flight, on either side."""

    transfer_id: int
    link: Link
    plan: list[MessagePlan]
    nbytes: int
    posted: collections.deque     # (request, message, staging offset | None)
    deferred: collections.deque   # packed messages waiting for staging (receiver)
    arena: Any = None
    task: asyncio.Task | None = None
    commit: Any = None            # receiver: the posted commit receive (single-copy links)
    keep: Any = None              # what the requests point into (sources / arena): see Links.park
    staged: bool = False          # receiver: direct messages land in pinned staging, then H2D
    copies: collections.deque = field(default_factory=collections.deque)  # their StagedCopy


class ReceiveHandle:
    """A posted receive of one transfer: ``await wait()`` returns when every byte arrived."""

    def __init__(self, transfer_id: int, peer: Peer, nbytes: int, task: asyncio.Task) -> None:
        self.transfer_id, self.peer, self.nbytes = transfer_id, peer, nbytes
        self._task = task

    @property
    def done(self) -> bool:
        return self._task.done()

    async def wait(self) -> None:
        """Return when all bytes are in the arena; raise PeerFailed, DeadlineExceeded, ..."""
        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not self._task.done():  # our waiter was cancelled: cancel the transfer too
                await self.cancel()
            raise

    async def cancel(self) -> None:
        """Cancel the transfer; returns once no receive targets the arena any more."""
        if not self._task.done():
            self._task.cancel()
        await asyncio.wait([self._task])
        if not self._task.cancelled():
            self._task.exception()  # retrieved here; wait() raises it again
