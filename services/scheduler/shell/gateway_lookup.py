"""Hit lookup through any storage gateway on the shared store, retried on the next one.

Every node's gateway sees the same storage directory (``probe_on_miss``: a block one node
wrote is found by the others), so any of them can answer ``LookupPrefix`` for any request.
:class:`GatewayHitLookup` holds a client per gateway and asks one per lookup, in turn, so the
index load spreads over the nodes instead of landing on the first. A gateway that fails
(a typed ``DualpathError``: unreachable, restarting, overloaded; or no reply within its share
of the budget) hands the lookup to the next, at most once per gateway; when every one
failed the lookup raises :class:`~common.errors.Unavailable` naming each gateway and why, and
the scheduler takes the hit as 0 — loudly (a counter, a metric, the request's events).

The clients are duck-typed (``await client.lookup_prefix(keys, timeout=...)`` returning a
reply with ``hit_blocks``: ``storage_gateway.client.GatewayClient``), so this module pulls in
no transport; the tools layer builds the clients (``tools.cluster.inprocess``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import structlog

from common.errors import DualpathError, InvalidArgument, Unavailable

log = structlog.get_logger(__name__)

# The tries share this part of the budget; the rest leaves room for the last try's own error
# to arrive before the scheduler's outer ``hit_lookup_timeout_s`` fires, so the failure names
# the gateways instead of reading as a bare timeout.
BUDGET_SHARE = 0.9


class PrefixLookupClient(Protocol):
    """What a gateway client offers here (``GatewayClient.lookup_prefix``)."""

    async def lookup_prefix(self, keys: Sequence[str], timeout: float | None = None) -> Any:
        ...


class GatewayHitLookup:
    """Asks the gateways of one shared store in turn; a failed try goes to the next gateway.

    ``gateways`` maps a name (node id or ``host:port``, used in errors, logs and counters) to
    its client. ``timeout_s`` is the whole lookup's budget (the scheduler's
    ``hit_lookup_timeout_s``); each try gets the budget left divided by the tries left, so a
    gateway that fails fast leaves more time to the next one.
    """

    def __init__(self, gateways: Mapping[str, PrefixLookupClient], timeout_s: float, *,
                 clock: Callable[[], float] = time.monotonic, allow_empty: bool = False) -> None:
        if not gateways and not allow_empty:
            raise InvalidArgument("GatewayHitLookup needs at least one gateway")
        if not timeout_s > 0:
            raise InvalidArgument(f"GatewayHitLookup timeout_s={timeout_s} must be > 0")
        self._gateways = list(gateways.items())
        self._budget_s = timeout_s * BUDGET_SHARE
        self._clock = clock
        self._turn = 0
        self.failures: Counter[str] = Counter()     # failed tries per gateway
        self.retries = 0                            # tries after a failed one
        self.exhausted = 0                          # lookups every gateway failed

    @property
    def gateways(self) -> list[str]:
        return [name for name, _ in self._gateways]

    @property
    def clients(self) -> dict[str, PrefixLookupClient]:
        return dict(self._gateways)

    def replace(self, gateways: Mapping[str, PrefixLookupClient]
                ) -> list[PrefixLookupClient]:
        """Ask these gateways from now on (etcd discovery: the registered ones,
        ``services.scheduler.app``); the clients no longer asked, for the caller to close."""
        kept = dict(gateways)
        old = [c for name, c in self._gateways if kept.get(name) is not c]
        self._gateways = list(kept.items())
        self._turn = 0
        return old

    async def lookup(self, session_id: str, keys: Sequence[str]) -> int:
        """Hit blocks from the first gateway that answers; Unavailable when none did."""
        if not self._gateways:
            self.exhausted += 1
            raise Unavailable("hit lookup: no gateway registered (etcd discovery) or configured")
        deadline = self._clock() + self._budget_s
        errors: list[str] = []
        order = self._order()       # this lookup's gateways, even if discovery replaces them
        for i, (name, client) in enumerate(order):
            if errors:
                self.retries += 1
            share = max(deadline - self._clock(), 0.0) / (len(order) - i)
            try:
                return await self._try(client, keys, share)
            except (DualpathError, TimeoutError) as e:
                reason = _reason(e, share)
                self.failures[name] += 1
                errors.append(f"{name}: {reason}")
                log.warning("hit_lookup_gateway_failed", gateway=name, error=reason,
                            tried=i + 1, gateways=len(self._gateways))
        self.exhausted += 1
        raise Unavailable("hit lookup failed on every gateway: " + "; ".join(errors))

    def finished(self, session_id: str, keys: Sequence[str]) -> None:
        pass                    # the gateways learn what is stored from the write-backs

    async def close(self) -> None:
        """Close every client (those that have a ``close``)."""
        for _, client in self._gateways:
            close = getattr(client, "close", None)
            if close is not None:
                await close()

    def _order(self) -> list[tuple[str, PrefixLookupClient]]:
        """Every gateway once, starting at this lookup's turn (round robin)."""
        start, n = self._turn, len(self._gateways)
        self._turn = (start + 1) % n
        return self._gateways[start:] + self._gateways[:start]

    @staticmethod
    async def _try(client: PrefixLookupClient, keys: Sequence[str], share: float) -> int:
        # The client enforces ``timeout`` itself (reconnecting included); the outer timeout
        # also bounds a client that does not.
        async with asyncio.timeout(share):
            reply = await client.lookup_prefix(keys, timeout=share)
        return int(reply.hit_blocks)


def _reason(e: BaseException, share: float) -> str:
    if isinstance(e, DualpathError):
        return f"{e.code}: {e.message}"
    return f"no reply within {share:.3g}s"
