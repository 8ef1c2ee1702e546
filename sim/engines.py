"""Prefill units and decode engines of the simulated cluster (paper §2.2, §2.4–2.7, §5.6).

**Prefill.** Every PE owns a ``PrefillBatcher`` from ``services.compute_model.batching`` (the live
service's code). A *unit* runs forward passes: all PEs of a node together when the model uses DP
attention + EP MoE (``model.ep_sync``; the group waits for its slowest GPU's attention, then
shares the MoE work), else one PE alone. A step's compute time comes from the scheduler's cost
model: ``max_gpu Σ attention_s + Σ linear / n_gpus × batch-efficiency``, times ``time_scale``.

Hops of one forward step (paper Fig. 4), per item of the batch:

* load of the cached KV into PE HBM, per layer — PE read path: PE buffer → PE CNIC (read) →
  PE HBM (CNIC write, loopback); DE read path: DE buffer → DE CNIC (read) → PE CNIC (write);
* output, per layer — PE path: hit (first chunk only) + new KV; DE path: only the new KV;
  PE CNIC (read) → DE CNIC (write) → DE buffer (DRAM).

Timing modes:

* whole-prompt (``basic``): load everything, compute, send everything, one after the other;
* layer-wise, exact (``sim.exact_layers``): one flow per layer and hop; layer ``l`` computes when
  its load has arrived and layer ``l-1`` is done, layer ``l`` is loaded once layer
  ``l-1-prefetch`` has been computed (prefetch depth), outputs leave as each layer finishes;
* layer-wise, aggregated (default): one multi-source load flow and one output flow per step,
  paced at the compute rate (a load cannot run further ahead than the prefetch depth); the step
  ends at the two-stage pipeline time ``T_load/L + C/L + (L−1)/L · max(T_load, C)``. The error
  against the exact mode is bounded by one layer's time (docs/simulator.md, tests).

All items of a step move in lock-step (a layer computes only when every item's layer is in), so a
step's load is one flow whose links carry each source's share of the bytes.

**Hand-off.** A DE copies each prompt's KV from its buffer into HBM through its CNIC (paper
§2.6), one copy at a time in arrival order (a FIFO like the node read queues: copies finish
earlier than under sharing, and bursts of hand-offs cost O(1) each to simulate).

**Decode.** A DE batches every request it holds (paper §2.6). Its step time is the cost model's
``decode_step_s(batch, context)``; between membership changes every member advances one token
per step, so the engine is a fluid server with a virtual-token clock and one completion event
per request instead of one event per token.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush
from collections import deque
from typing import TYPE_CHECKING

from services.compute_model.batching import PrefillBatcher

from .flows import Link, merge_links, normalized

if TYPE_CHECKING:
    from .cluster import Cluster, Node, Req

SIDE_PE, SIDE_DE, SIDE_NONE, SIDE_SPLIT = 0, 1, 2, 3
INF = math.inf


class PEGpu:
    __slots__ = ("engine_id", "node", "cnic_rd", "cnic_wr", "batcher", "unit", "self_links")

    def __init__(self, engine_id: str, node: Node, cnic_cap: float, batcher: PrefillBatcher) -> None:
        self.engine_id = engine_id
        self.node = node
        self.cnic_rd = Link(f"{engine_id}/cnic_rd", cnic_cap)
        self.cnic_wr = Link(f"{engine_id}/cnic_wr", cnic_cap)
        self.batcher = batcher
        self.unit: PEUnit | None = None
        # PE read path, PE buffer → PE HBM: DRAM read, CNIC DMA-read, CNIC DMA-write (loopback)
        self.self_links = (node.dram, self.cnic_rd, self.cnic_wr)


class PEUnit:
    """PEs that run forward passes together (a node's EP group, or one PE)."""

    __slots__ = ("gpus", "busy", "steps")

    def __init__(self, gpus: list[PEGpu]) -> None:
        self.gpus = gpus
        self.busy = False
        self.steps = 0
        for g in gpus:
            g.unit = self


class Step:
    __slots__ = ("unit", "items", "t0", "C", "lb", "ob", "load_links", "out_links", "compute_done",
                 "out_done", "loaded", "computed", "next_load", "loading", "computing", "outs_left")

    def __init__(self, unit: PEUnit, items: list, t0: float, C: float, lb: float, ob: float,
                 load_links: tuple, out_links: tuple) -> None:
        self.unit = unit
        self.items = items
        self.t0 = t0
        self.C = C
        self.lb = lb
        self.ob = ob
        self.load_links = load_links
        self.out_links = out_links
        self.compute_done = False
        self.out_done = ob <= 0.0
        self.loaded = self.computed = self.next_load = self.outs_left = 0
        self.loading = self.computing = False


class Prefill:
    """Runs the units' forward steps for a cluster (see the module docstring)."""

    def __init__(self, cl: Cluster) -> None:
        self.cl = cl
        cfg = cl.cfg
        cost = cfg.cost
        self.loop = cl.loop
        self.net = cl.net
        self.ts = cfg.sim.time_scale
        self.attn = cost.attention_fn()
        self.quota = cl.spec.quota         # then the batcher's predicted_s is Σ attention_s × ts
        self.lin_per_tok = 2.0 * cost.linear_params / cost.linear_flops_per_s
        self.eff_k = cfg.model.batch_eff_tokens
        self.L = cl.L
        self.bpt = cl.bpt
        self.io = not cl.spec.oracle
        self.layerwise = cl.spec.layerwise
        self.exact = cl.exact
        self.prefetch = cfg.engine.prefetch_layers
        self.ep_steps = 0
        self.attn_ratio_sum = 0.0
        self.busy_s = 0.0                  # Σ step compute time over units (PE compute share)

    # ------------------------------------------------------------------ one step
    def start(self, unit: PEUnit) -> None:
        reqs = self.cl.reqs
        attn_fn, bpt, io, quota, ts = self.attn, self.bpt, self.io, self.quota, self.ts
        items = []
        lw: dict[Link, float] = {}
        ow: dict[Link, float] = {}
        lb = ob = 0.0
        attn_max = attn_sum = 0.0
        new_total = 0
        for gpu in unit.gpus:
            fb = gpu.batcher.next_batch()
            if fb is None:
                continue
            attn = fb.predicted_s / ts if quota else 0.0
            for it in fb.items:
                rec = reqs[it.request_id]
                if not quota:
                    attn += attn_fn(it.cached, it.new)
                new_total += it.new
                if io:                 # three links per hop, unrolled (the hot loop at scale)
                    de = rec.de
                    b = it.cached * bpt
                    side = rec.side
                    if b:
                        lb += b
                        if side == SIDE_SPLIT:  # the DE's leading part remote, the rest local
                            bd = b * rec.split / rec.hit
                            l1, l2, l3 = gpu.self_links
                            lw[l1] = lw.get(l1, 0.0) + (b - bd)
                            lw[l2] = lw.get(l2, 0.0) + (b - bd)
                            lw[l3] = lw.get(l3, 0.0) + (b - bd)
                            src = de._remote.get(gpu)
                            l1, l2, l3 = src if src is not None else de.remote_src(gpu)
                            lw[l1] = lw.get(l1, 0.0) + bd
                            lw[l2] = lw.get(l2, 0.0) + bd
                            lw[l3] = lw.get(l3, 0.0) + bd
                        else:
                            if side == SIDE_PE:
                                l1, l2, l3 = gpu.self_links
                            else:
                                src = de._remote.get(gpu)
                                l1, l2, l3 = src if src is not None else de.remote_src(gpu)
                            lw[l1] = lw.get(l1, 0.0) + b
                            lw[l2] = lw.get(l2, 0.0) + b
                            lw[l3] = lw.get(l3, 0.0) + b
                    # what the DE lacks goes back with the new tokens: the whole hit on the PE
                    # path, the PE's part on a split read
                    o = it.new
                    if rec.first:
                        if side == SIDE_PE:
                            o += rec.hit
                        elif side == SIDE_SPLIT:
                            o += rec.hit - rec.split
                    o *= bpt
                    l1, l2, l3 = gpu.cnic_rd, de.cnic_wr, de.node.dram
                    ow[l1] = ow.get(l1, 0.0) + o
                    ow[l2] = ow.get(l2, 0.0) + o
                    ow[l3] = ow.get(l3, 0.0) + o
                    ob += o
                rec.first = False
                items.append((rec, it.last))
            attn_sum += attn
            if attn > attn_max:
                attn_max = attn
        if not items:
            unit.busy = False
            return
        unit.busy = True
        unit.steps += 1
        n = len(unit.gpus)
        if n > 1 and attn_sum > 0.0:
            self.ep_steps += 1
            self.attn_ratio_sum += attn_max * n / attn_sum
            self.cl.note_attn(attn_max * n / attn_sum)
        per_gpu = new_total / n
        lin = self.lin_per_tok * per_gpu
        if self.eff_k > 0.0:
            lin /= -math.expm1(-per_gpu / self.eff_k)
        C = (attn_max + lin) * self.ts
        self.busy_s += C
        load_links, lb = normalized(lw) if lb else ((), 0.0)
        out_links, ob = normalized(ow) if ob else ((), 0.0)
        st = Step(unit, items, self.loop.now, C, lb, ob, load_links, out_links)
        if not io or (lb <= 0.0 and ob <= 0.0):
            self.loop.after(C, self._compute_end, st)
        elif not self.layerwise:
            self.net.start(load_links, lb, self._whole_loaded, st)
        elif self.exact:
            self._layer_load(st)
            self._layer_compute(st)
        else:
            self._aggregated(st)

    # ------------------------------------------------------------------ whole-prompt (basic)
    def _whole_loaded(self, st: Step) -> None:
        self.loop.after(st.C, self._whole_computed, st)

    def _whole_computed(self, st: Step) -> None:
        self.net.start(st.out_links, st.ob, self._whole_sent, st)

    def _whole_sent(self, st: Step) -> None:
        st.compute_done = st.out_done = True
        self._finish(st)
        self._free(st.unit)

    # ------------------------------------------------------------------ layer-wise, aggregated
    def _aggregated(self, st: Step) -> None:
        C = st.C
        if st.ob > 0.0:
            self.net.start(st.out_links, st.ob, self._out_sent, st, cap=st.ob / C, stream=True)
        if st.lb > 0.0:
            self.net.start(st.load_links, st.lb, self._agg_loaded, st, cap=st.lb / C, stream=True)
        else:
            self.loop.after(C, self._compute_end, st)

    def _agg_loaded(self, st: Step) -> None:
        L, C = self.L, st.C
        t_load = self.loop.now - st.t0
        end = st.t0 + (t_load + C) / L + (L - 1) / L * (t_load if t_load > C else C)
        self.loop.at(end, self._compute_end, st)

    def _out_sent(self, st: Step) -> None:
        st.out_done = True
        if st.compute_done:
            self._finish(st)

    def _compute_end(self, st: Step) -> None:
        st.compute_done = True
        if st.out_done:
            self._finish(st)
        self._free(st.unit)

    # ------------------------------------------------------------------ layer-wise, exact
    def _layer_load(self, st: Step) -> None:
        if st.lb <= 0.0:
            st.loaded = st.next_load = self.L
            return
        layer = st.next_load
        if st.loading or layer >= self.L or layer - self.prefetch - 1 >= st.computed:
            return
        st.loading = True
        st.next_load = layer + 1
        self.net.start(st.load_links, st.lb / self.L, self._layer_loaded, st, stream=True)

    def _layer_loaded(self, st: Step) -> None:
        st.loading = False
        st.loaded += 1
        self._layer_compute(st)
        self._layer_load(st)

    def _layer_compute(self, st: Step) -> None:
        if not st.computing and st.computed < st.loaded:
            st.computing = True
            self.loop.after(st.C / self.L, self._layer_computed, st)

    def _layer_computed(self, st: Step) -> None:
        st.computing = False
        st.computed += 1
        if st.ob > 0.0:
            st.outs_left += 1
            self.net.start(st.out_links, st.ob / self.L, self._layer_sent, st, stream=True)
        if st.computed == self.L:
            st.compute_done = True
            st.out_done = st.outs_left == 0
            if st.out_done:
                self._finish(st)
            self._free(st.unit)
            return
        self._layer_compute(st)
        self._layer_load(st)

    def _layer_sent(self, st: Step) -> None:
        st.outs_left -= 1
        if st.compute_done and st.outs_left == 0:
            st.out_done = True
            self._finish(st)

    # ------------------------------------------------------------------ common
    def _finish(self, st: Step) -> None:
        done = self.cl.prefill_done
        for rec, last in st.items:
            if last:
                done(rec)

    def _free(self, unit: PEUnit) -> None:
        unit.busy = False
        for g in unit.gpus:
            if len(g.batcher):
                self.start(unit)
                return


class DEGpu:
    """A decode engine: fluid decode of its whole batch, H2D in, write-back out."""

    __slots__ = ("engine_id", "node", "cnic_rd", "cnic_wr", "h2d_links", "wb_links", "cl", "loop",
                 "V", "tV", "step", "heap", "n", "sp", "svj", "due", "seq", "dc", "ts",
                 "_remote", "h2d_q", "h2d_busy", "ev", "_fire_cb", "_h2d_cb")

    def __init__(self, engine_id: str, node: Node, cnic_cap: float, cl: Cluster) -> None:
        self.engine_id = engine_id
        self.node = node
        self.cnic_rd = Link(f"{engine_id}/cnic_rd", cnic_cap)
        self.cnic_wr = Link(f"{engine_id}/cnic_wr", cnic_cap)
        # H2D of the prompt KV: DE buffer (DRAM read) → DE CNIC (DMA read) → DE HBM (DMA write)
        self.h2d_links = merge_links(((node.dram, 1.0), (self.cnic_rd, 1.0), (self.cnic_wr, 1.0)))
        # write-back of new full blocks: D2H (CNIC read + write, DRAM write), DRAM read → SNIC;
        # normalised to the DRAM, which carries the bytes twice (flow size = 2 × bytes)
        self.wb_links = ((self.cnic_rd, 0.5), (self.cnic_wr, 0.5), (node.dram, 1.0),
                         (node.snic_wr, 0.5))
        self.cl = cl
        self.loop = cl.loop
        cost = cl.cfg.cost
        self.dc = (cost.decode_base_s, cost.decode_s_per_seq, cost.decode_s_per_ctx_token)
        self.ts = cl.cfg.sim.time_scale
        self.V = 0.0          # tokens every member has decoded since the engine started (virtual clock)
        self.tV = 0.0
        self.step = 0.0
        self.heap: list = []
        self.n = 0
        self.sp = 0           # Σ prompt tokens of members
        self.svj = 0.0        # Σ V at join of members
        self.due = math.inf
        self.ev = math.inf    # time of the pending completion event (≤ due; re-armed when early)
        self.seq = 0
        self._remote: dict = {}
        self.h2d_q: deque = deque()
        self.h2d_busy = False
        self._fire_cb = self._fire           # bound once: events and flows reuse them
        self._h2d_cb = self._h2d_done

    def remote_src(self, pe: PEGpu) -> tuple[Link, Link, Link]:
        """DE read path, DE buffer → PE HBM: DRAM read, this DE's CNIC (read), the PE's CNIC (write)."""
        t = self._remote.get(pe)
        if t is None:
            t = self._remote[pe] = (self.node.dram, self.cnic_rd, pe.cnic_wr)
        return t

    def h2d(self, rec: Req) -> None:
        """Queue the hand-off copy; the DE's copies run one at a time at the CNIC's rate (FIFO)."""
        if self.h2d_busy:
            self.h2d_q.append(rec)
        else:
            self.h2d_busy = True
            self.cl.net.start(self.h2d_links, rec.prompt * self.cl.bpt, self._h2d_cb, rec)

    def _h2d_done(self, rec: Req) -> None:
        if self.h2d_q:
            nxt = self.h2d_q.popleft()
            self.cl.net.start(self.h2d_links, nxt.prompt * self.cl.bpt, self._h2d_cb, nxt)
        else:
            self.h2d_busy = False
        self.join(rec)

    def join(self, rec: Req) -> None:
        """The prompt KV is in HBM: decode ``gen − 1`` tokens (the PE produced the first)."""
        now = self.loop.now
        rec.t_join = now
        if rec.gen <= 1:
            rec.t_second = now
            self.cl.decode_done(rec, self)
            return
        if self.n:
            self.V += (now - self.tV) / self.step
        self.tV = now
        V = self.V
        self.seq += 1
        heappush(self.heap, (V + rec.gen - 1, self.seq, rec))
        self.n += 1
        self.sp += rec.prompt
        self.svj += V
        self._reschedule(now)
        rec.t_second = now + self.step

    def _reschedule(self, now: float) -> None:
        n = self.n
        ctx = self.sp + n * self.V - self.svj
        c = self.dc                # = cost.decode_step_s(n, ctx) (n > 0 here), inlined
        self.step = (c[0] + n * c[1] + ctx * c[2]) * self.ts
        self.due = due = now + (self.heap[0][0] - self.V) * self.step
        if due < self.ev:        # a later due keeps the pending event, which re-arms itself
            self.ev = due
            loop = self.loop
            t = due if due > now else now
            lst = loop.pending.get(t)           # = loop.at(t, self._fire, due), inlined
            if lst is None:
                loop.pending[t] = [self._fire_cb, due]
                heappush(loop.heap, t)
            else:
                lst.append(self._fire_cb)
                lst.append(due)

    def _fire(self, t: float) -> None:
        if t != self.ev:
            return               # superseded by an earlier event
        self.ev = INF
        now = self.loop.now
        if now < self.due:
            self.ev = self.due
            self.loop.at(self.due, self._fire_cb, self.due)
            return
        self.V += (now - self.tV) / self.step
        self.tV = now
        heap = self.heap
        lim = self.V + 1e-6
        done = self.cl.decode_done
        while heap and heap[0][0] <= lim:
            vfin, _, rec = heappop(heap)
            self.n -= 1
            self.sp -= rec.prompt
            self.svj -= vfin - rec.gen + 1
            done(rec, self)
        if self.n:
            self._reschedule(now)
        else:
            self.svj = 0.0
            self.sp = 0
            self.due = INF
