"""Per-group outboxes: what a group leader has yet to receive in its FetchWork replies.

The core decides in bulk (one PE fetch may place hundreds of requests under β), but a reply must
stay inside the frame limit and the config bounds, so decisions wait here, keyed by
``(request_id, attempt)``, and go out in order over as many fetches as needed (``more`` tells
the leader to fetch again at once). An entry whose attempt is no longer current when its turn
comes (cancelled, re-planned, failed) is dropped, never sent.

Delivery is at-least-once when the leader acknowledges (``FetchWork.ack_seq``): the last reply
stays until acked and is sent again if the leader says it did not process it; the leader
ignores a ``seq`` it has already applied.

While decisions wait here the leader's telemetry cannot count them, so :func:`pending_load`
adds them back before the telemetry replaces the core's figures. A PE's load is counted in the
core's unit (``SchedulerConfig.pe_load_counter``: prefill-cost-weighted tokens by default); the
PE receivers report theirs in the same unit, since every process reads the same config.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from common.errors import InvalidArgument
from common.protocol import DecodeBinding, FetchWork, FetchWorkReply, RequestPlan, Revocation

from ..core.records import EngineReport, Role, Telemetry, prompt_kv_bytes
from .leases import Registration
from .request_state import RequestState

PLAN_BASE_BYTES = 512       # encoded RequestPlan without keys, generously (endpoints, ids)
KEY_BYTES = 35              # one 32-char hex key in msgpack


class Outbox:
    """Undelivered decisions for one group (a prefill or decode group leader)."""

    __slots__ = ("role", "group_id", "bindings", "plans", "revoked", "seq", "unacked")

    def __init__(self, role: str, group_id: str) -> None:
        self.role = role
        self.group_id = group_id
        self.bindings: deque[tuple[str, int]] = deque()
        self.plans: deque[tuple[str, int]] = deque()
        self.revoked: deque[Revocation] = deque()
        self.seq = 0
        self.unacked: FetchWorkReply | None = None

    def __bool__(self) -> bool:
        return bool(self.bindings or self.plans or self.revoked)

    def resend(self, ack_seq: int | None) -> FetchWorkReply | None:
        """The last reply again when the leader says it did not process it; else None."""
        last = self.unacked
        if ack_seq is None or last is None:
            return None
        if ack_seq >= last.seq:
            self.unacked = None
            return None
        return last


class Outboxes:
    """Every registered group leader's outbox, by ``(role, group_id)``; opened when a leader
    registers engines, closed when its registration goes."""

    def __init__(self) -> None:
        self._boxes: dict[tuple[str, str], Outbox] = {}

    def open(self, role: str, group_id: str) -> Outbox:
        box = self._boxes[(role, group_id)] = Outbox(role, group_id)
        return box

    def close(self, role: str, group_id: str) -> None:
        self._boxes.pop((role, group_id), None)

    def get(self, role: str, group_id: str | None) -> Outbox | None:
        return self._boxes.get((role, group_id)) if group_id is not None else None

    def __getitem__(self, key: tuple[str, str]) -> Outbox:
        return self._boxes[key]

    def revoke(self, rs: RequestState, reason: str) -> int:
        """Tell each group that got ``rs``'s current attempt to drop it; how many were told."""
        sent = 0
        for role, group in ((Role.DECODE.value, rs.de_group), (Role.PREFILL.value, rs.pe_group)):
            box = self.get(role, group)
            if box is not None:
                box.revoked.append(Revocation(rs.request_id, rs.attempt, reason[:300]))
                sent += 1
        rs.de_group = rs.pe_group = None
        return sent

    def rebind(self, rs: RequestState) -> None:
        """A re-plan kept ``rs``'s DE: its loader gets the new attempt's binding again."""
        box = self.get(Role.DECODE.value, rs.de_node)
        if box is not None:
            box.bindings.append((rs.request_id, rs.attempt))


class Limits:
    """Bounds of one reply (from SchedulerServiceConfig)."""

    __slots__ = ("plans", "bindings", "revocations", "budget_bytes")

    def __init__(self, plans: int, bindings: int, revocations: int, budget_bytes: int) -> None:
        self.plans, self.bindings = plans, bindings
        self.revocations, self.budget_bytes = revocations, budget_bytes


def take_reply(box: Outbox, requests: Mapping[str, RequestState], limits: Limits,
               make_binding: Callable[[RequestState], DecodeBinding],
               make_plan: Callable[[RequestState], RequestPlan],
               delivered: Callable[[RequestState, str], None],
               ack: bool) -> FetchWorkReply:
    """Build the next reply from ``box`` within ``limits``; ``delivered(rs, kind)`` per item."""
    revoked = _pop(box.revoked, limits.revocations)
    bindings = []
    while box.bindings and len(bindings) < limits.bindings:
        rs = _live(requests, *box.bindings.popleft())
        if rs is not None:
            bindings.append(make_binding(rs))
            delivered(rs, "binding")
    plans, used = [], 0
    while box.plans and len(plans) < limits.plans:
        rs = _live(requests, *box.plans[0])
        if rs is None:
            box.plans.popleft()
            continue
        size = plan_bytes(rs)
        if plans and used + size > limits.budget_bytes:
            break
        box.plans.popleft()
        plans.append(make_plan(rs))
        used += size
        delivered(rs, "plan")
    box.seq += 1
    reply = FetchWorkReply(box.seq, bindings, plans, revoked, more=bool(box))
    box.unacked = reply if ack else None
    return reply


