"""``dualpath check-config -c <config>``: is the cluster inside eq. (9)'s no-bottleneck P/D window?

Reads the hardware of a simulator config (``[hardware]``: P, D, g, SNIC, CNIC and DRAM rates) or
takes them on the command line, prints the §3 per-link loads at full storage speed, the window
and the constraint that binds. Exit status 0 inside the window, 1 outside, 2 on bad input.

Launchers call ``pd_window_warning(P, D, g, snic, cnic, dram)`` (``sim.bandwidth``) and log the
line it returns, if any.
"""

from __future__ import annotations

import argparse
import json
import sys

from common.errors import ConfigError

from .bandwidth import Verdict, check, pd_window_warning
from .config import load

__all__ = ["main", "pd_window_warning", "check_config"]

_LOAD_NAMES = {"PE_CNIC_read": "PE CNIC read  (per GPU)", "PE_CNIC_write": "PE CNIC write (per GPU)",
               "DE_CNIC_read": "DE CNIC read  (per GPU)", "DE_CNIC_write": "DE CNIC write (per GPU)",
               "PE_DRAM": "PE DRAM       (per node)", "DE_DRAM": "DE DRAM       (per node)"}


def check_config(path: str | None) -> Verdict:
    """Eq. (9) verdict for a simulator config file (``None``: the embedded defaults)."""
    h = load(path).hardware
    return check(h.prefill_nodes, h.decode_nodes, h.gpus_per_node, h.snic_bytes_per_s,
                 h.cnic_bytes_per_s, h.dram_bytes_per_s)


def render(v: Verdict, file=None) -> None:
    file = file or sys.stdout
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p(v.summary())
    p(f"  storage bandwidth usable: Basic {v.storage_basic_bytes_per_s / 1e9:g} GB/s (PE nodes only), "
      f"DualPath {v.storage_dualpath_bytes_per_s / 1e9:g} GB/s (every node)")
    p("  per-link load with every SNIC saturated (fraction of capacity, paper §3):")
    for k, val in v.loads.items():
        p(f"    {_LOAD_NAMES.get(k, k)}  {val:6.3f}  {'OK' if val <= 1 + 1e-12 else 'OVER'}")
    if v.violated:
        p("  violated: " + "; ".join(v.violated))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dualpath check-config", description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", help="simulator config TOML (configs/sim-*.toml)")
    ap.add_argument("--P", type=int, help="prefill nodes (overrides the config)")
    ap.add_argument("--D", type=int, help="decode nodes")
    ap.add_argument("--g", type=int, help="GPUs (CNICs) per node")
    ap.add_argument("--snic", type=float, help="storage bandwidth per node, bytes/s")
    ap.add_argument("--cnic", type=float, help="compute NIC bandwidth per GPU, bytes/s")
    ap.add_argument("--dram", type=float, help="DRAM bandwidth per node, bytes/s")
    ap.add_argument("--json", action="store_true", help="print the verdict as JSON")
    args = ap.parse_args(argv)
    try:
        h = load(args.config).hardware
        vals = dict(P=h.prefill_nodes, D=h.decode_nodes, g=h.gpus_per_node, snic=h.snic_bytes_per_s,
                    cnic=h.cnic_bytes_per_s, dram=h.dram_bytes_per_s)
        for k in vals:
            if getattr(args, k) is not None:
                vals[k] = getattr(args, k)
        v = check(vals["P"], vals["D"], vals["g"], vals["snic"], vals["cnic"], vals["dram"])
    except (ConfigError, ValueError) as e:
        print(f"check-config: {e}", file=sys.stderr)
        return 2
    if args.json:
        import msgspec
        print(json.dumps(msgspec.to_builtins(v), indent=2))
    else:
        render(v)
    return 0 if v.inside else 1


if __name__ == "__main__":
    sys.exit(main())
