"""PNG plots of replay results (matplotlib, Agg backend: no display needed).

* ``jct.png`` — JCT per mode (bars, speedup over ``basic`` on top);
* ``latency.png`` — TTFT and TPOT distributions (CDF per mode);
* ``links.png`` — storage-link utilisation per node over time (one panel per mode);
* ``snic.png`` — SNIC max/avg per mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_all(results: dict[str, dict[str, Any]], outdir: str | Path) -> list[Path]:
    """Every plot for a set of runs keyed by mode (one run works too)."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = [_latency(results, outdir / "latency.png"), _links(results, outdir / "links.png")]
    if any(r["summary"].get("jct_s") for r in results.values()):
        paths.append(_jct(results, outdir / "jct.png"))
    if any(r["summary"].get("links") for r in results.values()):
        paths.append(_snic(results, outdir / "snic.png"))
    return [p for p in paths if p is not None]


def _jct(results: dict[str, dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    modes = list(results)
    jct = [results[m]["summary"].get("jct_s") or 0.0 for m in modes]
    base = results.get("basic", {}).get("summary", {}).get("jct_s")
    fig, ax = plt.subplots(figsize=(1.4 * len(modes) + 2, 3.6))
    bars = ax.bar(modes, jct, color="#4c72b0")
    for b, v in zip(bars, jct):
        label = f"{v:.1f}s" + (f"\n{base / v:.2f}x" if base and v else "")
        ax.annotate(label, (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("JCT (s)")
    ax.set_title("Offline JCT per mode (speedup over basic)")
    ax.set_ylim(0, max(jct + [1e-9]) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax, values: list[float], label: str, scale: float = 1.0) -> None:
    v = sorted(x * scale for x in values if x is not None)
    if v:
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)


def _latency(results: dict[str, dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for mode, r in results.items():
        fin = [x for x in r["records"] if x["outcome"] == "finished"]
        _cdf(a1, [x["ttft_s"] for x in fin], mode)
        _cdf(a2, [x["tpot_s"] for x in fin if x["tokens"] > 1], mode, 1e3)
    slo = next(iter(results.values()))["summary"]["slo"]
    a1.axvline(slo["ttft_max_s"], color="grey", ls=":", lw=1)
    a2.axvline(slo["tpot_max_s"] * 1e3, color="grey", ls=":", lw=1)
    a1.set_xlabel("TTFT (s)")
    a2.set_xlabel("TPOT (ms)")
    for a in (a1, a2):
        a.set_ylabel("fraction of requests")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("Latency distributions (dotted: SLO)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _links(results: dict[str, dict[str, Any]], path: Path) -> Path | None:
    runs = [(m, r["summary"]["links"]) for m, r in results.items() if r["summary"].get("links")]
    if not runs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.2 * len(runs) + 0.6), squeeze=False)
    for ax, (mode, links) in zip(axes[:, 0], runs):
        w = links["window_s"]
        for node in links["nodes"]:
            u = links["utilisation"][node]
            ys = [100 * x if x is not None else None for x in u]
            if any(y is not None for y in ys):
                ax.plot([w * (i + 0.5) for i in range(len(ys))], ys,
                        label=f"{node} ({links['roles'].get(node)})")
        ax.set_ylabel("util. %")
        top = max((y for n in links["nodes"] for y in links["utilisation"][n] if y), default=1)
        ax.set_ylim(0, max(115, 105 * top))
        r = links.get("snic_max_avg")
        ax.set_title(f"{mode}: storage-link utilisation per node"
                     + (f" (SNIC max/avg {r:.2f})" if r else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _snic(results: dict[str, dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    modes = [m for m, r in results.items() if r["summary"].get("links")]
    vals = [results[m]["summary"]["links"].get("snic_max_avg") or 0.0 for m in modes]
    fig, ax = plt.subplots(figsize=(1.4 * len(modes) + 2, 3.2))
    bars = ax.bar(modes, vals, color="#dd8452")
    for b, v in zip(bars, vals):
        ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                    fontsize=8)
    ax.axhline(1.0, color="grey", lw=1, ls=":")
    ax.set_ylabel("SNIC max / avg")
    ax.set_title("Storage-link load balance (1.0 = perfect)")
    ax.set_ylim(0, max(vals + [1.0]) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