def plan_bytes(rs: RequestState) -> int:
    return PLAN_BASE_BYTES + KEY_BYTES * len(rs.sub.keys)


def leader_telemetry(reg: Registration, msg: FetchWork, box: Outbox,
                     requests: Mapping[str, RequestState],
                     pe_load: Callable[[int, int], int] | None = None) -> Telemetry | None:
    """A leader's reported figures (checked) plus what it has not received yet; None: none.

    ``pe_load`` is the core's ``(hit, new) -> PE load`` (raw prompt tokens when None).
    """
    if msg.read_q_tokens is not None and msg.read_q_tokens < 0:
        raise InvalidArgument(f"read_q_tokens={msg.read_q_tokens} must be >= 0")
    own = {e.engine_id for e in reg.engines}
    for load in msg.engines:
        if load.engine_id not in own:
            raise InvalidArgument(f"engine {load.engine_id[:80]!r} is not one of "
                                  f"{reg.node_id}'s registered {reg.role} engines")
        if (load.seq < 0 or load.tok < 0 or (load.free_hbm_bytes or 0) < 0
                or (load.buffer_free_bytes or 0) < 0 or load.attaches < 0):
            raise InvalidArgument(f"engine {load.engine_id!r}: seq, tok, free_hbm_bytes, "
                                  f"buffer_free_bytes and attaches must be >= 0")
    if not msg.engines and msg.read_q_tokens is None:
        return None
    extra = pending_load(box, requests, pe_load)
    # a PE reports its node's free buffer (shared by the node's PEs): less the prompt KV of
    # every plan for any of them still in the outbox; a DE its node's free DE buffer beside
    # its own HBM: less the HBM of every binding to any of the node's DEs still in the outbox
    node_bytes = sum(extra.get(e.engine_id, (0, 0, 0))[2] for e in reg.engines)
    reports = []
    for load in msg.engines:
        s, t, h = extra.get(load.engine_id, (0, 0, 0))
        if reg.role == "prefill":
            h = node_bytes
        free = None if load.free_hbm_bytes is None else max(load.free_hbm_bytes - h, 0)
        buffer = (None if load.buffer_free_bytes is None
                  else max(load.buffer_free_bytes - node_bytes, 0))
        reports.append(EngineReport(load.engine_id, load.seq + s, load.tok + t, free, buffer))
    read_q = {} if msg.read_q_tokens is None else {reg.node_id: msg.read_q_tokens}
    return Telemetry(tuple(reports), read_q)


def pending_load(box: Outbox, requests: Mapping[str, RequestState],
                 pe_load: Callable[[int, int], int] | None = None
                 ) -> dict[str, tuple[int, int, int]]:
    """Per engine: (requests, load, bytes) decided but not yet delivered to the leader.

    A DE's load is the tokens it will hold (raw) and its bytes the HBM reserved; a PE's load
    is ``pe_load(hit, new)`` of the plan, the core's unit (raw prompt tokens when None), and
    its bytes the prompt's KV its node's buffer will stage.
    """
    extra: dict[str, tuple[int, int, int]] = {}
    for rid, attempt in box.bindings:
        rs = _live(requests, rid, attempt)
        if rs is not None and rs.de_engine is not None:
            tokens = rs.sub.prompt_tokens + rs.sub.gen_tokens
            _add(extra, rs.de_engine, tokens, rs.hbm_bytes)
    for rid, attempt in box.plans:
        rs = _live(requests, rid, attempt)
        if rs is not None and rs.assignment is not None:
            a = rs.assignment
            tokens = pe_load(a.hit_tokens, a.new_tokens) if pe_load else a.hit_tokens + a.new_tokens
            _add(extra, a.pe_engine, tokens,
                 prompt_kv_bytes(rs.hbm_bytes, a.hit_tokens + a.new_tokens, a.gen_tokens))
    return extra


def _add(extra: dict[str, tuple[int, int, int]], engine: str, tokens: int, hbm: int) -> None:
    s, t, h = extra.get(engine, (0, 0, 0))
    extra[engine] = (s + 1, t + tokens, h + hbm)


def _live(requests: Mapping[str, RequestState], rid: str, attempt: int) -> RequestState | None:
    rs = requests.get(rid)
    if rs is None or rs.attempt != attempt or rs.terminal:
        return None
    return rs


def _pop(q: deque, n: int) -> list:
    out = []
    while q and len(out) < n:
        out.append(q.popleft())
    return out
