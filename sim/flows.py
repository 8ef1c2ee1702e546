"""Flow-level bandwidth sharing: max-min fair rates over links, kept up to date incrementally.

A **link** is one capacity in bytes/s: a node's storage link (SNIC, one per direction), a GPU's
compute NIC (one per direction of its PCIe side: DMA reads, DMA writes) or a node's DRAM
(half-duplex: reads and writes share it). A **flow** moves a number of bytes across a set of
links; a link may carry it with a weight ≤ 1 (bytes on the link per byte of the flow, normalised
so the busiest link has weight 1, see ``normalized``): a lock-stepped multi-source layer load
puts each source's share on that source's links, a write-back puts its bytes on DRAM twice
(written, then read) and once on the NICs. A flow may also have a rate ``cap`` (pacing: a
layer-wise load cannot run further ahead of compute than its prefetch depth).

Two classes share every link ([inference], the traffic manager's policy): **stream** flows —
the per-layer KV transfers that a prefill forward pass waits on — are served first; **bulk**
flows — storage reads, whole-prompt copies, hand-off H2D, write-back — share what the streams
leave. Inside a class, rates are the weighted max-min fair allocation (progressive filling).
Streams are paced far below line rate inside the paper's no-bottleneck window, so there this is
what plain max-min gives too; the split keeps a line-rate bulk copy on one GPU's CNIC from
coupling every layer stream that crosses it (which made exact max-min cost O(cluster) per event
at 1,152 GPUs).

Rates are recomputed only when the flow set changes, and only where they can change:

1. Seed: the new flow, or the flows of its class on the links a finished flow leaves that were
   saturated and carry a flow at least as fast (only the fastest flow on a link can have it as
   its bottleneck).
2. Solve progressive filling for the working set F with every other flow of the class fixed.
3. Closure: (a) a link whose F-flows changed rate and that is saturated before or after pulls in
   its flows that are at least as fast as every F-flow there; (b) a link that froze F-flows at a
   level pulls in its flows faster than that level. Repeat 2–3 until nothing is added.
4. Stream changes re-seed the bulk flows of the links whose bulk capacity they changed.

Unsaturated links therefore cut the problem. The result equals a from-scratch solve
(``solve_maxmin``; checked on random networks by ``tests/test_sim_flows.py``). Each link
integrates its rate over time (``bytes_at``) for utilisation accounting.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Any, Callable, Iterable, Sequence

from .events import EventLoop

INF = float("inf")
TOL = 1e-9                # a link within TOL × capacity of its limit is saturated
SAME = 1e-12              # relative rate change treated as no change
STREAM, BULK = 0, 1


class Link:
    """One capacity (bytes/s), the flows crossing it per class, its integrated byte count.

    Per class (stream ``s``, bulk ``b``): the flows crossing it (flow -> weight) and Σ
    weight·rate. Plain attributes rather than a pair of containers: at 1,152 GPUs most links
    are cold in the CPU cache when a flow touches them, and every container is one more miss.
    """

    __slots__ = ("name", "cap", "sf", "bf", "st", "bt", "bytes", "t")

    def __init__(self, name: str, cap: float) -> None:
        if cap <= 0:
            raise ValueError(f"link {name}: capacity must be positive, got {cap}")
        self.name = name
        self.cap = float(cap)
        self.sf: dict[Flow, float] = {}        # stream flows -> weight
        self.bf: dict[Flow, float] = {}        # bulk flows -> weight
        self.st = 0.0                           # Σ weight·rate of the streams
        self.bt = 0.0                           # Σ weight·rate of the bulk flows
        self.bytes = 0.0                        # bytes carried up to time ``t``
        self.t = 0.0

    @property
    def total(self) -> float:
        return self.st + self.bt

    def tot(self, cls: int) -> float:
        return self.st if cls == STREAM else self.bt

    def avail(self, cls: int) -> float:
        """Capacity a class may use: all of it for streams, what streams leave for bulk."""
        if cls == STREAM:
            return self.cap
        a = self.cap - self.st
        return a if a > 0.0 else 0.0

    def bytes_at(self, now: float) -> float:
        return self.bytes + (self.st + self.bt) * (now - self.t)

    def __repr__(self) -> str:
        return (f"Link({self.name}, {self.total:.4g}/{self.cap:.4g} B/s, "
                f"{len(self.sf)}+{len(self.bf)} flows)")


class Flow:
    """``size`` bytes over weighted links; ``fn(arg)`` runs when the last byte arrives."""

    __slots__ = ("links", "cap", "size", "remaining", "rate", "t", "due", "fn", "arg", "active",
                 "cls")

    def __init__(self, links: tuple[tuple[Link, float], ...], size: float, cap: float | None,
                 fn: Callable[[Any], None] | None, arg: Any, now: float, cls: int) -> None:
        self.links = links
        self.cap = cap
        self.size = size
        self.remaining = size
        self.rate = 0.0
        self.t = now
        self.due = INF
        self.fn = fn
        self.arg = arg
        self.active = True
        self.cls = cls


def merge_links(pairs: Iterable[tuple[Link, float]]) -> tuple[tuple[Link, float], ...]:
    """Sum the weights of repeated links (order of first appearance kept)."""
    acc: dict[Link, float] = {}
    for link, w in pairs:
        if w > 0:
            acc[link] = acc.get(link, 0.0) + w
    return tuple(acc.items())


def normalized(byte_map: dict[Link, float]) -> tuple[tuple[tuple[Link, float], ...], float]:
    """Links and size of a flow carrying ``byte_map[link]`` bytes over each link.

    The size is the load of the busiest link and the weights are ≤ 1, so a flow's *rate* is the
    rate on its busiest link. Fairness then compares what flows put on their busiest links, which
    is what an aggregate of per-source sub-flows gets (a lock-stepped multi-source load is not
    "faster" than a single-source one because it spreads over many links).
    """
    size = max(byte_map.values())
    return tuple([(link, b / size) for link, b in byte_map.items()]), size


class FlowNet:
    """The set of active flows on an event loop; see the module docstring."""

    __slots__ = ("loop", "started", "resolves", "widened", "_bulk_seeds", "_bulk_links", "_done_cb")

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.started = 0
        self.resolves = 0
        self.widened = 0          # closure iterations that grew a working set (diagnostics)
        self._bulk_seeds: dict[Flow, None] = {}
        self._bulk_links: list[Link] = []
        # one bound method for every completion event (binding per event allocates an object)
        self._done_cb = self._done

    # ------------------------------------------------------------------ public
    def start(self, links: tuple[tuple[Link, float], ...], size: float,
              fn: Callable[[Any], None] | None, arg: Any = None, cap: float | None = None,
              stream: bool = False) -> Flow:
        """Start moving ``size`` bytes; ``links`` must already be merged (see ``merge_links``)."""
        loop = self.loop
        now = loop.now
        c = STREAM if stream else BULK
        f = Flow(links, float(size), cap, fn, arg, now, c)
        self.started += 1
        if size <= 0 or not links:
            f.active = False
            f.due = now
            if fn is not None:
                loop.at(now, fn, arg)
            return f
        # Fast path: the new flow takes the greedy rate (the least residual along its links) and
        # nobody else moves — unless a link it shares is, or becomes, saturated while carrying a
        # flow at least as fast (closure rule (a) of ``_resolve``), which needs the full solve.
        # ``trig``: the least rate at which the new flow would saturate (or finds saturated) a
        # link it shares — ``tot + w·rate >= sat`` below — so the per-link check only runs
        # when the flow's rate reaches it (a paced stream's never does): one pass, not two.
        best = INF if cap is None else cap
        trig = INF
        if stream:                  # a stream may use the whole link (cap > 0)
            for link, w in links:
                flows = link.sf
                cl = link.cap
                t = link.st
                if flows:
                    m = (cl - TOL * cl - t) / w
                    if m < trig:
                        trig = m
                flows[f] = w
                v = (cl - t) / w
                if v < best:
                    best = v
        else:                       # bulk: what the streams leave
            for link, w in links:
                flows = link.bf
                cl = link.cap
                a = cl - link.st
                t = link.bt
                if flows:
                    m = ((a if a > 0.0 else 0.0) - TOL * cl - t) / w
                    if m < trig:
                        trig = m
                flows[f] = w
                v = (a - t) / w
                if v < best:
                    best = v
        if best < 0.0:
            best = 0.0
        if best * (1.0 + 1e-9) + 1e-300 >= trig:
            lim = best * (1.0 - 1e-9)
            for link, w in links:
                flows = link.sf if stream else link.bf
                if len(flows) > 1:
                    cl = link.cap
                    a = link.avail(c)
                    sat = a - TOL * cl
                    t = link.st if stream else link.bt
                    if t >= sat or t + w * best >= sat:
                        for g in flows:
                            if g.rate >= lim and g is not f:
                                self._resolve({f: None}, [lw[0] for lw in links], f, c)
                                if self._bulk_seeds:
                                    self._flush_bulk()
                                return f
        if stream:
            for link, w in links:
                lt = link.t
                if lt != now:
                    link.bytes += (link.st + link.bt) * (now - lt)
                    link.t = now
                if link.bf:
                    before = link.st
                    link.st = before + w * best
                    self._bulk_changed(link, before, w * best)
                else:
                    link.st += w * best
        else:
            for link, w in links:
                lt = link.t
                if lt != now:
                    link.bytes += (link.st + link.bt) * (now - lt)
                    link.t = now
                link.bt += w * best
        f.rate = best
        if best > 0.0:
            f.due = due = now + f.remaining / best
            lst = loop.pending.get(due)         # = loop.at(due, self._done, f), inlined
            if lst is None:
                loop.pending[due] = [self._done_cb, f]
                heappush(loop.heap, due)
            else:
                lst.append(self._done_cb)
                lst.append(f)
        if self._bulk_seeds:
            self._flush_bulk()
        return f

    def cancel(self, f: Flow) -> None:
        """Stop a flow early (its callback does not run)."""
        if f.active:
            self._remove(f)

    # ------------------------------------------------------------------ internals
    def _done(self, f: Flow) -> None:
        if not f.active or f.due != self.loop.now:
            return                               # stale: the flow's rate changed since
        self._remove(f)
        if f.fn is not None:
            f.fn(f.arg)

    def _remove(self, f: Flow) -> None:
        now = self.loop.now
        f.active = False
        c = f.cls
        r = f.rate
        lim = r * (1.0 - 1e-9)
        seeds: dict[Flow, None] | None = None
        seed_links = []
        for link, w in f.links:
            lt = link.t
            if lt != now:
                link.bytes += (link.st + link.bt) * (now - lt)
                link.t = now
            if c == 0:
                flows = link.sf
                before = link.st
                del flows[f]
                if flows:
                    link.st = before - w * r
                    cl = link.cap
                    if before >= cl - TOL * cl:
                        seed_links.append(link)
                        for g in flows:
                            if g.rate >= lim:
                                if seeds is None:
                                    seeds = {}
                                seeds[g] = None
                else:
                    link.st = 0.0
                if link.bf:
                    self._bulk_changed(link, before, -w * r)
            else:
                flows = link.bf
                before = link.bt
                del flows[f]
                if flows:
                    link.bt = before - w * r
                    cl = link.cap
                    if before >= cl - link.st - TOL * cl:
                        seed_links.append(link)
                        for g in flows:
                            if g.rate >= lim:
                                if seeds is None:
                                    seeds = {}
                                seeds[g] = None
                else:
                    link.bt = 0.0
        f.rate = 0.0
        if seeds:
            self._resolve(seeds, seed_links, None, c)
        if self._bulk_seeds:
            self._flush_bulk()

    def _bulk_changed(self, link: Link, stream_before: float, delta: float) -> None:
        """Streams on ``link`` changed by ``delta``: re-seed its bulk flows if that matters."""
        bulk = link.bf
        if not bulk or delta == 0.0:
            return
        cap_before = link.cap - stream_before
        tol = TOL * link.cap
        if delta > 0.0:
            hit = link.bt > cap_before - delta + tol       # bulk no longer fits
        else:
            hit = link.bt >= cap_before - tol              # bulk was held here
        if hit:
            self._bulk_links.append(link)
            for g in bulk:
                self._bulk_seeds[g] = None

    def _flush_bulk(self) -> None:
        while self._bulk_seeds:
            seeds, links = self._bulk_seeds, self._bulk_links
            self._bulk_seeds, self._bulk_links = {}, []
            self._resolve(seeds, links, None, BULK)

    def _resolve(self, F: dict[Flow, None], seed_links: list[Link], new: Flow | None, c: int) -> None:
        self.resolves += 1
        check = seed_links
        while True:
            rates, frozen_by = _fill(F, c)
            grew = False
            # (a) a link whose F-flows changed rate and that is saturated before or after: an
            #     outside flow there may have lost or gained its bottleneck — unless some F-flow
            #     on the link is faster than it both before and after (then the link was never
            #     its bottleneck: the bottleneck flow is the fastest on its link).
            delta: dict[Link, float] = {}
            thr: dict[Link, float] = {}
            for f, r in rates.items():
                old = f.rate
                d = r - old
                key = r if f is new or r < old else old
                changed = d > SAME * r or -d > SAME * old
                for link, w in f.links:
                    if changed:
                        delta[link] = delta.get(link, 0.0) + w * d
                    if key > thr.get(link, -1.0):
                        thr[link] = key
            for link in check:
                delta.setdefault(link, 0.0)
            for link, d in delta.items():
                flows = link.sf if c == 0 else link.bf
                if len(flows) == 1:
                    continue
                tot = link.st if c == 0 else link.bt
                sat = link.avail(c) - TOL * link.cap
                if tot >= sat or tot + d >= sat:
                    lim = thr.get(link, 0.0) * (1.0 - 1e-9)
                    for g in flows:
                        if g.rate >= lim and g not in F:
                            F[g] = None
                            grew = True
            # (b) an F-flow's new bottleneck carries an outside flow above its level: max-min
            #     needs that flow to give way, so it joins F.
            for link, level in frozen_by:
                flows = link.sf if c == 0 else link.bf
                if len(flows) == 1:
                    continue
                lim = level * (1.0 + 1e-9) + 1e-300
                for g in flows:
                    if g.rate > lim and g not in F:
                        F[g] = None
                        grew = True
            if not grew:
                break
            self.widened += 1
            check = []
        self._apply(rates, c)

    def _apply(self, rates: dict[Flow, float], c: int) -> None:
        loop = self.loop
        now = loop.now
        heap, pending = loop.heap, loop.pending
        done = self._done_cb
        for f, r in rates.items():
            old = f.rate
            d = r - old
            if not (d > SAME * r or -d > SAME * old):
                if old == 0.0 and r == 0.0 and f.due == INF:
                    continue
                if f.due != INF:
                    continue
            f.remaining -= old * (now - f.t)
            f.t = now
            f.rate = r
            for link, w in f.links:
                lt = link.t
                if lt != now:
                    link.bytes += (link.st + link.bt) * (now - lt)
                    link.t = now
                if c == 0:
                    before = link.st
                    link.st = before + w * d
                    if link.bf:
                        self._bulk_changed(link, before, w * d)
                else:
                    link.bt += w * d
            if r > 0.0:
                rem = f.remaining
                f.due = due = now + (rem if rem > 0.0 else 0.0) / r
                lst = pending.get(due)
                if lst is None:
                    pending[due] = [done, f]
                    heappush(heap, due)
                else:
                    lst.append(done)
                    lst.append(f)
            else:
                f.due = INF


def _fill(F: dict[Flow, None], c: int) -> tuple[dict[Flow, float], list[tuple[Link, float]]]:
    """Weighted progressive filling of the class-``c`` flows in ``F``; all other flows keep their
    rates. Returns the rates and, for every group frozen by a link, ``(link, level)``."""
    if len(F) == 1:
        (f,) = F
        best = INF if f.cap is None else f.cap
        by = None
        r0 = f.rate
        for link, w in f.links:
            v = (link.avail(c) - link.tot(c) + w * r0) / w
            if v < best:
                best = v
                by = link
        if best < 0.0:
            best = 0.0
        return {f: best}, ([(by, best)] if by is not None else [])
    res: dict[Link, float] = {}
    wsum: dict[Link, float] = {}
    cnt: dict[Link, int] = {}
    capped = []
    for f in F:
        r0 = f.rate
        if f.cap is not None:
            capped.append(f)
        for link, w in f.links:
            if link in res:
                res[link] += w * r0
                wsum[link] += w
                cnt[link] += 1
            else:
                res[link] = link.avail(c) - link.tot(c) + w * r0
                wsum[link] = w
                cnt[link] = 1
    # Lazy heap of link shares res/wsum: freezing flows at the current (minimal) level only
    # raises the shares of their links, so an entry whose share differs from ``cur`` is stale.
    cur = {link: res[link] / ws for link, ws in wsum.items()}
    order = {link: i for i, link in enumerate(cur)}
    heap = [(v, order[link], link) for link, v in cur.items()]
    heapify(heap)
    capped.sort(key=_cap_key)
    ci = 0
    active = dict.fromkeys(F)
    rates: dict[Flow, float] = {}
    frozen_by: list[tuple[Link, float]] = []
    while active:
        while heap:
            v, _, link = heap[0]
            if cur.get(link) == v:
                break
            heappop(heap)
        bottleneck: Link | None = None
        level = INF
        if heap:
            level = heap[0][0]
            bottleneck = heap[0][2]
        while ci < len(capped) and capped[ci] not in active:
            ci += 1
        cap_flow: Flow | None = None
        if ci < len(capped):
            ccap = capped[ci].cap
            if ccap is not None and ccap < level:
                cap_flow = capped[ci]
                level = ccap
        if level < 0.0:
            level = 0.0
        if cap_flow is not None:
            freeze: Sequence[Flow] = (cap_flow,)
        else:
            assert bottleneck is not None
            freeze = [f for f in (bottleneck.sf if c == 0 else bottleneck.bf) if f in active]
            frozen_by.append((bottleneck, level))
        touched: dict[Link, None] = {}
        for f in freeze:
            del active[f]
            rates[f] = level
            for link, w in f.links:
                res[link] -= w * level
                k = cnt[link] - 1
                cnt[link] = k
                if k:
                    wsum[link] -= w
                    touched[link] = None
                else:
                    del wsum[link]
                    cur.pop(link, None)
                    touched.pop(link, None)
        for link in touched:
            v = res[link] / wsum[link]
            cur[link] = v
            heappush(heap, (v, order[link], link))
    return rates, frozen_by


def _cap_key(f: Flow) -> float:
    return INF if f.cap is None else f.cap


def solve_maxmin(flows: Sequence[Flow]) -> dict[Flow, float]:
    """Reference: rates of ``flows`` from scratch (for tests) — streams max-min fair on the full
    capacities, then bulk flows max-min fair on what the streams leave."""
    rates: dict[Flow, float] = {}
    left: dict[Link, float] = {}
    for f in flows:
        for link, _ in f.links:
            left[link] = link.cap
    for c in (STREAM, BULK):
        res = dict(left)
        active = [f for f in flows if f.cls == c]
        while active:
            level, pick = INF, []
            for link, cap in res.items():
                ws = sum(w for f in active for lk, w in f.links if lk is link)
                if ws > 0 and max(cap, 0.0) / ws < level - 1e-15:
                    level = max(cap, 0.0) / ws
                    pick = [f for f in active if any(lk is link for lk, _ in f.links)]
            for f in active:
                if f.cap is not None and f.cap < level:
                    level, pick = f.cap, [f]
            level = max(level, 0.0)
            for f in pick:
                rates[f] = level
                active.remove(f)
                for link, w in f.links:
                    res[link] -= w * level
        if c == STREAM:
            for link in left:
                left[link] = max(link.cap - sum(w * rates[f] for f in flows if f.cls == STREAM
                                                for lk, w in f.links if lk is link), 0.0)
    return rates
