"""PNG plots of simulated runs (matplotlib is optional: without it the plots are skipped)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _downsample(rows: list[list[float]], limit: int = 600) -> tuple[list[int], list[list[float]]]:
    step = max(1, len(rows) // limit)
    idx, out = [], []
    for i in range(0, len(rows), step):
        chunk = rows[i:i + step]
        out.append([sum(c) / len(chunk) for c in zip(*chunk)])
        idx.append(i)
    return idx, out


def plot_runs(clusters: list, runs: dict[str, dict], path: Path) -> str:
    """One figure: per mode the storage-link utilisation over time (every node, or the min/mean/max
    envelope for big clusters) and SNIC max/avg per window; JCT per mode; TTFT and TPOT CDFs."""
    plt = _pyplot()
    if plt is None:
        return "PNG skipped: matplotlib is not installed (pip install matplotlib to get plots)"
    n = len(clusters)
    fig, axes = plt.subplots(n + 1, 2, figsize=(13, 3.2 * (n + 1)), squeeze=False)
    for row, (cl, (mode, r)) in enumerate(zip(clusters, runs.items())):
        util = cl.windows.utilisation()
        if not util:
            continue
        w = cl.cfg.sim.window_s
        idx, ds = _downsample(util)
        t = [i * w for i in idx]
        ax = axes[row][0]
        npe = len(cl.pnodes)
        if len(ds[0]) <= 16:
            for k in range(len(ds[0])):
                ax.plot(t, [x[k] for x in ds], lw=0.8, ls="-" if k < npe else "--",
                        label=cl.nodes[k].node_id)
            ax.legend(fontsize=6, ncol=4)
        else:
            for lo, hi, name in ((0, npe, "PE nodes"), (npe, len(ds[0]), "DE nodes")):
                ax.plot(t, [sum(x[lo:hi]) / (hi - lo) for x in ds], lw=1, label=f"{name} mean")
                ax.fill_between(t, [min(x[lo:hi]) for x in ds], [max(x[lo:hi]) for x in ds], alpha=0.25)
            ax.legend(fontsize=7)
        ax.set_title(f"{mode}: storage-link (SNIC read) utilisation", fontsize=9)
        ax.set_xlabel("simulated time (s)")
        ax.set_ylim(0, 1.05)
        ax = axes[row][1]
        ratio = [max(x) / (sum(x) / len(x)) if sum(x) > 0 else float("nan") for x in ds]
        ax.plot(t, ratio, lw=0.8)
        ax.axhline(r["snic_max_avg"], color="k", ls=":", lw=0.8)
        ax.set_title(f"{mode}: SNIC max/avg per window (loaded-window mean {r['snic_max_avg']:.3f})",
                     fontsize=9)
        ax.set_xlabel("simulated time (s)")
    ax = axes[n][0]
    modes = list(runs)
    ax.bar(modes, [runs[m]["jct_s"] for m in modes])
    ax.set_title("JCT per mode (s)", fontsize=9)
    ax = axes[n][1]
    for cl, mode in zip(clusters, modes):
        for hist, ls, name in ((cl.ttft, "-", "TTFT"), (cl.tpot, "--", "TPOT")):
            xs, ys = hist.cdf_points()
            if xs:
                ax.plot(xs, ys, ls=ls, lw=0.9, label=f"{mode} {name}")
    ax.set_xscale("log")
    ax.set_xlabel("seconds")
    ax.set_title("latency CDFs", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"
