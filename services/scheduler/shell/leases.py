"""Registrations of node services and their leases (sans-I/O: times are passed in).

A registration is keyed by ``(node_id, service)``; its ``epoch`` names the incarnation. A
service that registers engines is the **group leader** of its role on the node (paper §6.1:
one group per node and role; the leader fetches for all of them), so at most one registration
per ``(node_id, role)`` carries engines. The table only answers questions and records
decisions; the service turns an expired or replaced leader into ``Scheduler.remove_engine``
calls and re-plans.
"""

from __future__ import annotations

from common.errors import AlreadyExists, InvalidArgument, NotFound
from common.protocol import EngineInfo, Endpoint, NodeStatus, RegisterNode

ROLES = ("prefill", "decode")


class Registration:
    """One live node service."""

    __slots__ = ("msg", "expires_at", "detached", "attaches")

    def __init__(self, msg: RegisterNode, expires_at: float) -> None:
        self.msg = msg
        self.expires_at = expires_at
        # its engines out of the core because the node reported them not attached (telemetry
        # or a failure report), each with the number of the attachment known to have ended:
        # out until the node reports another one attached
        self.detached: dict[str, int] = {}
        # per engine, the latest attachment number its node reported (EngineLoad.attaches)
        self.attaches: dict[str, int] = {}

    @property
    def key(self) -> tuple[str, str]:
        return self.msg.node_id, self.msg.service

    @property
    def node_id(self) -> str:
        return self.msg.node_id

    @property
    def epoch(self) -> int:
        return self.msg.epoch

    @property
    def role(self) -> str:
        return self.msg.role

    @property
    def engines(self) -> list[EngineInfo]:
        return self.msg.engines

    @property
    def group_id(self) -> str:
        """Engine group of a leader: its node (one group per node and role)."""
        return self.msg.node_id

    def endpoint(self) -> Endpoint:
        m = self.msg
        return Endpoint(m.node_id, m.service, m.control_host, m.control_port, m.ucx_host,
                        m.ucx_port)

    def status(self, now: float) -> NodeStatus:
        m = self.msg
        return NodeStatus(m.node_id, m.service, m.role, m.epoch, max(self.expires_at - now, 0.0),
                          m.control_host, m.control_port, [e.engine_id for e in m.engines])

    def same_incarnation(self, msg: RegisterNode) -> bool:
        return self.msg == msg


def check_registration(msg: RegisterNode, max_id_chars: int, max_engines: int) -> None:
    """Bad registrations fail with InvalidArgument naming the field."""
    for name in ("node_id", "service"):
        value = getattr(msg, name)
        if not value or len(value) > max_id_chars or not value.isprintable():
            raise InvalidArgument(f"RegisterNode.{name} {value[:80]!r} must be 1..{max_id_chars} "
                                  f"printable characters")
    if msg.role not in ROLES + ("",):
        raise InvalidArgument(f"RegisterNode.role {msg.role!r} must be one of {ROLES} or ''")
    if not 0 <= msg.control_port < 65536 or not 0 <= msg.ucx_port < 65536:
        raise InvalidArgument(f"{msg.node_id}/{msg.service}: ports must be in [0, 65535]")
    if len(msg.engines) > max_engines:
        raise InvalidArgument(f"{msg.node_id}/{msg.service}: {len(msg.engines)} engines, above "
                              f"scheduler_service.max_engines_per_node={max_engines}")
    if msg.engines and not msg.role:
        raise InvalidArgument(f"{msg.node_id}/{msg.service}: engines need a role "
                              f"(prefill or decode)")
    ids = [e.engine_id for e in msg.engines]
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"{msg.node_id}/{msg.service}: duplicate engine ids {ids}")
    for e in msg.engines:
        if not e.engine_id or len(e.engine_id) > max_id_chars or not e.engine_id.isprintable():
            raise InvalidArgument(f"engine id {e.engine_id[:80]!r} must be 1..{max_id_chars} "
                                  f"printable characters")
        if e.role != msg.role:
            raise InvalidArgument(f"engine {e.engine_id!r} has role {e.role!r} but its node "
                                  f"service registers as {msg.role!r}")
        if e.hbm_capacity_bytes < 0:
            raise InvalidArgument(f"engine {e.engine_id!r}: hbm_capacity_bytes must be >= 0")


