"""The real data path: sessions claimed from the node's engine socket (``SyncEngineClient``).

A prefill instance attaches to its node's PE receiver, a decode instance to its DE loader
(``[pe_receiver]/[de_loader] engine_socket``); KV moves through the node's ``/dev/shm`` arena
by slot (docs/engine-api.md "Cross-process"). The plan comes from the dualpath scheduler: the
front puts ``{"request_id", "hit_tokens"}`` in ``kv_transfer_params["dualpath"]``; the claimed
request's keys must be the chained keys of the very token ids vLLM was given, else the session
is refused and vLLM recomputes — a plan for other tokens can never put wrong KV in the cache.

The connector claims off vLLM's step, from several threads at once (one per request waiting
for its claim), so the attachment is created and dropped under a lock, and a claim asks the
node in short rounds: between two rounds it sees whether vLLM gave the request up meanwhile.
A request the connector cannot open is abandoned on the node (``abandon``): the node fails
the attempt now instead of at its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from common.errors import (DeadlineExceeded, DualpathError, InvalidArgument, NotFound,
                           OutOfService, PeerFailed, Unavailable)
from common.kv import KVSpec, block_keys_from_tokens
from services.engine_api.prompt import PromptInfo
from services.engine_api.blocking import SyncDecodeRequest, SyncEngineClient, SyncPrefillHandle
from services.engine_api.liveness import StepClock

from integrations.vllm.sessions import ClaimStopped

log = structlog.get_logger(__name__)

# one claim round: how soon a waiting claim sees that vLLM gave the request up; longer than
# the node's unknown-id grace (services.engine_api.server.UNKNOWN_GRACE_S, 30 s), so an id the
# node never planned is still refused after that grace rather than after claim_timeout_s
CLAIM_ROUND_S = 35.0
ABANDON_WAIT_S = 10.0    # how long the node waits for a plan the engine abandons
# the pause before a claim round that got no answer at all is asked again (such a round has
# already waited CLAIM_ROUND_S plus the call margin; the pause only rules out a tight loop)
UNANSWERED_PAUSE_S = 1.0
KEEP_ATTACHED_S = 1.0    # how often the worker checks that its node still has it attached
Stop = Callable[[], bool]


class EngineSource:
    """One ``SyncEngineClient`` per worker process, connected on first use."""

    def __init__(self, socket_path: str, engine_id: str, role: str, spec: KVSpec,
                 timeout_s: float) -> None:
        self._socket, self._engine_id, self._role = socket_path, engine_id, role
        self._spec, self._timeout_s = spec, timeout_s
        self._client: SyncEngineClient | None = None
        self._lock = threading.Lock()
        self._keeper: threading.Thread | None = None
        self._stop_keeping = threading.Event()
        # the worker marks vLLM's steps here; every client's heartbeat reports the current
        # one, so the node sees a step that never ends (docs/engine-api.md, "A stuck engine")
        self.steps = StepClock()

    @property
    def spec(self) -> KVSpec:
        return self._spec

    def client(self) -> SyncEngineClient:
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _connect(self) -> SyncEngineClient:
        return SyncEngineClient.connect(self._socket, engine_id=self._engine_id,
                                        role=self._role, kv_spec=self._spec,
                                        timeout_s=self._timeout_s, steps=self.steps)

    def keep_attached(self) -> None:
        """Attach now, and from then on again whenever the node's connection is lost.

        The node reports an engine with nothing attached as such and the scheduler places
        nothing on it (docs/engine-api.md, "An engine that is not attached"): re-attaching
        only when a claim comes would never happen after the node service restarted. A
        daemon thread checks once a second (idle, it makes no call)."""
        self.client()
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="dualpath-attach",
                                            daemon=True)
            self._keeper.start()

    def stop_keeping(self) -> None:
        self._stop_keeping.set()

    def _keep(self) -> None:
        lost = 0
        while not self._stop_keeping.wait(KEEP_ATTACHED_S):
            client = self._client
            if client is not None and client.connected:
                continue
            if client is not None:
                self._drop(client, "its connection to the node is down")
            try:
                with self._lock:     # close() sets the event first, then takes the lock
                    if self._stop_keeping.is_set():
                        return
                    if self._client is None:
                        self._client = self._connect()
            except (DualpathError, OSError) as e:
                lost += 1
                if lost == 1 or lost % 60 == 0:      # the node restarting: not every second
                    log.warning("dualpath_node_not_attached", engine=self._engine_id,
                                socket=self._socket, tries=lost, error=str(e))
                continue
            if lost:
                log.info("dualpath_node_reattached", engine=self._engine_id, tries=lost)
            lost = 0

    def planned_hit(self, params: dict[str, Any], token_ids: Sequence[int]) -> int:
        """The plan's hit (whole blocks, below the prompt), or 0 when the params are unusable.

        A decode instance loads the whole prompt but its last token (DecodeSession)."""
        if self._role == "decode":
            return max(0, len(token_ids) - 1)
        hit = params.get("hit_tokens", 0)
        bt = self._spec.block_tokens
        if not isinstance(hit, int) or hit < 0 or hit % bt or hit >= len(token_ids):
            return 0
        return hit

    def open_prefill(self, request_id: str, token_ids: Sequence[int], planned_hit: int,
                     timeout_s: float, stop: Stop = lambda: False,
                     attempt: int | None = None) -> SyncPrefillHandle:
        """The claimed request's handle, used by the connector as it is."""
        return self._checked(self._claim_or_detach("claim_prefill", request_id, timeout_s,
                                                   stop, attempt), token_ids)

    def open_decode(self, request_id: str, token_ids: Sequence[int], timeout_s: float,
                    stop: Stop = lambda: False,
                    attempt: int | None = None) -> SyncDecodeRequest:
        return self._checked(self._claim_or_detach("claim_decode", request_id, timeout_s,
                                                   stop, attempt), token_ids)

    def abandon(self, request_id: str, reason: str, attempt: int | None = None) -> None:
        """Tell the node this engine will not claim ``request_id`` (``attempt``, when given;
        best effort: a node that is gone or never had the plan has nothing to fail)."""
        try:
            self.client().abandon(request_id, reason, ABANDON_WAIT_S, attempt)
        except (DualpathError, OSError) as e:
            log.info("dualpath_abandon_unacknowledged", request_id=request_id, error=str(e))

    def _claim_or_detach(self, method: str, request_id: str, timeout_s: float,
                         stop: Stop, attempt: int | None = None) -> Any:
        """Claim through the attachment. When the node is gone — its service died, stopped or
        restarted (PeerFailed, Unavailable, a socket error: the connection itself broke) —
        drop the attachment: a restarted node service is re-attached without restarting vLLM.
        An attachment that was already dead before this request (the node restarted while we
        idled) is replaced once at once, so the first request after a restart still loads
        through dualpath; otherwise this request fails and vLLM recomputes it.

        A claim with no answer in time (DeadlineExceeded) never drops the attachment: it is
        shared by every request of this instance, and closing it would break the sessions of
        the requests already claimed through it (their finish would reach a closed client:
        the node would never hear of them). Seen in CI: one node stalled for 40 s, a claim
        timed out, the dropped attachment took a running request's session with it, and that
        request hung until the front's deadline. ``_claim`` asks again while the claim's
        deadline allows; past it, this request alone fails. A node that is really gone closes
        the connection, which the next call sees as PeerFailed.

        OutOfService (the node judged this engine's step stuck and has not yet heard the
        beat showing it ended) is no lost attachment either: ``_claim`` asks again after the
        node's ``retry_after_s`` until the claim's deadline, on the same attachment."""
        for retry in (False, True):
            stale = self._client is not None
            client = self.client()
            try:
                return self._claim(getattr(client, method), request_id, timeout_s, stop,
                                   attempt)
            except OutOfService:
                raise
            except (PeerFailed, Unavailable, OSError) as e:
                self._drop(client, f"{method} of {request_id!r} failed: {e}")
                if retry or not stale:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _claim(claim: Any, request_id: str, timeout_s: float, stop: Stop,
               attempt: int | None = None) -> Any:
        """Claim, asking again in rounds until ``timeout_s`` (a decode claim legitimately
        waits for a whole prefill; an engine out of service waits for its beat to put it
        back); ClaimStopped once ``stop()`` says vLLM gave it up.

        The node answers every round (``NotFound`` when it holds nothing yet), so a round with
        no answer at all (``DeadlineExceeded``) means the node's process stood still past the
        call margin — seen in CI: 51 s, a GC pause or a stopped VM elsewhere. It is asked
        again while the claim's deadline allows, instead of giving the request up to a
        recompute: the round it missed was cancelled with the call, and the node that runs
        again answers the new one."""
        deadline = time.monotonic() + timeout_s
        while True:
            if stop():
                raise ClaimStopped(f"request {request_id!r} ended in vLLM before its claim")
            try:
                return claim(request_id,
                             max(0.1, min(deadline - time.monotonic(), CLAIM_ROUND_S)),
                             attempt)
            except NotFound:
                if time.monotonic() >= deadline:
                    raise
            except OutOfService as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.info("dualpath_claim_out_of_service", request_id=request_id, error=str(e))
                time.sleep(min(left, e.retry_after_s or 1.0, CLAIM_ROUND_S))
            except DeadlineExceeded as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning("dualpath_claim_unanswered", request_id=request_id, error=str(e))
                time.sleep(min(left, UNANSWERED_PAUSE_S))

    def _checked(self, claimed: Any, token_ids: Sequence[int]) -> Any:
        """The claimed request, or fail it (InvalidArgument) when it is for other tokens."""
        try:
            self._check_prompt(claimed.info, token_ids)
        except InvalidArgument as e:
            claimed.fail(str(e))
            raise
        return claimed

    def _check_prompt(self, info: PromptInfo, token_ids: Sequence[int]) -> None:
        """The claimed request is for exactly these token ids (length and chained keys)."""
        if info.prompt_tokens != len(token_ids):
            raise InvalidArgument(f"request {info.request_id}: dualpath planned "
                                  f"{info.prompt_tokens} prompt tokens, vLLM has {len(token_ids)}")
        keys = block_keys_from_tokens(token_ids, self._spec.block_tokens)
        if list(info.keys) != keys[:len(info.keys)]:
            raise InvalidArgument(f"request {info.request_id}: the plan's block keys are not "
                                  "the keys of vLLM's prompt token ids")

    def _drop(self, client: SyncEngineClient, reason: str) -> None:
        """Drop ``client`` if it is still the attachment (another thread may have replaced
        it already); the next call attaches anew."""
        with self._lock:
            if self._client is not client:
                return
            self._client = None
        log.warning("dualpath_attachment_dropped", engine=self._engine_id, reason=reason)
        self._close(client)

    def close(self) -> None:
        self._stop_keeping.set()
        with self._lock:
            client, self._client = self._client, None
        self._close(client)

    @staticmethod
    def _close(client: SyncEngineClient | None) -> None:
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 -- closing a dead attachment: nothing to save
                pass
