"""Turn a replay's records and telemetry into the results JSON, checks and a summary table.

Definitions (paper §6.8, §7.4):

* **JCT** (offline): first submit → last finish of the whole batch of agents.
* **TTFT / TTST / TPOT**: from the scheduler's events; percentiles over finished requests.
  The **SLO** (TTFT ≤ 4 s, TPOT ≤ 50 ms, both × the cluster's ``slo_scale``) holds when the
  90th percentiles of both are within it; ``slo_attainment`` is the share of requests within both.
* **Storage-link utilisation** per node: bytes charged to its emulated SNIC's read direction per
  window ÷ rate (a half-duplex link: reads and write-backs, which share it).
* **SNIC max/avg**: per window, the busiest node's storage-link bytes ÷ the nodes' mean;
  averaged over the windows carrying at least 10 % of the peak window's traffic (the paper
  plots this in the busy phase only — an idle tail has no meaning, §7.4).
* **Bytes per path**: storage reads on prefill nodes (PE path) and on decode nodes (DE path),
  write-backs, KV sent PE→DE and DE→PE over the compute network.
* **Checks**: every request finished; reported hits equal the client's prediction; storage
  bytes read (the gateways' counters) equal Σ hit blocks × block bytes of each finished
  request's final attempt plus Σ the bytes each failed attempt read (the node services report
  them with the failure: a retry reads the hit again, since the failed attempt's buffer region
  is freed — docs/frontend-api.md, "Retried attempts re-read"); the emulated engines verified every
  prompt byte-for-byte with no mismatch.
* **Retried attempts**: failed attempts counted by ``hop/code`` (``retried_attempts``).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

import msgspec
import numpy as np

from .driver import RequestRecord
from .telemetry import Sampler

TTFT_SLO_S = 4.0
TPOT_SLO_S = 0.050


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    """Mean and nearest-rank percentiles of the values that are not ``None``.

    Nearest rank (numpy's ``inverted_cdf``): the smallest sample with at least p % of the
    samples at or below it, always a measured value, never an interpolation.
    """
    v = sorted(x for x in values if x is not None)
    out: dict[str, float | None] = {"mean": (sum(v) / len(v)) if v else None}
    qs = np.percentile(v, ps, method="inverted_cdf").tolist() if v else [None] * len(ps)
    out.update({f"p{p}": q for p, q in zip(ps, qs)})
    return out


def summarize(records: list[RequestRecord], sampler: Sampler | None, *, roles: dict[str, str],
              links: dict[str, float], bytes_per_token: int, block_tokens: int,
              slo_scale: float = 1.0, window_s: float = 0.5) -> dict[str, Any]:
    fin = [r for r in records if r.outcome == "finished"]
    out: dict[str, Any] = {"requests": len(records), "finished": len(fin),
                           "failed": len(records) - len(fin)}
    if records:
        start = min(r.submit_s for r in records)
        out["jct_s"] = max(r.end_s for r in records) - start
    out["failures"] = dict(Counter(r.code for r in records if r.outcome != "finished"))
    out["latency"] = {k: percentiles([getattr(r, f"{k}_s") for r in fin])
                      for k in ("ttft", "ttst", "tpot", "e2e", "sched", "alloc", "read",
                                "prefill")}
    out["slo"] = _slo(fin, slo_scale)
    out["tokens"] = _tokens(records, fin)
    out["read_sides"] = dict(Counter(r.read_side or "none" for r in fin))
    out["checks"] = _checks(records, fin)
    out["retried_attempts"] = failed_attempt_reasons(records)
    if sampler is not None:
        out["bytes"] = _bytes(sampler, roles)
        out["links"] = _links(sampler, roles, links, window_s)
        # counter samples lost per service (GetStats failed or timed out): the byte checks
        # read first/last snapshots, so a lost final sample would make them undercount
        out["telemetry_samples_missed"] = dict(sampler.missed)
        out["checks"].update(_byte_checks(records, fin, out["bytes"], bytes_per_token,
                                          block_tokens, sampler))
    return out


def _slo(fin: list[RequestRecord], scale: float) -> dict[str, Any]:
    ttft_max, tpot_max = TTFT_SLO_S * scale, TPOT_SLO_S * scale
    ttft = percentiles([r.ttft_s for r in fin])["p90"]
    tpot = percentiles([r.tpot_s for r in fin if r.tokens > 1])["p90"]
    ok = [r for r in fin if r.ttft_s is not None and r.ttft_s <= ttft_max
          and (r.tokens <= 1 or (r.tpot_s or 0) <= tpot_max)]
    return {"ttft_max_s": ttft_max, "tpot_max_s": tpot_max, "ttft_p90_s": ttft,
            "tpot_p90_s": tpot,
            "held": bool(fin) and ttft is not None and ttft <= ttft_max
            and (tpot is None or tpot <= tpot_max),
            "attainment": len(ok) / len(fin) if fin else 0.0}


def _tokens(records: list[RequestRecord], fin: list[RequestRecord]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in fin)
    hit = sum(r.hit_tokens or 0 for r in fin)
    return {"prompt": prompt, "hit": hit, "generated": sum(r.tokens for r in fin),
            "hit_rate": hit / prompt if prompt else 0.0,
            "sessions": len({r.session_id for r in records})}


def _checks(records: list[RequestRecord], fin: list[RequestRecord]) -> dict[str, Any]:
    predicted = [r for r in fin if r.expected_hit is not None]
    # a hit shorter than predicted by exactly what the cluster reported as lost (an earlier
    # turn's write-back died with its node: recomputed, correct) is explained, not a mismatch
    lost = [r for r in predicted if r.hit_shortfall_tokens > 0 and r.expected_hit is not None
            and r.hit_tokens == r.expected_hit - r.hit_shortfall_tokens]
    # a hit of 0 because the scheduler's lookup failed (it says so: hit_lookup_failed) is
    # explained too: the cluster computed the whole prompt, as designed for a slow index
    unlooked = [r for r in predicted if r.hit_lookup_failed and r.hit_tokens == 0
                and r.expected_hit]
    explained = {r.request_id for r in lost + unlooked}
    wrong = [r.request_id for r in predicted
             if r.hit_tokens != r.expected_hit and r.request_id not in explained]
    return {"all_finished": len(fin) == len(records) and bool(records),
            "hit_predicted": len(predicted), "hit_mismatches": len(wrong),
            "hit_mismatch_examples": wrong[:5],
            "hit_short_by_lost_writes": len(lost),
            "hit_zero_by_failed_lookup": len(unlooked),
            "turns_hitting_previous_write": sum(1 for r in predicted
                                                if r.turn > 0 and (r.hit_tokens or 0) > 0),
            "output_length_wrong": sum(1 for r in fin if r.output_ok is False)}


def failed_attempts(records: list[RequestRecord]) -> list[Any]:
    """Every attempt that did not finish (failed, re-planned, cancelled), of every request."""
    return [a for r in records for a in r.attempt_history if a.outcome != "finished"]


def failed_attempt_reasons(records: list[RequestRecord]) -> dict[str, int]:
    """Failed attempts by ``hop/code``, most frequent first."""
    c = Counter(f"{a.hop or '?'}/{a.code or '?'}" for a in failed_attempts(records)
                if a.outcome == "failed")
    return dict(c.most_common())


def _sum(sampler: Sampler, service: str, name: str, nodes: set[str] | None = None) -> float:
    total = 0.0
    for key in set(sampler.first) | set(sampler.last):
        svc, _, node = key.partition(":")
        if svc == service and (nodes is None or node in nodes):
            total += sampler.delta(key, name)
    return total


def _bytes(sampler: Sampler, roles: dict[str, str]) -> dict[str, float]:
    """Bytes per path, counted where they arrive (UCX receives; storage reads a gateway put
    straight into a node's shared-memory buffer, ``shm_bytes``, never cross its transport)."""
    p = {n for n, r in roles.items() if r == "prefill"}
    d = {n for n, r in roles.items() if r == "decode"}
    read_pe = _sum(sampler, "storage_gateway", "bytes_read", p)
    read_de = _sum(sampler, "storage_gateway", "bytes_read", d)
    ucx_pe = read_pe - _sum(sampler, "storage_gateway", "shm_bytes", p)
    ucx_de = read_de - _sum(sampler, "storage_gateway", "shm_bytes", d)
    pe_in = _sum(sampler, "pe_receiver", "transport_bytes_received")
    de_in = _sum(sampler, "de_loader", "transport_bytes_received")
    return {"storage_read_pe_path": read_pe, "storage_read_de_path": read_de,
            "storage_written": _sum(sampler, "storage_gateway", "bytes_written"),
            "pe_to_de": max(de_in - ucx_de, 0.0),
            "de_to_pe": max(pe_in - ucx_pe, 0.0),
            "writeback_sent": _sum(sampler, "storage_gateway", "transport_bytes_received", d)}


def _links(sampler: Sampler, roles: dict[str, str], rates: dict[str, float],
           window_s: float) -> dict[str, Any]:
    """Per-node storage-link bytes per window, utilisation, SNIC max/avg."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in sampler.samples:
        svc, _, node = s["key"].partition(":")
        if svc == "storage_gateway" and "link_bytes_charged" in s:
            # a full-duplex link's reads have their own direction at the rate: the write-backs
            # (stated apart) do not load it; a half-duplex link carries both
            series[node].append((s["t"], s["link_bytes_charged"]
                                 - s.get("link_write_bytes_charged", 0.0)))
    if not series:
        return {}
    end = max(t for pts in series.values() for t, _ in pts)
    n_win = max(1, math.ceil(end / window_s))
    per_node: dict[str, list[float]] = {}
    for node, pts in series.items():
        per_node[node] = [_interp(pts, (i + 1) * window_s) - _interp(pts, i * window_s)
                          for i in range(n_win)]
    nodes = sorted(per_node)
    totals = [sum(per_node[n][i] for n in nodes) for i in range(n_win)]
    peak = max(totals) if totals else 0.0
    ratios = []
    for i, tot in enumerate(totals):
        if peak > 0 and tot >= 0.1 * peak:
            ratios.append(max(per_node[n][i] for n in nodes) / (tot / len(nodes)))
    whole = {n: sum(per_node[n]) for n in nodes}
    mean_whole = sum(whole.values()) / len(nodes)
    util = {n: [b / window_s / rates[n] if rates.get(n) else None for b in per_node[n]]
            for n in nodes}
    return {"window_s": window_s, "nodes": nodes, "roles": {n: roles.get(n) for n in nodes},
            "bytes_per_window": per_node, "utilisation": util,
            "snic_max_avg": sum(ratios) / len(ratios) if ratios else None,
            "snic_max_avg_total": max(whole.values()) / mean_whole if mean_whole else None,
            "bytes_total": whole,
            "mean_utilisation": {n: (whole[n] / end / rates[n]) if rates.get(n) and end else None
                                 for n in nodes}}


def _interp(pts: list[tuple[float, float]], t: float) -> float:
    """Counter value at time ``t`` (linear between samples, flat outside)."""
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return pts[-1][1]


def _cut_off(a: Any) -> bool:
    """An attempt failed by the scheduler because a node stopped answering: that node never
    reported, so its partial storage read is unknown (the other node's ``dropped`` report may
    still have counted its own part)."""
    return a.outcome == "failed" and a.hop == "scheduler" and a.code == "PEER_FAILED"


_READS = ("pe", "de", "split")            # the read sides that read storage


def _held_by_de(r: RequestRecord) -> int:
    """Leading prompt tokens the DE held before the PE forwarded the rest."""
    hit = r.hit_tokens or 0
    return 0 if r.read_side == "pe" else min(r.split_tokens, hit) if r.read_side == "split" \
        else hit


def _byte_checks(records: list[RequestRecord], fin: list[RequestRecord], b: dict[str, float],
                 bytes_per_token: int, block_tokens: int, sampler: Sampler) -> dict[str, Any]:
    hit_blocks = sum((r.hit_tokens or 0) // block_tokens for r in fin
                     if r.read_side in _READS)
    retried = sum(a.read_bytes for a in failed_attempts(records))
    expect = hit_blocks * block_tokens * bytes_per_token + retried
    read = b["storage_read_pe_path"] + b["storage_read_de_path"]
    # An attempt the scheduler ended because its node was cut off (lease gone: PEER_FAILED
    # from the scheduler) may have read part of its hit that no report will ever count; the
    # bytes are then known only to lie within [expect, expect + those attempts' hits].
    unreported = sum((r.hit_tokens or 0) // block_tokens * block_tokens * bytes_per_token
                     for r in records for a in r.attempt_history
                     if _cut_off(a) and a.read_side in _READS)
    verified = _sum(sampler, "de_loader", "engine_verified_requests")
    mism = (_sum(sampler, "de_loader", "engine_prompt_mismatches")
            + _sum(sampler, "pe_receiver", "engine_hit_mismatches"))
    # PE -> DE: the whole prompt on the PE path; past the usable hit on the DE path and in
    # the oracle (there the hit is resident on the DE: none of it may cross); past the DE's
    # part on a split read (the PE's part of the hit crosses with the new tokens). Exact only
    # when no attempt failed part-way (its partial sends are not counted anywhere): None then.
    fwd = sum((r.prompt_tokens - _held_by_de(r)) * bytes_per_token for r in fin)
    fwd_ok = abs(b["pe_to_de"] - fwd) < 1 if not failed_attempts(records) else None
    return {"storage_read_bytes": read, "storage_read_bytes_expected": expect,
            "pe_to_de_bytes_expected": fwd, "pe_to_de_matches_new_tokens": fwd_ok,
            "storage_read_bytes_failed_attempts": retried,
            "storage_read_bytes_unreported_bound": unreported,
            "storage_read_matches_hits": expect - 1 < read < expect + unreported + 1,
            "engine_verified_requests": verified, "engine_byte_mismatches": mism,
            "every_prompt_verified": verified >= len(fin) and mism == 0}


def to_json(obj: Any) -> bytes:
    return msgspec.json.format(msgspec.json.encode(obj), indent=1)


def summary_rows(name: str, s: dict[str, Any]) -> list[str]:
    """One line per headline figure (what ``dualpath replay`` prints)."""
    lat = s.get("latency", {})
    links = s.get("links", {})
    b = s.get("bytes", {})
    fmt = lambda v, k=1.0, u="": "-" if v is None else f"{v * k:.3g}{u}"  # noqa: E731
    rows = [f"{name}: {s['finished']}/{s['requests']} finished, JCT {fmt(s.get('jct_s'), u=' s')}"
            f", hit rate {s['tokens']['hit_rate']:.1%}, read sides {s['read_sides']}",
            f"  TTFT p50/p90/p99 {fmt(lat['ttft']['p50'])}/{fmt(lat['ttft']['p90'])}/"
            f"{fmt(lat['ttft']['p99'])} s   TTST p50 {fmt(lat['ttst']['p50'])} s   "
            f"TPOT p50/p90 {fmt(lat['tpot']['p50'], 1e3)}/{fmt(lat['tpot']['p90'], 1e3)} ms   "
            f"SLO {'held' if s['slo']['held'] else 'missed'} "
            f"({s['slo']['attainment']:.0%} of requests within)"]
    if b:
        rows.append(f"  bytes: storage read PE path {b['storage_read_pe_path'] / 1e6:.1f} MB, "
                    f"DE path {b['storage_read_de_path'] / 1e6:.1f} MB, written "
                    f"{b['storage_written'] / 1e6:.1f} MB; PE→DE {b['pe_to_de'] / 1e6:.1f} MB, "
                    f"DE→PE {b['de_to_pe'] / 1e6:.1f} MB")
    if links:
        rows.append(f"  SNIC max/avg {fmt(links.get('snic_max_avg'))} (whole run "
                    f"{fmt(links.get('snic_max_avg_total'))}); mean storage-link utilisation "
                    + ", ".join(f"{n} {fmt(u, 100, '%')}"
                                for n, u in links.get("mean_utilisation", {}).items()))
    c = s["checks"]
    rows.append(f"  checks: all finished {c['all_finished']}, hit mismatches "
                f"{c['hit_mismatches']}/{c['hit_predicted']}"
                + _explained(c) + ", storage bytes = hits "
                f"{c.get('storage_read_matches_hits', '-')}"
                + (f" (within {c['storage_read_bytes_unreported_bound'] / 1e6:.1f} MB of reads "
                   "by cut-off nodes)" if c.get("storage_read_bytes_unreported_bound") else "")
                + ", prompts verified "
                f"{c.get('every_prompt_verified', '-')}")
    retried = s.get("retried_attempts")
    if retried:
        reread = c.get("storage_read_bytes_failed_attempts")
        rows.append(f"  failed attempts {sum(retried.values())} (re-read "
                    f"{fmt(reread, 1e-6, ' MB')}): "
                    + ", ".join(f"{k} {n}" for k, n in retried.items()))
    return rows


def _explained(c: dict[str, Any]) -> str:
    """The hits that differ from the prediction for a reason the cluster reported."""
    reasons = (("hit_short_by_lost_writes", "short by a lost write-back"),
               ("hit_zero_by_failed_lookup", "hit 0 by a failed lookup"))
    parts = [f"{c[k]} {what}" for k, what in reasons if c.get(k)]
    return f" (explained: {', '.join(parts)})" if parts else ""
