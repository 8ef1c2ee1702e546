"""Scheduler leader election and discovery through etcd (issue 16, item 1).

With ``[etcd] endpoints`` set, two or more scheduler replicas run; one is the leader:

* **Election.** A replica campaigns by creating ``<prefix>/scheduler/leader`` under an etcd
  lease of ``etcd.lease_s`` seconds, in a transaction that succeeds only while the key does
  not exist (``create_revision == 0``). The winner keeps the lease alive (every third of it);
  the others poll the key and campaign again once it is gone — when the leader's lease ran out
  (killed, partitioned) or it resigned (stopped). Takeover time ≤ lease + one poll.
* **Fencing epoch.** The key's ``create_revision`` — etcd's cluster-wide revision, which only
  grows — is the leader's epoch (``SchedulerService.epoch``). Every node-facing reply carries
  it (``RegisterNodeReply``, ``FetchWorkReply``); a node refuses a reply whose epoch is below
  the highest it has seen, so a deposed leader's plans are not run (``NodeSession``).
* **Stepping down.** A leader that cannot renew its lease for ``lease_s`` stops serving (it
  may have been deposed); a renewal that finds the lease alive lets it serve on with the same
  epoch (etcd's own leader change, a member lost); the lease gone in etcd, or no renewal for
  ``step_down_s`` (etcd lost, or partitioned from it), ends the term (``keep``): the replica
  drops everything it led and campaigns again as a standby (``app.SchedulerReplica``).
* **Discovery.** The key's value is the leader's RPC address; frontends and nodes resolve it
  before each connection attempt (:class:`LeaderResolver`, ``RpcClient(resolve=...)``).

etcd itself is the one Debian packages (``etcd-server`` 3.4, ``make etcd``), reached with the
``aetcd`` asyncio client; no consensus of our own. Keys and timings: docs/cluster.md ("etcd").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog

from common.errors import Unavailable

from ..service_config import EtcdConfig

log = structlog.get_logger(__name__)

T = TypeVar("T")


def leader_key(cfg: EtcdConfig) -> bytes:
    return f"{cfg.prefix.rstrip('/')}/scheduler/leader".encode()


# gRPC channel options of every etcd client. gRPC keeps a process-wide pool of connections
# (subchannels) shared by every channel to one address, with their reconnect backoff: after
# etcd refused a few connects (it was down a few seconds), even a brand-new client failed for
# 1-3 s more after etcd answered again (measured here), longer than a 1-2 s lease, so a node's
# key or the leader's lease lapsed after etcd had come back (ci101). Each client gets its own
# connection, and a lost one is retried within a second, not after gRPC's up to 120 s.
GRPC_OPTIONS = {"grpc.use_local_subchannel_pool": 1,
                "grpc.initial_reconnect_backoff_ms": 100,
                "grpc.min_reconnect_backoff_ms": 100,
                "grpc.max_reconnect_backoff_ms": 1000}


class EtcdEndpoints:
    """An ``aetcd`` client on the first reachable endpoint; the next one after a failure."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("etcd.endpoints is empty")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._i = 0
        self._client: Any = None

    @property
    def current(self) -> str:
        return self.endpoints[self._i % len(self.endpoints)]

    async def client(self, timeout_s: float | None = None) -> Any:
        """A connected client; Unavailable naming every endpoint when none answers."""
        if self._client is not None:
            return self._client
        import aetcd
        errors = []
        wait = timeout_s or self.timeout_s
        for _ in range(len(self.endpoints)):
            host, _, port = self.current.rpartition(":")
            c = aetcd.Client(host=host or "127.0.0.1", port=int(port),
                             timeout=max(1, round(self.timeout_s)), options=GRPC_OPTIONS)
            try:
                async with asyncio.timeout(wait):
                    await c.connect()
                    await c.status()            # connect() is lazy: prove the member answers
                self._client = c
                return c
            except Exception as e:              # grpc/aetcd errors, timeouts: try the next
                errors.append(f"{self.current}: {type(e).__name__}")
                with contextlib.suppress(Exception):
                    await c.close()
                self._i += 1
        raise Unavailable(f"etcd unreachable at {', '.join(self.endpoints)} ({'; '.join(errors)})"
                          f" — check [etcd] endpoints and that etcd runs")

    async def failed(self) -> None:
        """The current member misbehaved: drop the client, the next call tries the next."""
        c, self._client = self._client, None
        self._i += 1
        if c is not None:
            with contextlib.suppress(Exception):
                await c.close()

    async def call(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> Any:
        """``fn(client)`` on a reachable member; after a failure (a dead member hangs rather
        than refuses: gRPC waits out the timeout) the next member, each member once.
        ``timeout_s``: per member (default ``dial_timeout_s``)."""
        wait = timeout_s or self.timeout_s
        last: Exception | None = None
        for _ in range(len(self.endpoints)):
            try:
                c = await self.client(wait)
                async with asyncio.timeout(wait):
                    return await fn(c)
            except Unavailable as e:           # no member answered at all
                raise e from None
            except Exception as e:
                last = e
                await self.failed()
        raise Unavailable(f"etcd call failed on every member of {', '.join(self.endpoints)}: "
                          f"{type(last).__name__}: {last}") from None

    async def close(self) -> None:
        await self.failed()


async def retried_at_start(fn: Callable[[], Awaitable[T]], cfg: EtcdConfig, what: str) -> T:
    """``fn()`` (a process's first etcd work) retried while etcd is Unavailable, every
    ``poll_s``, for ``start_timeout_s``; then its last Unavailable, which names the endpoints
    (the process exits on it). Why: a host that stalls for a dial timeout, or an etcd started
    beside the service, must cost a wait, not a restart (docs/cluster.md, "etcd")."""
    end = time.monotonic() + cfg.start_timeout_s
    failures, next_log = 0, 0.0
    while True:
        try:
            return await fn()
        except Unavailable as e:
            failures += 1
            now = time.monotonic()
            if now >= end:
                raise
            if now >= next_log:
                log.warning("etcd_unreachable_at_start", what=what, error=e.message,
                            failures=failures, gives_up_in_s=round(end - now, 1))
                next_log = now + RETRY_LOG_S
        await asyncio.sleep(cfg.poll_s)


async def put_if_absent(etcd: EtcdEndpoints, key: bytes, value: bytes, ttl_s: int) -> Any:
    """Put ``key`` under a fresh lease of ``ttl_s`` only while it does not exist (a transaction
    on ``create_revision == 0``): the lease; None (the lease revoked) when the key exists."""
    lease = await etcd.call(lambda c: c.lease(ttl_s))

    async def txn(c: Any) -> bool:
        t = c.transactions
        ok, _ = await c.transaction(compare=[t.create(key) == 0],
                                    success=[t.put(key, value, lease)], failure=[])
        return ok
    if await etcd.call(txn):
        return lease
    with contextlib.suppress(Unavailable):
        await etcd.call(lambda c: c.revoke_lease(lease.id))
    return None


RETRY_FIRST_S = 0.05     # a failed renewal round is retried this soon, doubling ...
RETRY_LOG_S = 1.0        # ... and logged at most this often (with its failure count)


class SchedulerElection:
    """One replica's campaign: ``await win(address)`` returns the epoch once it leads."""

    def __init__(self, cfg: EtcdConfig, node_id: str) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.etcd = EtcdEndpoints(cfg.endpoints, cfg.dial_timeout_s)
        self.key = leader_key(cfg)
        self.epoch = 0
        self._lease: Any = None
        self._value = b""

    async def check(self) -> None:
        """Fail at start (Unavailable naming the endpoints) when etcd cannot be reached
        within ``start_timeout_s``."""
        await retried_at_start(self.etcd.client, self.cfg, "scheduler start")

    async def win(self, host: str, port: int) -> int:
        """Campaign until this replica leads; its epoch (the key's create revision)."""
        self._value = json.dumps({"host": host, "port": port, "node_id": self.node_id,
                                  "started": time.time()}).encode()
        failures, next_log = 0, 0.0
        while True:
            try:
                epoch = await self._campaign()
            except Unavailable as e:
                # a refused connection fails at once, every poll_s: counted, logged once a
                # second (a replica that stepped down campaigns through the whole outage)
                failures += 1
                now = time.monotonic()
                if now >= next_log:
                    log.warning("election_etcd_unreachable", error=e.message, failures=failures)
                    next_log = now + RETRY_LOG_S
                epoch = None
            if epoch is not None:
                self.epoch = epoch
                log.warning("scheduler_elected", node_id=self.node_id, epoch=epoch,
                            endpoint=self.etcd.current)
                return epoch
            await asyncio.sleep(self.cfg.poll_s)

    async def _campaign(self) -> int | None:
        lease = await put_if_absent(self.etcd, self.key, self._value, self.cfg.lease_s)
        if lease is None:
            return None
        key, value = self.key, self._value
        self._lease = lease
        got = await self.etcd.call(lambda c: c.get(key))
        if got is None or got.value != value:
            return None                     # lost between the two calls: campaign again
        return int(got.create_revision)

    async def keep(self, unconfirmed: Callable[[str], None],
                   confirmed: Callable[[float], None]) -> str:
        """Renew the lease every third of it; return why the leader must step down.

        Each try gives a member a quarter of the lease, then goes on to the next member, and a
        failed round is retried at once, not a third of a lease later. After a whole lease
        without renewal the lease may have lapsed in etcd (and another replica won), so
        ``unconfirmed(reason)`` stops the service serving. It does not step down yet: losing
        etcd's raft leader (a member killed) leaves etcd without one for an election or two —
        seconds, longer than the lease when the survivors split their votes — and a new raft
        leader extends every lease (etcd's lessor ``Promote``), so the lease usually lives on.
        A later renewal that finds it alive (and the key still ours) proves no other replica
        led meanwhile: ``confirmed(seconds_in_doubt)`` and the same epoch serves on. Returns
        when etcd says the lease is gone, the key is not ours, or ``step_down_s`` passed
        without a renewal.

        A failed round is retried after ``RETRY_FIRST_S``, doubling up to a quarter lease (so
        a recovered etcd is seen within that), and logged once per ``RETRY_LOG_S`` with the
        count of failures since: an unreachable etcd fails each try at once, and a fixed
        50-ms retry wrote twenty warnings a second for the whole ``step_down_s``."""
        last_ok = time.monotonic()
        doubt_since: float | None = None
        retry_s = 0.0                     # 0: the last round renewed
        failures, next_log = 0, 0.0
        while True:
            await asyncio.sleep(retry_s or self.cfg.lease_s / 3)
            try:
                gone = await self._renew()
            except Unavailable as e:
                retry_s = min(max(2 * retry_s, RETRY_FIRST_S), self.cfg.lease_s / 4)
                now = time.monotonic()
                failures += 1
                if now >= next_log:
                    log.warning("leader_lease_renewal_failed", node_id=self.node_id,
                                error=e.message, failures=failures,
                                since_renewal_s=round(now - last_ok, 2))
                    next_log = now + RETRY_LOG_S
                if now - last_ok >= self.cfg.step_down_s:
                    return (f"leader lease not confirmed by etcd for {self.cfg.step_down_s}s "
                            f"(etcd.step_down_s)")
                if now - last_ok >= self.cfg.lease_s:
                    doubt_since = doubt_since or now
                    unconfirmed(f"not renewed for {now - last_ok:.1f}s: {e.message}")
                continue
            if gone:
                log.error("leader_lease_gone", node_id=self.node_id, epoch=self.epoch,
                          reason=gone)
                return gone
            last_ok, retry_s, failures, next_log = time.monotonic(), 0.0, 0, 0.0
            if doubt_since is not None:
                confirmed(last_ok - doubt_since)
                doubt_since = None

    async def _renew(self) -> str | None:
        """Refresh the lease once: None while it lives and holds our key; why it is lost."""
        lease, key = self._lease, self.key
        reply = await self.etcd.call(lambda c: c.refresh_lease(lease.id), self.cfg.lease_s / 4)
        if reply is None or reply.TTL <= 0:
            return "leader lease expired in etcd"
        got = await self.etcd.call(lambda c: c.get(key), self.cfg.lease_s / 4)
        if got is None or got.value != self._value:
            return "leader key deleted or replaced in etcd"
        return None

    async def release(self) -> None:
        """Give the lease up (best effort: after a lost lease etcd may not answer, or the lease
        is gone already) and forget it, keeping the client: a replica that stepped down
        campaigns again with a fresh lease (``SchedulerReplica``)."""
        lease, self._lease = self._lease, None
        self.epoch = 0
        if lease is not None:
            with contextlib.suppress(Unavailable):
                await self.etcd.call(lambda c: c.revoke_lease(lease.id))

    async def resign(self) -> None:
        """Give leadership up at once (a clean stop): the standby need not wait the lease."""
        await self.release()
        await self.etcd.close()
