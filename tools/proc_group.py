"""Process groups we started, and the files they leave behind.

vLLM runs its engine core in child processes of the server we start (each in its own session,
so the group is ours), and keeps its message queues in ``/dev/shm/psm_*`` segments (160-240 MiB
each on this model) that it unlinks only when it shuts down cleanly: a group killed before its
engine core finished shutting down leaves them (94 such files, 1.2 GB of RAM, were found after
a day of test runs). Its ZeroMQ IPC sockets (``$TMPDIR/<uuid4>``, one per queue between the
server and the engine core) are left even by a clean stop: ~7 per instance, 3,300 in ``/tmp``
after a day and a half of test runs, and a socket closed after start-up (the engine core's
handshake) leaves its file before anyone could note it, and the torch ``FileStore`` of its
process group (``$TMPDIR/vllm_dist_<uuid4>``) stays after every stop: ~8-10 per CI run. So
each instance we start gets a directory of its own for them, its IPC and temporary directory
(:func:`private_ipc_env`). :func:`end_group` stops a group so
that nothing is left: it notes what the group maps, which socket files it is bound to and its
IPC directory, waits (deadline) for the group to exit on its own after the leader was told to
stop, kills what is left, then unlinks those noted files still present that we own and no live
process uses, and the IPC directory with what it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from stat import S_ISSOCK

SHM_DIR = "/dev/shm"
IPC_DIR_PREFIX = "dualpath-vllm-ipc-"     # private_ipc_env's directories


def private_ipc_env() -> dict[str, str]:
    """The environment that puts one vLLM instance's ZeroMQ IPC socket files
    (``VLLM_RPC_BASE_PATH``) and its temporary files (``TMPDIR``: the process group's
    ``vllm_dist_*`` file store) in a new directory of its own: :func:`group_files` finds it in
    the instance's environment, :func:`remove_files` removes it with the group.

    TorchInductor's compile cache stays where it was (``TORCHINDUCTOR_CACHE_DIR``, default
    ``$TMPDIR/torchinductor_<user>``): it is meant to outlive an instance, and a private one
    would recompile at every start. vLLM's download locks also follow ``TMPDIR``; the models
    we serve are local directories, so no instance of ours takes one."""
    own_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
    return {"VLLM_RPC_BASE_PATH": own_dir, "TMPDIR": own_dir,
            "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()}


def inductor_cache_dir() -> str:
    """TorchInductor's cache directory as torch picks it by default (its own setting if one is
    set): ``<temp dir>/torchinductor_<user>``, with torch's escaping of the user name."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(),
                        "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def ipc_dir(pid: int) -> str | None:
    """The :func:`private_ipc_env` directory of process ``pid``, if it was started with one."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"VLLM_RPC_BASE_PATH="):
            path = entry.split(b"=", 1)[1].decode(errors="replace")
            return path if Path(path).name.startswith(IPC_DIR_PREFIX) else None
    return None


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


def bound_sockets(pids: list[int]) -> set[str]:
    """The unix socket files (not abstract names) these processes hold a socket bound to."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(fd.path)
                    if link.startswith("socket:["):
                        inodes.add(link[len("socket:["):-1])
    return {path for inode, path in _unix_sockets() if inode in inodes}


def _unix_sockets() -> list[tuple[str, str]]:
    """(inode, path) of every unix socket of this network namespace bound to a file."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return []
    rows = (line.split() for line in lines)
    return [(f[6], f[7]) for f in rows if len(f) >= 8 and f[7].startswith("/")]


def remove_files(paths: set[str]) -> list[str]:
    """Unlink those of ``paths`` still present and ours that no live process uses: a
    ``/dev/shm`` file nobody maps, a socket file nobody is bound to."""
    uid = os.getuid()
    left = {p for p in paths if _owned(p, uid)}
    if not left:
        return []
    in_use = mapped_segments([int(d.name) for d in Path("/proc").glob("[0-9]*")])
    in_use |= {path for _, path in _unix_sockets()}
    removed = []
    for p in sorted(left - in_use, reverse=True):     # what is in a directory before it
        try:
            if os.path.isdir(p):      # an IPC directory: the group is gone, so is its use
                shutil.rmtree(p)
            else:
                os.unlink(p)
            removed.append(p)
        except OSError:
            continue
    return sorted(removed)


def _owned(path: str, uid: int) -> bool:
    """Ours, and what we note: a ``/dev/shm`` file, a socket, an IPC directory of
    :func:`private_ipc_env` (never remove a path reused since as something else)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if st.st_uid != uid:
        return False
    if Path(path).name.startswith(IPC_DIR_PREFIX) and os.path.isdir(path):
        return True
    return path.startswith(SHM_DIR + "/") or S_ISSOCK(st.st_mode)


def group_files(pgid: int) -> set[str]:
    """The ``/dev/shm`` files group ``pgid`` maps, the socket files it is bound to and the
    IPC directory of its leader, now (note them before stopping it)."""
    pids = group_pids(pgid)
    own_dir = ipc_dir(pgid)
    return mapped_segments(pids) | bound_sockets(pids) | ({own_dir} if own_dir else set())


async def end_group(pgid: int, files: set[str], grace_s: float = 30.0) -> list[str]:
    """After the group's leader was told to stop: wait up to ``grace_s`` for every process
    of group ``pgid`` to exit, SIGKILL what is left, then unlink those of ``files`` (what
    :func:`group_files` noted while it ran) that it left; returns those removed."""
    return await asyncio.to_thread(end_group_blocking, pgid, files, grace_s)


def end_group_blocking(pgid: int, files: set[str], grace_s: float = 30.0) -> list[str]:
    """:func:`end_group` for a caller without an event loop."""
    deadline = time.monotonic() + grace_s
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_group(pgid)
    deadline = time.monotonic() + 5.0
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return remove_files(files)


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in a group started with ``start_new_session``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
