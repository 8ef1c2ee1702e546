"""Base of the wire schema: the protocol version, :class:`Message` and the shared
:class:`ErrorReply` every channel answers with."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# 2: RegisterNodeReply / FetchWorkReply / ReportProgress .scheduler_epoch, RequestFailed.resubmit
# (scheduler restart: docs/frontend-api.md)
# 3: read side "split"; RequestPlan .split_tokens/.split_gateway, PrepareDecode .split_tokens,
# RequestPlaced .split_tokens (docs/datapath.md "Split reads")
# 4: ReportProgress .pe_read_bytes/.de_read_bytes and stage "dropped" (a failed or dropped
# attempt's storage reads add up per side: docs/frontend-api.md "Retried attempts re-read")
# 5: EngineLoad .attached (an engine its node reports detached leaves placement until it is
# back: docs/engine-api.md "An engine that is not attached")
# 6: EngineLoad .attaches, ReportProgress .detached_engine/.engine_attaches (a detach the
# node's failure report names takes the engine out before its request re-plans: one re-plan)
# 7: EngineLoad .buffer_free_bytes (a decode node's free DE buffer, shared by its decode
# engines: the scheduler holds all of the node's bindings to it: docs/datapath.md "Buffer
# admission in the scheduler")
PROTOCOL_VERSION = 7

# Where a request's hit KV is read from storage (paper §4): through the PE's own gateway, through
# the DE's (which then streams the layers to the PE), split between the two (the DE reads the
# hit's leading ``split_tokens``, the PE the rest, at once: docs/datapath.md "Split reads"), or
# nowhere (no hit). A Literal on every message that carries it, so a side no node knows is a
# decode error, not a branch nobody takes.
ReadSide = Literal["pe", "de", "split", "none"]


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="t"):
    """Base of every control message. Subclasses set ``tag="area.name"``."""


# --------------------------------------------------------------------------- errors

class ErrorReply(Message, tag="error", frozen=True):
    """The one error shape on the wire; ``code`` is a ``common.errors.ErrorCode`` value."""

    code: str
    message: str
    retryable: bool = False
    retry_after_s: float | None = None


def union_members(union: Any) -> tuple[type, ...]:
    """Members of a channel union (for handler-coverage tests)."""
    return tuple(getattr(union, "__args__", (union,)))
