"""Error helpers shared by both node services: which hop failed, peer failures, copies.

An attempt's error carries the hop it came from (``gateway``, ``de_loader``, ``engine`` …) so the
scheduler's re-plan and the request record can say where a request failed.
"""

from __future__ import annotations

from typing import Any

from common.errors import Cancelled, DualpathError, EngineDetached, PeerFailed


def with_hop(err: DualpathError, hop: str) -> DualpathError:
    """Tag an error with the hop it came from (the first tag wins)."""
    if getattr(err, "hop", None) is None:
        err.hop = hop
    return err


def peer_error(err: DualpathError) -> DualpathError:
    """A transfer the peer abandoned (its side cancelled: the link was aborted) is the peer's
    failure — retryable — never a non-retryable CANCELLED of the request."""
    if isinstance(err, Cancelled):
        out = PeerFailed(f"the peer abandoned the transfer: {err.message}")
        out.hop = getattr(err, "hop", None)
        return out
    return err


def copy_error(err: DualpathError) -> DualpathError:
    """A fresh error of the same type, for another raise site: its tags (hop, the detached
    engine) come along."""
    out = type(err)(err.message, retry_after_s=err.retry_after_s)
    out.__dict__.update(err.__dict__)
    out.hop = getattr(err, "hop", None)
    return out


def detach_fields(err: DualpathError) -> dict[str, Any]:
    """A failure report's fields naming the engine attachment whose end failed the attempt
    (:class:`~common.errors.EngineDetached`); none for any other error."""
    if isinstance(err, EngineDetached) and err.engine_id:
        return {"detached_engine": err.engine_id, "engine_attaches": err.attach_no}
    return {}
