"""The replay client: agents (or trace requests) through the scheduler's frontend RPC.

Agentic replay (paper §6.6, §7.1–7.2): each agent submits its turns one after another (no tool
latency); a turn's prompt is *previous prompt + generated tokens + appended tokens*, sent as
``token_ids`` so the scheduler's storage lookup finds what the previous turn wrote back. The
hit each turn reports is compared with the client's prediction (:class:`PromptBuilder`): a
difference is counted, never assumed away. Offline: every agent starts at t = 0 (JCT = last
finish). Online: agents arrive as a Poisson process at ``aps`` (TTFT/TTST/TPOT percentiles).

A request that fails with a retryable error (OVERLOADED, a re-plan budget used up, a deadline)
is submitted again, up to ``retries`` times, with ``-r<n>`` appended to its id; every attempt
shows in its record: ``attempt_history`` lists the scheduler's record of each attempt of every
submission (hop, code, message, storage bytes a failed attempt read), in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from common.config import RpcConfig
from common.errors import DualpathError
from common.protocol import (AttemptRecord, FirstToken, RequestFailed, RequestFinished,
                             RequestPlaced, RequestQueued)
from services.scheduler.client.client import SchedulerClient

from .workloads import AgenticWorkload, PromptBuilder, TraceRequest

STREAMS_PER_CLIENT = 192        # below rpc.max_inflight_calls (256): one live stream each


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request's outcome and timings (seconds; ``submit_s`` etc. from the run's start)."""

    request_id: str
    session_id: str
    turn: int
    prompt_tokens: int
    gen_tokens: int
    expected_hit: int | None = None
    hit_tokens: int | None = None
    # what the cluster says an earlier turn stored but the lookup did not find (its write-back
    # was lost with a node): the hit is shorter than the client's prediction by this much
    hit_shortfall_tokens: int = 0
    # the scheduler's storage lookup failed or outlasted hit_lookup_timeout_s, so it took the
    # hit as 0 (correct, only slower: everything is computed); never a mismatch of the data
    hit_lookup_failed: bool = False
    read_side: str | None = None
    split_tokens: int = 0             # read side "split": the DE's leading part of the hit
    pe_node: str | None = None
    de_node: str | None = None
    attempts: int = 0
    resubmits: int = 0
    submit_s: float = 0.0
    end_s: float = 0.0
    outcome: str = "pending"          # finished | failed
    code: str | None = None
    message: str | None = None
    tokens: int = 0
    output_ok: bool | None = None     # generated exactly gen_tokens token ids
    ttft_s: float | None = None
    ttst_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    sched_s: float | None = None
    alloc_s: float | None = None
    read_s: float | None = None
    prefill_s: float | None = None
    attempt_history: list[AttemptRecord] = []   # every attempt of every submission, in order


class Progress:
    """A rich progress bar on stderr when it is a terminal (a plain no-op otherwise)."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn)
            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.fields[note]}"),
                                     console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task(label, total=total, note="")
        self.failed = 0

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def done(self, rec: RequestRecord) -> None:
        self.failed += rec.outcome != "finished"
        if self._bar is not None:
            self._bar.update(self._task, advance=1,
                             note=f"failed {self.failed}" if self.failed else "")


class ClientPool:
    """Enough scheduler connections for ``streams`` concurrent submit streams."""

    def __init__(self, host: str, port: int, streams: int, rpc: RpcConfig | None = None,
                 resolve_factory: Any = None) -> None:
        # resolve_factory() -> a leader resolver per client (etcd mode: election.LeaderResolver)
        n = max(1, -(-streams // STREAMS_PER_CLIENT))
        self.clients = [SchedulerClient(host, port, rpc=rpc, client_id=f"replay-{i}",
                                        resolve=resolve_factory() if resolve_factory else None)
                        for i in range(n)]
        self.sems = [asyncio.Semaphore(STREAMS_PER_CLIENT) for _ in self.clients]
        self._rr = itertools.count()

    async def __aenter__(self) -> ClientPool:
        for c in self.clients:
            await c.connect(timeout=30.0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.clients:
            await c.close()

    def pick(self, key: int | None = None) -> tuple[SchedulerClient, asyncio.Semaphore]:
        i = (next(self._rr) if key is None else key) % len(self.clients)
        return self.clients[i], self.sems[i]


class Replayer:
    """Submits requests and records them; ``t0`` is the run's time origin (monotonic)."""

    def __init__(self, pool: ClientPool, *, deadline_s: float = 300.0, retries: int = 3,
                 on_done: Callable[[RequestRecord], None] | None = None) -> None:
        self.pool = pool
        self.deadline_s = deadline_s
        self.retries = retries
        self.on_done = on_done or (lambda r: None)
        self.t0 = time.monotonic()
        self.records: list[RequestRecord] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def request(self, rec: RequestRecord, key: int | None = None,
                      **submit: Any) -> RequestFinished | None:
        """Submit ``rec``'s request (again on retryable failures); fills ``rec``."""
        client, sem = self.pool.pick(key)
        rec.submit_s = self.now()
        final = None
        async with sem:
            for n in range(self.retries + 1):
                rid = rec.request_id if n == 0 else f"{rec.request_id}-r{n}"
                rec.resubmits = n
                final, retry_after = await self._once(client, rec, rid, submit)
                if final is not None or retry_after is None or n == self.retries:
                    break
                await asyncio.sleep(retry_after)
        rec.end_s = self.now()
        self.records.append(rec)
        self.on_done(rec)
        return final

    async def _once(self, client: SchedulerClient, rec: RequestRecord, rid: str,
                    submit: dict[str, Any]) -> tuple[RequestFinished | None, float | None]:
        """One submission: (finished event, None) or (None, retry delay or None = give up)."""
        try:
            async with client.submit(rid, rec.session_id, rec.prompt_tokens, rec.gen_tokens,
                                     deadline_s=self.deadline_s, **submit) as events:
                async for ev in events:
                    _apply(rec, ev)
                    if isinstance(ev, RequestFinished):
                        return ev, None
                    if isinstance(ev, RequestFailed):
                        return None, (ev.retry_after_s or 0.2) if ev.retryable else None
        except DualpathError as e:
            rec.outcome, rec.code, rec.message = "failed", e.code.value, e.message
            return None, (e.retry_after_s or 0.2) if e.retryable else None
        rec.outcome, rec.code = "failed", "STREAM_ENDED"
        return None, None


