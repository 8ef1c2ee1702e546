"""Typed errors of dualpath, mapped one-to-one onto wire error codes.

Every failure that crosses a process boundary travels as ``ErrorReply(code, message)``
(see ``common.protocol``); the receiving side turns it back into the same exception class
with :func:`error_from_code`, so callers catch types, never parse strings.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Wire codes. Never renumber or rename: peers of other versions rely on them."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    OVERLOADED = "OVERLOADED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    UNAVAILABLE = "UNAVAILABLE"
    PEER_FAILED = "PEER_FAILED"
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"
    UNKNOWN_MESSAGE = "UNKNOWN_MESSAGE"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    KV_SPEC_MISMATCH = "KV_SPEC_MISMATCH"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    STORAGE_ERROR = "STORAGE_ERROR"
    CONFIG_ERROR = "CONFIG_ERROR"
    INTERNAL = "INTERNAL"
    OUT_OF_SERVICE = "OUT_OF_SERVICE"


class DualpathError(Exception):
    """Base of all typed errors. ``retryable`` tells a caller whether trying again may help."""

    code: ErrorCode = ErrorCode.INTERNAL
    retryable: bool = False

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.value}: {self.message})"


class InvalidArgument(DualpathError):
    code = ErrorCode.INVALID_ARGUMENT


class NotFound(DualpathError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(DualpathError):
    code = ErrorCode.ALREADY_EXISTS


class Overloaded(DualpathError):
    """A bounded queue or buffer is full; retry after ``retry_after_s``."""

    code = ErrorCode.OVERLOADED
    retryable = True


class DeadlineExceeded(DualpathError):
    code = ErrorCode.DEADLINE_EXCEEDED
    retryable = True


class Cancelled(DualpathError):
    code = ErrorCode.CANCELLED


class Unavailable(DualpathError):
    """The peer cannot be reached (not started, restarting, connection refused)."""

    code = ErrorCode.UNAVAILABLE
    retryable = True


class OutOfService(Unavailable):
    """The engine is attached, but its node took it out of service: its step ran past
    ``engine_stuck_s``. Not a lost attachment: the beat that shows the step ended puts it
    back, so ask again after ``retry_after_s`` instead of attaching anew. (A peer older than
    this code sees INTERNAL.)"""

    code = ErrorCode.OUT_OF_SERVICE


class PeerFailed(DualpathError):
    """The peer died or aborted part-way through an exchange."""

    code = ErrorCode.PEER_FAILED
    retryable = True


class EngineDetached(PeerFailed):
    """A node's engine process detached (died, or was replaced) while it held the request:
    ``engine_id``'s attachment number ``attach_no`` to that node ended. Never on the wire as
    such (it is a PEER_FAILED); the node's failure report names the engine, so the scheduler
    takes it out of placement before the request re-plans. ``alive``: its process may still
    run (it went silent or stuck, it did not die) and write into the pages it was handed, so
    they stay out of use until it lets go or ``engine_release_timeout_s`` passes."""

    def __init__(self, message: str, *, engine_id: str = "", attach_no: int = 0,
                 alive: bool = False, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.engine_id, self.attach_no, self.alive = engine_id, attach_no, alive


class ProtocolError(DualpathError):
    code = ErrorCode.PROTOCOL_ERROR


class FrameTooLarge(ProtocolError):
    code = ErrorCode.FRAME_TOO_LARGE


class UnknownMessage(ProtocolError):
    code = ErrorCode.UNKNOWN_MESSAGE


class VersionMismatch(DualpathError):
    code = ErrorCode.VERSION_MISMATCH


class KVSpecMismatch(DualpathError):
    code = ErrorCode.KV_SPEC_MISMATCH


class Unauthenticated(DualpathError):
    code = ErrorCode.UNAUTHENTICATED


class ResourceExhausted(DualpathError):
    """A pool has no room for this request now (it may later: retryable)."""

    code = ErrorCode.RESOURCE_EXHAUSTED
    retryable = True


class ChecksumMismatch(DualpathError):
    code = ErrorCode.CHECKSUM_MISMATCH


class StorageError(DualpathError):
    code = ErrorCode.STORAGE_ERROR


class ConfigError(DualpathError):
    code = ErrorCode.CONFIG_ERROR


class InternalError(DualpathError):
    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[DualpathError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument, NotFound, AlreadyExists, Overloaded, DeadlineExceeded, Cancelled,
        Unavailable, PeerFailed, ProtocolError, FrameTooLarge, UnknownMessage, VersionMismatch,
        KVSpecMismatch, Unauthenticated, ResourceExhausted, ChecksumMismatch, StorageError,
        ConfigError, InternalError, OutOfService,
    )
}


def error_class(code: str | ErrorCode) -> type[DualpathError]:
    """The exception class for a wire code; unknown codes (newer peers) map to InternalError."""
    try:
        return _BY_CODE[ErrorCode(code)]
    except ValueError:
        return InternalError


def error_from_code(code: str | ErrorCode, message: str,
                    retry_after_s: float | None = None) -> DualpathError:
    """Rebuild the typed exception a peer reported."""
    return error_class(code)(message, retry_after_s=retry_after_s)


def all_error_classes() -> list[type[DualpathError]]:
    return list(_BY_CODE.values())
