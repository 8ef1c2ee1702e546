"""Error helpers shared by both node services: which hop failed, peer failures, copies.

An attempt's error carries the hop it came from (``gateway``, ``de_loader``, ``engine`` …) so the
scheduler's re-plan and the request record can say where a request failed.
"""

from __future__ import annotations

from common.errors import Cancelled, DualpathError, PeerFailed


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
    out = type(err)(err.message, retry_after_s=err.retry_after_s)
    out.hop = getattr(err, "hop", None)
    return out