def _apply(rec: RequestRecord, ev: Any) -> None:
    match ev:
        case RequestQueued():
            rec.hit_tokens = ev.hit_tokens
            rec.hit_shortfall_tokens = ev.hit_shortfall_tokens
            rec.hit_lookup_failed = ev.hit_lookup_failed
        case RequestPlaced():
            rec.attempts += 1                # one placement per attempt
            rec.read_side, rec.pe_node, rec.de_node = ev.read_side, ev.pe_node, ev.de_node
            rec.hit_tokens, rec.split_tokens = ev.hit_tokens, ev.split_tokens
        case FirstToken():
            rec.sched_s, rec.alloc_s, rec.read_s, rec.prefill_s = (ev.sched_s, ev.alloc_s,
                                                                   ev.read_s, ev.prefill_s)
        case RequestFinished():
            rec.outcome, rec.code, rec.message = "finished", None, None
            rec.tokens, rec.hit_tokens = ev.tokens, ev.hit_tokens
            rec.hit_shortfall_tokens = ev.hit_shortfall_tokens
            rec.hit_lookup_failed = ev.hit_lookup_failed
            rec.ttft_s, rec.ttst_s, rec.tpot_s, rec.e2e_s = ev.ttft_s, ev.ttst_s, ev.tpot_s, \
                ev.e2e_s
            out = ev.output_token_ids
            rec.output_ok = None if out is None else len(out) == rec.gen_tokens
            rec.attempt_history = rec.attempt_history + ev.attempts
        case RequestFailed():
            rec.outcome, rec.code, rec.message = "failed", ev.code, ev.message
            rec.attempt_history = rec.attempt_history + ev.attempts


# --------------------------------------------------------------------------- agentic

async def run_agentic(pool: ClientPool, workload: AgenticWorkload, *, block_tokens: int,
                      aps: float | None = None, deadline_s: float = 300.0, retries: int = 3,
                      progress: Progress | None = None, stop_after_s: float | None = None
                      ) -> Replayer:
    """Replay every agent (offline: all at t = 0; online: Poisson arrivals at ``aps``)."""
    r = Replayer(pool, deadline_s=deadline_s, retries=retries,
                 on_done=progress.done if progress else None)
    trajs = workload.trajectories()
    starts = workload.arrival_times(aps) if aps else [0.0] * len(trajs)

    async def agent(i: int) -> None:
        await asyncio.sleep(max(starts[i] - r.now(), 0.0))
        if stop_after_s is not None and r.now() > stop_after_s:
            return
        await _agent(r, trajs[i], block_tokens, i)

    await asyncio.gather(*(agent(i) for i in range(len(trajs))))
    return r


async def _agent(r: Replayer, traj, block_tokens: int, key: int) -> None:
    pb = PromptBuilder(traj, block_tokens)
    for k, turn in enumerate(traj.turns):
        prompt, expect = pb.prompt(k)
        rec = RequestRecord(request_id=f"{traj.session_id}-t{k}", session_id=traj.session_id,
                            turn=k, prompt_tokens=len(prompt), gen_tokens=turn.gen,
                            expected_hit=expect)
        final = await r.request(rec, key, token_ids=prompt)
        if final is None:
            return                      # the agent cannot go on without this turn's output
        pb.finished(k, prompt, final.output_token_ids)
        if final.output_token_ids is None:
            rec.expected_hit = None     # stub nodes: nothing is stored, nothing to predict


# --------------------------------------------------------------------------- trace

async def run_trace(pool: ClientPool, requests: Sequence[TraceRequest], *,
                    deadline_s: float = 300.0, retries: int = 3,
                    progress: Progress | None = None) -> Replayer:
    """Submit each trace request at its timestamp (block keys, no token ids)."""
    r = Replayer(pool, deadline_s=deadline_s, retries=retries,
                 on_done=progress.done if progress else None)

    async def one(req: TraceRequest) -> None:
        await asyncio.sleep(max(req.t_s - r.now(), 0.0))
        rec = RequestRecord(request_id=f"trace-{req.index}", session_id=f"trace-{req.index}",
                            turn=0, prompt_tokens=req.prompt_tokens, gen_tokens=req.gen_tokens)
        await r.request(rec, req.index, block_keys=req.keys)

    await asyncio.gather(*(one(q) for q in requests))
    return r


@contextlib.asynccontextmanager
async def connected(host: str, port: int, streams: int, rpc: RpcConfig | None = None):
    async with ClientPool(host, port, streams, rpc) as pool:
        yield pool
