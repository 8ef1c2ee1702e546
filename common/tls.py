"""TLS contexts for the control-plane RPC channels, built from ``RpcConfig``.

TLS is on when ``rpc.tls_cert_file`` or ``rpc.tls_ca_file`` is set and off (plaintext, as
before) when both are empty. One config serves every process of a cluster: each presents its
own certificate (``tls_cert_file`` + ``tls_key_file``) when it listens and, with
``tls_require_client_cert``, when it connects (mutual authentication); each verifies its peer
against ``tls_ca_file`` (the system store when unset). Every file is loaded when the server or
client object is built, so a missing or bad file fails at start with a ConfigError naming the
setting, never at the first connection. See docs/security.md for what TLS does and does not
stop.

A failed handshake on a TLS listener happens inside asyncio (or uvloop), which drops the
connection unseen; :class:`HandshakeFailures` makes each one count (``tls_handshakes_failed``
in the server's stats) so an operator can tell a plaintext or wrong-certificate peer — a
misconfigured node, a scanner — from silence. It sees the handshake through the context's
``sslobject_class``, the documented hook both event loops create their TLS objects with.
"""

from __future__ import annotations

import ssl
import time
import weakref

from common.config import RpcConfig
from common.errors import ConfigError


def tls_enabled(cfg: RpcConfig) -> bool:
    return bool(cfg.tls_cert_file or cfg.tls_ca_file)


def server_context(cfg: RpcConfig) -> ssl.SSLContext | None:
    """The listener's context, or None for plaintext. A server must have a certificate."""
    if not tls_enabled(cfg):
        return None
    if not (cfg.tls_cert_file and cfg.tls_key_file):
        raise ConfigError("rpc.tls_cert_file and rpc.tls_key_file are both required to serve "
                          "TLS (rpc.tls_ca_file alone only lets a client verify servers)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cfg)
    if cfg.tls_require_client_cert:
        if not cfg.tls_ca_file:
            raise ConfigError("rpc.tls_require_client_cert needs rpc.tls_ca_file (the CA that "
                              "signs client certificates)")
        _load_ca(ctx, cfg.tls_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cfg: RpcConfig) -> ssl.SSLContext | None:
    """The connecting side's context, or None for plaintext. Always verifies the server."""
    if not tls_enabled(cfg):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)     # CERT_REQUIRED + hostname check
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cfg.tls_ca_file:
        _load_ca(ctx, cfg.tls_ca_file)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if cfg.tls_cert_file:              # presented when the server asks (mutual auth)
        if not cfg.tls_key_file:
            raise ConfigError("rpc.tls_cert_file is set without rpc.tls_key_file")
        _load_chain(ctx, cfg)
    return ctx


def _load_chain(ctx: ssl.SSLContext, cfg: RpcConfig) -> None:
    assert cfg.tls_cert_file and cfg.tls_key_file
    for field, path in (("tls_cert_file", cfg.tls_cert_file), ("tls_key_file", cfg.tls_key_file)):
        _readable(field, path)
    try:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"rpc.tls_cert_file {cfg.tls_cert_file!r} / rpc.tls_key_file "
                          f"{cfg.tls_key_file!r} are not a matching PEM certificate and "
                          f"key: {e}") from e


def _load_ca(ctx: ssl.SSLContext, path: str) -> None:
    _readable("tls_ca_file", path)
    try:
        ctx.load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"rpc.tls_ca_file {path!r} is not a PEM CA bundle: {e}") from e


def _readable(field: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"rpc.{field} {path!r} cannot be read: {e.strerror}") from e


def is_refusal(exc: BaseException) -> bool:
    """True for a TLS failure that trying again will not fix (untrusted certificate, no client
    certificate, a plaintext peer); False for an EOF or reset in the middle of the handshake,
    which a restarting peer causes and a reconnect cures."""
    return isinstance(exc, ssl.SSLError) and not isinstance(
        exc, ssl.SSLEOFError | ssl.SSLZeroReturnError)


class HandshakeFailures:
    """Counts the server-side TLS handshakes of one context that did not complete.

    A handshake fails three ways: the TLS layer refuses the peer (a plaintext peer, an
    untrusted or missing certificate: ``do_handshake`` raises), the peer stalls past the
    handshake timeout, or it closes half-way (the event loop drops the connection and with it
    the TLS object, unfinished). The first is seen as it happens; the other two when the
    unfinished TLS object is freed, or, at the latest, when :meth:`count` finds it older than
    ``timeout_s``.
    """

    def __init__(self, ctx: ssl.SSLContext, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._failed = 0
        self._pending: dict[int, float] = {}     # id(TLS object) -> when its handshake began
        ctx.sslobject_class = self._object_class()

    def count(self) -> int:
        cutoff = time.monotonic() - self._timeout_s - 1.0
        for key in [k for k, began in self._pending.items() if began < cutoff]:
            self._gone(key)
        return self._failed

    def _object_class(self) -> type[ssl.SSLObject]:
        failures = self

        class CountedSSLObject(ssl.SSLObject):
            def do_handshake(self) -> None:
                try:
                    super().do_handshake()
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    failures._began(self)      # in progress: the loop calls again with data
                    raise
                except ssl.SSLError:
                    failures._gone(id(self))
                    raise
                failures._pending.pop(id(self), None)
        return CountedSSLObject

    def _began(self, obj: ssl.SSLObject) -> None:
        key = id(obj)
        if key not in self._pending:
            self._pending[key] = time.monotonic()
            weakref.finalize(obj, self._gone, key)

    def _gone(self, key: int) -> None:
        if self._pending.pop(key, None) is not None:
            self._failed += 1