class LeaseTable:
    """Live registrations by ``(node_id, service)`` and group leaders by ``(node_id, role)``."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._regs: dict[tuple[str, str], Registration] = {}
        self._leaders: dict[tuple[str, str], Registration] = {}
        self._engine_owner: dict[str, Registration] = {}

    def __len__(self) -> int:
        return len(self._regs)

    def __iter__(self):
        return iter(list(self._regs.values()))

    def get(self, node_id: str, service: str) -> Registration | None:
        return self._regs.get((node_id, service))

    def leader(self, node_id: str, role: str) -> Registration | None:
        return self._leaders.get((node_id, role))

    def find_service(self, node_id: str, service: str) -> Registration | None:
        return self._regs.get((node_id, service))

    def classify(self, msg: RegisterNode, now: float | None = None) -> Registration | None:
        """The registration ``msg`` replaces (None: new), or raise if it may not register.

        Same epoch and content: an idempotent retry (returns the live one, which the caller
        keeps). Higher epoch: a restart (the caller removes the old one first) — from the same
        host while the old lease is live; another host claiming a live id is two nodes with
        one id (refused until that lease runs out).
        """
        old = self._regs.get((msg.node_id, msg.service))
        if (old is not None and now is not None and old.expires_at > now
                and msg.epoch > old.epoch and msg.control_host != old.msg.control_host):
            raise AlreadyExists(f"two nodes with one id: {msg.node_id}/{msg.service} is live at "
                                f"{old.msg.control_host} (lease {old.expires_at - now:.1f} s "
                                f"left) and {msg.control_host} registers it too")
        if old is not None:
            if msg.epoch < old.epoch:
                raise AlreadyExists(f"{msg.node_id}/{msg.service}: epoch {msg.epoch} is older than "
                                    f"the registered {old.epoch}; this incarnation was replaced")
            if msg.epoch == old.epoch and not old.same_incarnation(msg):
                raise AlreadyExists(f"{msg.node_id}/{msg.service}: epoch {msg.epoch} is already "
                                    f"registered with other details; register with a higher epoch")
        if msg.engines:
            lead = self._leaders.get((msg.node_id, msg.role))
            if lead is not None and lead is not old:
                raise AlreadyExists(f"node {msg.node_id!r} already has a {msg.role} group leader "
                                    f"({lead.msg.service}); one service per node registers engines")
            for e in msg.engines:
                owner = self._engine_owner.get(e.engine_id)
                if owner is not None and owner is not old:
                    raise AlreadyExists(f"engine {e.engine_id!r} is already registered by "
                                        f"{owner.node_id}/{owner.msg.service}")
        return old

    def add(self, msg: RegisterNode, now: float) -> Registration:
        reg = Registration(msg, now + self.lease_s)
        self._regs[reg.key] = reg
        if msg.engines:
            self._leaders[(msg.node_id, msg.role)] = reg
            for e in msg.engines:
                self._engine_owner[e.engine_id] = reg
        return reg

    def remove(self, reg: Registration) -> None:
        if self._regs.get(reg.key) is not reg:
            return
        del self._regs[reg.key]
        if self._leaders.get((reg.node_id, reg.role)) is reg:
            del self._leaders[(reg.node_id, reg.role)]
        for e in reg.engines:
            if self._engine_owner.get(e.engine_id) is reg:
                del self._engine_owner[e.engine_id]

    def live(self, node_id: str, service: str, epoch: int) -> Registration:
        """The registration a heartbeat names, or NotFound telling the caller to re-register."""
        reg = self._regs.get((node_id, service))
        if reg is None or reg.epoch != epoch:
            have = "none" if reg is None else f"epoch {reg.epoch}"
            raise NotFound(f"{node_id}/{service} epoch {epoch} is not registered (lease expired "
                           f"or replaced; registered: {have}): drop in-flight work and register "
                           f"again with a higher epoch")
        return reg

    def live_leader(self, node_id: str, role: str, epoch: int) -> Registration:
        reg = self._leaders.get((node_id, role))
        if reg is None or reg.epoch != epoch:
            have = "none" if reg is None else f"epoch {reg.epoch}"
            raise NotFound(f"no {role} group leader on {node_id!r} with epoch {epoch} (registered: "
                           f"{have}): register the node's engines again with a higher epoch")
        return reg

    def renew(self, reg: Registration, now: float) -> None:
        reg.expires_at = now + self.lease_s

    def extend(self, seconds: float) -> None:
        """Push every lease back by ``seconds``: time the scheduler itself did not run."""
        for reg in self._regs.values():
            reg.expires_at += seconds

    def expired(self, now: float) -> list[Registration]:
        return [r for r in self._regs.values() if r.expires_at < now]
