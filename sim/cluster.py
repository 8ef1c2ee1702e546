"""The simulated PD cluster: nodes, links, engines, the real scheduler core, and the request flow.

One request (one agent turn) goes through, in simulated time:

1. ``submit`` → ``Scheduler.submit`` (global DE queue). A common fetch tick runs every
   ``engine.fetch_interval_s`` while anything waits: each DE group leader fetches
   (``on_de_group_fetch`` → DE bound, HBM reserved), then each PE group leader
   (``on_pe_group_fetch`` → PE, read side); the start group rotates every tick.
2. The hit KV is read on the chosen node's storage link: a FIFO read queue per node serving
   ``engine.read_concurrency`` reads at once, each a flow over the SNIC (read direction) into
   that node's buffer (DRAM write) → ``Scheduler.read_done``.
3. The PE's ``PrefillBatcher`` cuts it into forward batches; the unit runs them with the hops
   of the request's read path (``engines.Prefill``) → ``Scheduler.prefill_done`` once its last
   chunk's KV is in the DE buffer.
4. H2D on the DE (DE buffer → DE CNIC → DE HBM), then decode in the DE's batch, then the new
   full blocks are written back (D2H → DRAM → SNIC, write direction) → ``Scheduler.complete``
   → the agent submits its next turn at once (no tool latency, as in the paper).

Oracle mode moves no KV at all. The scheduler object is ``services.scheduler.Scheduler`` itself:
the simulator only feeds it events and follows its decisions.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from typing import Any

from services.compute_model.batching import PrefillBatcher
from services.scheduler.core.records import EngineSpec, ReadSide, Request, Role
from services.scheduler.core.scheduler import Scheduler

from .config import SimConfig, mode_spec, scheduler_config
from .engines import SIDE_DE, SIDE_NONE, SIDE_PE, SIDE_SPLIT, DEGpu, PEGpu, PEUnit, Prefill
from .events import EventLoop
from .flows import FlowNet, Link, merge_links
from .stats import LogHistogram, WindowSeries

_SIDE = {ReadSide.PE: SIDE_PE, ReadSide.DE: SIDE_DE, ReadSide.SPLIT: SIDE_SPLIT,
         ReadSide.NONE: SIDE_NONE}


class Node:
    __slots__ = ("node_id", "role", "snic_rd", "snic_wr", "dram", "rq", "reading", "read_links")

    def __init__(self, node_id: str, role: str, snic: float, dram: float,
                 shared: bool = False) -> None:
        self.node_id = node_id
        self.role = role
        self.snic_rd = Link(f"{node_id}/snic_rd", snic)
        # shared (hardware.snic_shared): write-backs queue on the read link, as in the emulation
        self.snic_wr = self.snic_rd if shared else Link(f"{node_id}/snic_wr", snic)
        self.dram = Link(f"{node_id}/dram", dram)
        self.rq: deque = deque()
        self.reading = 0
        # storage read: SNIC (read direction) → node buffer (DRAM write)
        self.read_links = merge_links(((self.snic_rd, 1.0), (self.dram, 1.0)))


class Req:
    """One in-flight turn (dropped at completion)."""

    __slots__ = ("rid", "agent", "hit", "new", "gen", "prompt", "t_submit", "t_bound", "t_assign",
                 "t_ready", "t_prefill", "t_join", "t_second", "pe", "de", "side", "split",
                 "reads_left", "first")

    def __init__(self, rid: str, agent, hit: int, new: int, gen: int, now: float) -> None:
        self.rid = rid
        self.agent = agent
        self.hit = hit
        self.new = new
        self.gen = gen
        self.prompt = hit + new
        self.t_submit = now
        self.t_bound = self.t_assign = self.t_ready = self.t_prefill = now
        self.t_join = self.t_second = now
        self.pe: Any = None
        self.de: Any = None
        self.side = SIDE_NONE
        self.split = 0                 # a split read: the DE's leading part (tokens)
        self.reads_left = 0            # storage reads still running (two on a split read)
        self.first = True


class Cluster:
    """A cluster of ``cfg``'s shape running ``mode`` on ``workload``; ``run()`` returns results."""

    def __init__(self, cfg: SimConfig, mode: str, workload, *, online: bool = False,
                 aps: float | None = None, exact: bool | None = None) -> None:
        if online and not aps:
            raise ValueError("online mode needs an arrival rate (aps > 0)")
        self.cfg = cfg
        self.mode = mode
        self.spec = mode_spec(mode)
        self.workload = workload
        self.online = online
        self.aps = aps or 0.0
        self.exact = cfg.sim.exact_layers if exact is None else exact
        kv = cfg.kv
        self.bpt = kv.bytes_per_token
        self.bt = kv.block_tokens
        self.L = kv.num_layers
        self.ts = cfg.sim.time_scale
        self.loop = EventLoop()
        self.net = FlowNet(self.loop)
        self.reqs: dict[str, Req] = {}
        self.n_agents = workload.n_agents
        # trace workloads (session_workload.py): top-level sessions arrive, sub-agents are
        # spawned by their parent and count towards n_agents; think times delay a session's next
        # turn
        self.n_roots = int(getattr(workload, "n_roots", self.n_agents))
        self.nested = bool(getattr(workload, "nested", False))
        self._build()
        self.prefill = Prefill(self)
        self.interval = cfg.engine.fetch_interval_s
        self.read_conc = cfg.engine.read_concurrency
        self.io = not self.spec.oracle
        # write-backs counted, not contended — unless they share the read link, where they are
        # what a miss-heavy workload's storage traffic mostly is (docs/workloads.md)
        self.fast_wb = not self.exact and not cfg.hardware.snic_shared
        self.waiting_de = self.waiting_pe = 0
        self.tick_armed = False
        self.tick_no = 0
        # measurement
        self.agents_started = self.agents_done = 0
        self.requests_done = 0
        self.tokens_prompt = self.tokens_gen = 0
        self.read_bytes = [0.0, 0.0]          # PE path, DE path
        self.ttft, self.ttst, self.tpot = LogHistogram(), LogHistogram(), LogHistogram()
        self.ttft_ss, self.tpot_ss = LogHistogram(), LogHistogram()
        self.agent_jct = LogHistogram()
        self.breakdown = [0.0, 0.0, 0.0, 0.0]  # DE wait, PE wait, read, prefill (sums)
        self.ss_window = (0.0, math.inf)
        self.span = math.inf                     # online: when the last agent arrives (expected)
        self.quarters = [[0.0, 0] for _ in range(4)]   # online: TTFT sum/count by submit quarter
        self._read_done_cb = self._read_done     # bound once
        self.windows = WindowSeries([n.snic_rd for n in self.nodes], cfg.sim.window_s)
        self.attn_windows: dict[int, list[float]] = {}
        self.wall_s = 0.0
        # (request id, session, submit time) of every request, when the caller asks for it
        self.request_log: list | None = None

    # ------------------------------------------------------------------ topology
    def _build(self) -> None:
        cfg, h = self.cfg, self.cfg.hardware
        shared = h.snic_shared
        self.pnodes = [Node(f"P{i}", "prefill", h.snic_bytes_per_s, h.dram_bytes_per_s, shared)
                       for i in range(h.prefill_nodes)]
        self.dnodes = [Node(f"D{i}", "decode", h.snic_bytes_per_s, h.dram_bytes_per_s, shared)
                       for i in range(h.decode_nodes)]
        self.nodes = self.pnodes + self.dnodes
        self.node_by_id = {n.node_id: n for n in self.nodes}
        specs: list[EngineSpec] = []
        self.pe_by_id: dict[str, PEGpu] = {}
        self.units: list[PEUnit] = []
        for i, node in enumerate(self.pnodes):
            gpus = []
            for k in range(h.gpus_per_node):
                gpu = PEGpu(f"p{i}.{k}", node, h.cnic_bytes_per_s, self._batcher())
                gpus.append(gpu)
                self.pe_by_id[gpu.engine_id] = gpu
                specs.append(EngineSpec(gpu.engine_id, Role.PREFILL, node.node_id))
            if cfg.model.ep_sync:
                self.units.append(PEUnit(gpus))
            else:
                self.units += [PEUnit([g]) for g in gpus]
        self.de_by_id: dict[str, DEGpu] = {}
        for i, node in enumerate(self.dnodes):
            for k in range(h.gpus_per_node):
                dgpu = DEGpu(f"d{i}.{k}", node, h.cnic_bytes_per_s, self)
                self.de_by_id[dgpu.engine_id] = dgpu
                specs.append(EngineSpec(dgpu.engine_id, Role.DECODE, node.node_id,
                                        hbm_capacity_bytes=int(h.de_hbm_kv_bytes)))
        self.sched = Scheduler(scheduler_config(cfg, self.mode), specs, block_tokens=self.bt)
        self.de_groups = self.sched.group_ids(Role.DECODE)
        self.pe_groups = self.sched.group_ids(Role.PREFILL)

    def _batcher(self) -> PrefillBatcher:
        cfg, spec, ts = self.cfg, self.spec, self.ts
        if spec.quota:
            attn = cfg.cost.attention_fn()     # = attention_s, without the method-call layers
            cost = attn if ts == 1.0 else (lambda c, n: attn(c, n) * ts)
            return PrefillBatcher(cost, cfg.engine.compute_quota_s * ts)
        bpt, hbm = self.bpt, cfg.hardware.pe_hbm_kv_bytes
        if spec.layerwise:           # one layer (plus the prefetched ones) of the batch in HBM
            per = bpt * (cfg.engine.prefetch_layers + 1) / self.L
            return PrefillBatcher(lambda c, n: (c + n) * per, hbm, cfg.engine.max_batch_new_tokens)
        return PrefillBatcher(lambda c, n: (c + n) * bpt, hbm, cfg.engine.max_batch_new_tokens)

    def links_by_class(self) -> dict[str, list[Link]]:
        pe, de = list(self.pe_by_id.values()), list(self.de_by_id.values())
        return {"snic_read": [n.snic_rd for n in self.nodes],
                "snic_write": [n.snic_wr for n in self.nodes],
                "pe_cnic_read": [g.cnic_rd for g in pe], "pe_cnic_write": [g.cnic_wr for g in pe],
                "de_cnic_read": [g.cnic_rd for g in de], "de_cnic_write": [g.cnic_wr for g in de],
                "pe_dram": [n.dram for n in self.pnodes], "de_dram": [n.dram for n in self.dnodes]}

    # ------------------------------------------------------------------ agents
    def _start_agent(self, agent) -> None:
        agent.start = self.loop.now
        self.agents_started += 1
        self._next_turn(agent)

    def _next_turn(self, agent) -> None:
        if self.nested:
            kids = self.workload.spawn(agent)
            if kids:                       # the parent waits until its sub-agents are done
                agent.waiting = len(kids)
                for kid in kids:
                    kid.parent = agent
                    self._start_agent(kid)
                return
        t = self.workload.next_turn(agent)
        if t is None:
            now = self.loop.now
            agent.done_t = now
            self.agents_done += 1
            self.agent_jct.add(now - agent.start)
            if self.agents_done == self.n_agents:
                self.loop.stop()
            parent = agent.parent
            if parent is not None:
                parent.waiting -= 1
                if parent.waiting == 0:
                    self._next_turn(parent)
            return
        hit, new, gen = t
        now = self.loop.now
        rid = f"{agent.aid}.{agent.turn}"
        rec = Req(rid, agent, hit, new, gen, now)
        self.reqs[rid] = rec
        if self.request_log is not None:
            self.request_log.append((rid, agent.session, now))
        self.sched.submit(Request(rid, agent.session, hit, new, gen,     # = Request.sized
                                  (hit + new + gen) * self.bpt))
        self.waiting_de += 1
        if not self.tick_armed:
            self.tick_armed = True
            iv = self.interval
            self.loop.at(math.ceil(now / iv - 1e-9) * iv, self._tick)

    def _arrivals(self, k: int) -> None:
        self._start_agent(self.workload.make_agent(k))
        if k + 1 < self.n_roots:
            self.loop.after(self.workload.arrival_gap(k + 1, self.aps), self._arrivals, k + 1)

    # ------------------------------------------------------------------ scheduling
    def _tick(self, _) -> None:
        sched = self.sched
        k = self.tick_no
        self.tick_no = k + 1
        if self.waiting_de:
            groups = self.de_groups
            n = len(groups)
            for i in range(n):
                for b in sched.on_de_group_fetch(groups[(k + i) % n]):
                    rec = self.reqs[b.request_id]
                    rec.de = self.de_by_id[b.de_engine]
                    rec.t_bound = self.loop.now
                    self.waiting_de -= 1
                    self.waiting_pe += 1
        if self.waiting_pe:
            groups = self.pe_groups
            n = len(groups)
            for i in range(n):
                for a in sched.on_pe_group_fetch(groups[(k + i) % n]):
                    self._assigned(a)
        if self.waiting_de or self.waiting_pe:
            self.loop.after(self.interval, self._tick)
        else:
            self.tick_armed = False

    def _assigned(self, a) -> None:
        rec = self.reqs[a.request_id]
        self.waiting_pe -= 1
        rec.pe = self.pe_by_id[a.pe_engine]
        rec.t_assign = self.loop.now
        rec.side = side = _SIDE[a.read_side]
        if a.read_node is None:
            self._ready(rec)
            return
        if side == SIDE_SPLIT:         # the DE's node reads the leading part, the PE's the rest
            rec.split = split = a.split_tokens
            rec.reads_left = 2
            self._read(self.node_by_id[a.read_node], rec, rec.hit - split, SIDE_PE)
            self._read(self.node_by_id[a.de_node], rec, split, SIDE_DE)
        else:
            rec.reads_left = 1
            self._read(self.node_by_id[a.read_node], rec, rec.hit, side)

    def _read(self, node: Node, rec: Req, tokens: int, side: int) -> None:
        nbytes = tokens * self.bpt
        self.read_bytes[side] += nbytes
        node.rq.append((rec, nbytes))
        if node.reading < self.read_conc:
            self._next_read(node)

    def _next_read(self, node: Node) -> None:
        while node.reading < self.read_conc and node.rq:
            rec, nbytes = node.rq.popleft()
            node.reading += 1
            self.net.start(node.read_links, nbytes, self._read_done_cb, (rec, node))

    def _read_done(self, arg: tuple[Req, Node]) -> None:
        rec, node = arg
        node.reading -= 1
        rec.reads_left -= 1
        if not rec.reads_left:         # a split read is ready when both parts are
            self.sched.read_done(rec.rid)
            self._ready(rec)
        if node.rq:
            self._next_read(node)

    def _ready(self, rec: Req) -> None:
        rec.t_ready = self.loop.now
        pe = rec.pe
        pe.batcher.add(rec.rid, rec.hit, rec.new)
        if not pe.unit.busy:
            self.prefill.start(pe.unit)

    # ------------------------------------------------------------------ hand-off and decode
    def prefill_done(self, rec: Req) -> None:
        now = self.loop.now
        rec.t_prefill = now
        self.sched.prefill_done(rec.rid)
        if self.io:
            rec.de.h2d(rec)
        else:
            rec.de.join(rec)

    def decode_done(self, rec: Req, de: DEGpu) -> None:
        if self.io:
            stored = (rec.prompt + rec.gen) // self.bt * self.bt
            wb = (stored - rec.hit) * self.bpt
            if wb > 0:
                if self.fast_wb:         # tiny next to the reads: counted, not contended
                    for link, w in de.wb_links:
                        link.bytes += 2.0 * w * wb
                else:
                    self.net.start(de.wb_links, 2.0 * wb, self._complete, rec)
                    return
        self._complete(rec)

    def _complete(self, rec: Req) -> None:
        now = self.loop.now
        self.sched.complete(rec.rid)
        del self.reqs[rec.rid]
        self.requests_done += 1
        self.tokens_prompt += rec.prompt
        self.tokens_gen += rec.gen
        ttft = rec.t_prefill - rec.t_submit
        self.ttft.add(ttft)
        self.ttst.add(rec.t_second - rec.t_submit)
        tpot = (now - rec.t_join) / (rec.gen - 1) if rec.gen > 1 else 0.0
        if rec.gen > 1:
            self.tpot.add(tpot)
        b = self.breakdown
        b[0] += rec.t_bound - rec.t_submit
        b[1] += rec.t_assign - rec.t_bound
        b[2] += rec.t_ready - rec.t_assign
        b[3] += rec.t_prefill - rec.t_ready
        if self.online:
            q = int(4.0 * rec.t_submit / self.span)
            if q < 4:
                self.quarters[q][0] += ttft
                self.quarters[q][1] += 1
            lo, hi = self.ss_window
            if lo <= rec.t_submit <= hi:
                self.ttft_ss.add(ttft)
                if rec.gen > 1:
                    self.tpot_ss.add(tpot)
        agent = rec.agent
        delay = agent.delay                # the client's think time before its next request
        if agent.due - now > delay:        # trace arrivals: the turn's recorded time
            delay = agent.due - now
        if delay > 0.0:
            self.loop.after(delay, self._next_turn, agent)
        else:
            self._next_turn(agent)

    def note_attn(self, ratio: float) -> None:
        w = self.attn_windows.get(k := int(self.loop.now / self.cfg.sim.window_s))
        if w is None:
            self.attn_windows[k] = [ratio, 1.0]
        else:
            w[0] += ratio
            w[1] += 1.0

    # ------------------------------------------------------------------ run
    def _window(self, _) -> None:
        self.windows.sample(self.loop.now)
        self.loop.after(self.cfg.sim.window_s, self._window)

    def start(self) -> None:
        """Put the agents (offline: all at t = 0; online: the first arrival) on the event loop."""
        loop = self.loop
        loop.at(self.cfg.sim.window_s, self._window)
        if self.online:
            # Steady state is judged on turns submitted in the last quarter of the arrival span
            # (paper §7.2 stops at a steady TTFT; here the span is fixed, so a system that cannot
            # keep up shows a TTFT that still grows from quarter to quarter).
            loop.at(0.0, self._arrivals, 0)
            # a trace's own arrival times (--arrivals trace) span what they span
            span = float(getattr(self.workload, "arrival_span", 0.0))
            self.span = span = span if span > 0.0 else self.n_roots / self.aps
            self.ss_window = (0.75 * span, span)
        else:
            for aid in range(self.n_roots):
                self._start_agent(self.workload.make_agent(aid))

    def run(self, until: float = math.inf) -> dict:
        """Simulate to the last agent's last turn (or ``until``) and return the results."""
        n = self.n_agents
        loop = self.loop
        t0 = time.perf_counter()
        # A run makes no reference cycles (everything it drops is freed by reference counting;
        # tests/test_sim_cluster.py checks it), so the cyclic collector only re-scans the live
        # objects — ~10^6 at 48K agents, ~6 % of the run — and is off while it runs.
        gc_on = gc.isenabled()
        gc.disable()
        try:
            self.start()
            loop.run(until)
        finally:
            if gc_on:
                gc.enable()
        self.wall_s = time.perf_counter() - t0
        if self.agents_done < n and loop.now < until:
            raise RuntimeError(f"simulation stalled at t={loop.now:.3f}s with {self.agents_done}/{n} "
                               f"agents done and {len(self.reqs)} requests in flight")
        return self.results()

    def results(self) -> dict:
        from .report import results as _results
        return _results(self)
