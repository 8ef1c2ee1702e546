"""What an RPC server accepts in a peer's ``Hello``, and what it answers (sans-I/O).

Three checks, in this order: the protocol version first (``ServerHello`` already told it,
and a peer of another version may answer the challenge differently), then the shared-secret
challenge before the KV spec, so a stranger learns nothing of the spec. The first failing
check is the typed answer (``VERSION_MISMATCH``, ``UNAUTHENTICATED``, ``KV_SPEC_MISMATCH``)
and the server closes the connection; otherwise ``HelloReply`` names the service, its node
and its KV fingerprint (docs/architecture.md, "Control RPC").
"""

from __future__ import annotations

from typing import Any

from common.auth import verify_response
from common.errors import ErrorCode
from common.protocol import PROTOCOL_VERSION, ErrorReply, Hello, HelloReply


class HelloPolicy:
    """One server's acceptance rules; ``auth_secret`` None: no challenge to pass;
    ``kv_fingerprint`` empty: any KV spec (a peer without one is never refused for it)."""

    def __init__(self, service: str, node_id: str, kv_fingerprint: str = "",
                 auth_secret: bytes | None = None) -> None:
        self.service = service
        self.node_id = node_id
        self.kv_fingerprint = kv_fingerprint
        self._secret = auth_secret

    def answer(self, hello: Hello | ErrorReply, nonce: bytes) -> HelloReply | ErrorReply:
        """The reply to ``hello`` (an ErrorReply passes through: it could not be decoded)."""
        if isinstance(hello, ErrorReply):
            return hello
        for check in (self._check_version, self._check_auth, self._check_kv_spec):
            if (error := check(hello, nonce)) is not None:
                return error
        return HelloReply(PROTOCOL_VERSION, self.service, self.node_id, self.kv_fingerprint)

    def _check_version(self, hello: Hello, nonce: bytes) -> ErrorReply | None:
        if hello.version == PROTOCOL_VERSION:
            return None
        return ErrorReply(ErrorCode.VERSION_MISMATCH,
                          f"peer speaks protocol v{hello.version}, {self.service} speaks "
                          f"v{PROTOCOL_VERSION}; deploy matching dualpath versions")

    def _check_auth(self, hello: Hello, nonce: bytes) -> ErrorReply | None:
        if self._secret is None or verify_response(self._secret, nonce, hello.auth):
            return None
        what = "no auth response" if hello.auth is None else "a wrong auth response"
        return ErrorReply(ErrorCode.UNAUTHENTICATED,
                          f"{self.service} requires the shared secret and got {what}; "
                          f"check rpc.auth_secret_file / rpc.auth_secret_env on both sides")

    def _check_kv_spec(self, hello: Hello, nonce: bytes) -> ErrorReply | None:
        if not (self.kv_fingerprint and hello.kv_fingerprint) or \
                hello.kv_fingerprint == self.kv_fingerprint:
            return None
        return ErrorReply(ErrorCode.KV_SPEC_MISMATCH,
                          f"peer KV spec {hello.kv_fingerprint!r} differs from {self.service}'s "
                          f"{self.kv_fingerprint!r}; check the [kv] config of both")


def hello_fields(hello: Hello | ErrorReply) -> dict[str, Any]:
    """What a log line says of a peer's hello (nothing of one that could not be decoded)."""
    if isinstance(hello, Hello):
        return {"role": hello.role, "node_id": hello.node_id, "version": hello.version}
    return {}
