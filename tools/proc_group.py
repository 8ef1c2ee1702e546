"""Process groups we started, and the ``/dev/shm`` files they leave behind.

vLLM runs its engine core in child processes of the server we start (each in its own session,
so the group is ours), and keeps its message queues in ``/dev/shm/psm_*`` segments (160-240 MiB
each on this model) that it unlinks only when it shuts down cleanly: a group killed before its
engine core finished shutting down leaves them (94 such files, 1.2 GB of RAM, were found after
a day of test runs). :func:`end_group` stops a group so that nothing is left: it notes what the
group maps, waits (deadline) for the group to exit on its own after the leader was told to
stop, kills what is left, then unlinks those noted files still present that no live process
maps and that we own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

SHM_DIR = "/dev/shm"


def group_pids(pgid: int) -> list[int]:
    """Every live process of process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def mapped_segments(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files these processes map now."""
    found: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith(SHM_DIR + "/"):
                found.add(path.removesuffix(" (deleted)"))
    return found


def remove_segments(paths: set[str]) -> list[str]:
    """Unlink those of ``paths`` still present, ours, and mapped by no live process."""
    uid = os.getuid()
    left = {p for p in paths if _owned(p, uid)}
    if not left:
        return []
    in_use = mapped_segments([int(d.name) for d in Path("/proc").glob("[0-9]*")])
    removed = []
    for p in sorted(left - in_use):
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            continue
    return removed


def _owned(path: str, uid: int) -> bool:
    try:
        return os.stat(path).st_uid == uid
    except OSError:
        return False


def group_segments(pgid: int) -> set[str]:
    """The ``/dev/shm`` files group ``pgid`` maps now (note them before stopping it)."""
    return mapped_segments(group_pids(pgid))


async def end_group(pgid: int, segments: set[str], grace_s: float = 30.0) -> list[str]:
    """After the group's leader was told to stop: wait up to ``grace_s`` for every process
    of group ``pgid`` to exit, SIGKILL what is left, then unlink those of ``segments`` (what
    :func:`group_segments` noted while it ran) that it left; returns those removed."""
    return await asyncio.to_thread(end_group_blocking, pgid, segments, grace_s)


def end_group_blocking(pgid: int, segments: set[str], grace_s: float = 30.0) -> list[str]:
    """:func:`end_group` for a caller without an event loop."""
    deadline = time.monotonic() + grace_s
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_group(pgid)
    deadline = time.monotonic() + 5.0
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return remove_segments(segments)


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in a group started with ``start_new_session``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
