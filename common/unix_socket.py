"""Private Unix sockets for local channels (the engine socket of a node): created ``0600`` with
no window in which another user could connect, and the connecting peer's uid read from the
kernel (``SO_PEERCRED``), which a peer cannot forge. See docs/security.md, "engine socket".
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from typing import Any

from common.errors import InvalidArgument


def bind_private(path: str) -> socket.socket:
    """A Unix stream socket bound at ``path`` with mode 0600, ready for ``listen``.

    The mode comes from the umask at ``bind`` (a chmod after listening leaves a window); the
    umask is narrowed only around that one synchronous call, so nothing else runs meanwhile on
    this thread, and files other threads create in that instant get stricter, never looser,
    modes.
    """
    replace_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)       # and whatever the umask was, never group/other bits
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_uid(sock: Any) -> int | None:
    """The uid of the process at the other end of a connected Unix socket (None: unknown).

    ``sock``: a socket or the transport's wrapper of one (``get_extra_info("socket")``)."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def replace_stale(path: str) -> None:
    """Unlink a Unix socket file nobody listens on; InvalidArgument when one is live or the
    path is not a socket."""
    if len(os.fsencode(path)) >= 104:        # sun_path is 108 bytes on Linux, 104 elsewhere
        raise InvalidArgument(f"Unix socket path too long ({len(path)} chars): {path}")
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidArgument(f"{path} exists and is not a socket; choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise InvalidArgument(f"a live server already listens on {path}")
