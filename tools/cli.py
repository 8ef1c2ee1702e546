"""The ``dualpath`` command: one entry point for services, tools and benchmarks.

Subcommands are looked up in tables (name → module), so a new benchmark or service is one
line here and its own module with ``main(argv) -> int``. Every service runs in one process
shell, ``dualpath serve <service>``; ``dualpath scheduler|gateway|pe_receiver|de_loader ...``
are aliases of it.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, str] = {
    "transport": "bench.transport_bench",
    "scheduler": "bench.scheduler_bench",
    "gateway": "bench.gateway_bench",
    "gateway-storage": "bench.gateway_storage_bench",
    "e2e": "bench.e2e_bench",
    "datapath": "bench.datapath_bench",
    "sim": "bench.sim_bench",
    "chaos": "bench.chaos_bench",
    "overload": "bench.overload_bench",
    "engine_ipc": "bench.engine_ipc_bench",
    "engine_agents": "bench.engine_agents_bench",
    "failover": "bench.failover_bench",
    "plan": "bench.plan_bench",
    "engine": "bench.engine_bench",
    "multihost": "bench.multihost_bench",
    "kvpath": "bench.kvpath_bench",
    "gpu": "bench.gpu_bench",
}

COMMANDS: dict[str, str] = {
    "cluster": "tools.cluster.cli",
    "serve": "tools.cluster.serve",
    "replay": "tools.replay.cli",
    "demo": "tools.cluster.demo",
    "simulate": "sim.cli",
    "check-config": "sim.check",
    "sim-accel": "sim.accel",
    "plan": "sim.plan_cli",
}

SERVE_ALIASES = ("scheduler", "gateway", "pe_receiver", "de_loader")  # dualpath serve <alias>


def _usage() -> str:
    lines = ["usage: dualpath <command> [args]", "", "commands:"]
    lines += [f"  {name}" for name in sorted(COMMANDS)]
    lines += [f"  {name}   (= serve {name})" for name in SERVE_ALIASES]
    lines += ["  bench <name> [--quick] [--out FILE]   benchmarks: " + ", ".join(sorted(BENCHMARKS))]
    return "\n".join(lines)


def _run_module(module: str, argv: list[str]) -> int:
    mod = importlib.import_module(module)
    return int(mod.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"unknown benchmark; choose one of: {', '.join(sorted(BENCHMARKS))}", file=sys.stderr)
            return 2
        return _run_module(BENCHMARKS[rest[0]], rest[1:])
    if cmd in COMMANDS:
        return _run_module(COMMANDS[cmd], rest)
    if cmd in SERVE_ALIASES:
        return _run_module(COMMANDS["serve"], [cmd, *rest])
    print(f"unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
