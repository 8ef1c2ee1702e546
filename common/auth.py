"""Shared-secret challenge/response for the RPC hello.

The server sends a fresh random nonce in ``ServerHello``; the client answers with
``HMAC-SHA256(secret, nonce)`` in ``Hello.auth``. The secret never travels and is never
logged; a captured response is useless for the next connection (new nonce). This
authenticates peers; it does not encrypt the stream (run the mesh on a trusted network or
under a tunnel when that matters).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Mapping
from pathlib import Path

import structlog

from common.config import RpcConfig
from common.errors import ConfigError

log = structlog.get_logger(__name__)


def load_secret(cfg: RpcConfig, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret named by ``rpc.auth_secret_file`` or ``rpc.auth_secret_env``.

    ``None`` when neither is set (authentication off). Surrounding whitespace is stripped so
    a trailing newline in the file does not change the secret. Misconfiguration fails with
    ConfigError naming the setting.
    """
    if cfg.auth_secret_file and cfg.auth_secret_env:
        raise ConfigError("set only one of rpc.auth_secret_file and rpc.auth_secret_env")
    if cfg.auth_secret_file:
        return _secret_from_file(Path(cfg.auth_secret_file))
    if cfg.auth_secret_env:
        return _secret_from_env(cfg.auth_secret_env, os.environ if environ is None else environ)
    return None


def _secret_from_file(path: Path) -> bytes:
    try:
        data = path.read_bytes().strip()
        mode = path.stat().st_mode
    except OSError as e:
        raise ConfigError(f"rpc.auth_secret_file {str(path)!r} cannot be read: "
                          f"{e.strerror}") from e
    if not data:
        raise ConfigError(f"rpc.auth_secret_file {str(path)!r} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("auth_secret_file_exposed", path=str(path), mode=oct(mode & 0o777),
                    hint="chmod 600")
    return data


def _secret_from_env(name: str, environ: Mapping[str, str]) -> bytes:
    value = environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"rpc.auth_secret_env names {name!r}, which is unset or empty")
    return value.encode()


def compute_response(secret: bytes, nonce: bytes) -> bytes:
    """The client's answer to a server nonce."""
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def verify_response(secret: bytes, nonce: bytes, response: bytes | None) -> bool:
    """Whether ``response`` answers ``nonce`` under ``secret`` (constant-time compare)."""
    if response is None:
        return False
    return hmac.compare_digest(compute_response(secret, nonce), response)
