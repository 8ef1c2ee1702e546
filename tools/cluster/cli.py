"""``dualpath cluster up|down|status|check -c configs/local-1p2d.toml [--mode M]``.

* ``up`` starts every service as a subprocess on loopback (see :mod:`.launcher`), prints the
  endpoints and returns; the services keep running. Exit 2: bad config (one message, nothing
  started); exit 1: a service failed to start (the others are stopped, its log tail printed).
* ``down`` stops the services recorded in the state file (SIGTERM, SIGKILL after the grace).
* ``status`` prints the endpoints and asks the scheduler which nodes hold leases; for services
  started by hand (no state file: the runbook, systemd) it asks the scheduler at the config's
  fixed ``scheduler_port`` which of the config's nodes hold a lease.
* ``check`` validates the config (and ports, memory, the P/D window) without starting anything.
"""

from __future__ import annotations

import argparse
import sys

from common.errors import DualpathError
from common.logging import configure_logging

from .config import MODES, load_cluster, pd_warning
from .launcher import Launcher, LaunchError, alive, endpoints_table, load_state_or_none


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath cluster", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("up", "down", "status", "check"))
    p.add_argument("-c", "--config", default=None, help="cluster TOML (default: embedded 1P2D)")
    p.add_argument("--mode", default=None, choices=sorted(MODES),
                   help="ablation mode: scheduler policy + engine mode")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cluster = load_cluster(args.config, mode=args.mode)
    except DualpathError as e:
        print(f"dualpath cluster: {e.message}", file=sys.stderr)
        return 2
    configure_logging("warning", cluster.cfg.logging.json)
    launcher = Launcher(cluster, echo=print)
    return _ACTIONS[args.action](launcher)


def _up(launcher: Launcher) -> int:
    c = launcher.cluster.spec
    print(f"starting cluster {c.name} ({c.shape}, {launcher.cluster.mode or 'as configured'})")
    try:
        state = launcher.up()
    except LaunchError as e:
        print(f"dualpath cluster up: {e.message}\n---- log tail ----\n{e.log_tail}\n"
              "---- all services stopped", file=sys.stderr)
        return 1
    except DualpathError as e:
        print(f"dualpath cluster up: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: services stopped", file=sys.stderr)
        return 130
    print(endpoints_table(state))
    print("stop with: dualpath cluster down" + (f" -c {launcher.cluster.source}"
                                                 if launcher.cluster.source.endswith(".toml")
                                                 else ""))
    return 0


def _down(launcher: Launcher) -> int:
    stopped = launcher.down()
    print(f"stopped {len(stopped)} service(s)" + (f": {', '.join(stopped)}" if stopped else
                                                  " (none running)"))
    if launcher.removed_files:
        print(f"removed {len(launcher.removed_files)} file(s) the vLLM instances left "
              f"(/dev/shm queues, IPC sockets): {', '.join(launcher.removed_files)}")
    return 0


def _status(launcher: Launcher) -> int:
    state = load_state_or_none(launcher.cluster)
    spec = launcher.cluster.spec
    if state is None and not spec.scheduler_port:
        print(f"cluster {spec.name} is not running")
        return 3
    if state is None:           # started by hand: the config names where the scheduler is
        host, port = spec.scheduler_host or spec.host, spec.scheduler_port
        print(f"cluster {spec.name}: no state file (not started by `cluster up`); asking the "
              f"scheduler at {host}:{port}")
    else:
        print(endpoints_table(state))
        dead = [p.name for p in state.procs if not alive(p)]
        if dead:
            print(f"not running: {', '.join(dead)}")
            return 1
        host, port = state.scheduler
    from services.scheduler.client.client import SyncSchedulerClient
    try:
        with SyncSchedulerClient(host, port, rpc=launcher.cluster.cfg.rpc,
                                 client_id="status") as client:
            st = client.cluster_status(timeout=5.0)
    except (DualpathError, OSError) as e:
        print(f"cluster {spec.name}: the scheduler at {host}:{port} does not answer ({e})")
        return 3 if state is None else 1
    missing = [] if state is not None else sorted(
        {n.id for n in spec.nodes} - {n.node_id for n in st.nodes})
    if missing:
        print(f"nodes without a lease: {', '.join(missing)}")
    print(f"scheduler policy {st.policy}; leases: "
          + ", ".join(f"{n.node_id}/{n.service}" for n in st.nodes)
          + f"; queues {st.queues}; requests {st.requests}")
    for key, what in sorted(st.discovery.items()):      # etcd mode: registered keys
        print(f"etcd {key}: {what}")
    return 1 if missing else 0


def _check(launcher: Launcher) -> int:
    c = launcher.cluster.spec
    if not launcher.is_local():
        warning = pd_warning(launcher.cluster)
        if warning:
            print(f"warning: {warning}")
        print(f"{launcher.cluster.source}: OK — {c.name}, {c.shape} on hosts "
              f"{', '.join(sorted({c.node_host(n) for n in c.nodes}))}: run "
              "`dualpath serve <service> -c CONFIG --node ID` on each (docs/deploy.md)")
        return 0
    try:
        launcher.preflight()
    except DualpathError as e:
        print(f"dualpath cluster check: {e.message}", file=sys.stderr)
        return 2
    print(f"{launcher.cluster.source}: OK — {c.name}, {c.shape}, "
          f"{sum(c.engines(n) for n in c.nodes)} engines, storage {c.storage_dir()}")
    return 0


_ACTIONS = {"up": _up, "down": _down, "status": _status, "check": _check}


if __name__ == "__main__":
    sys.exit(main())
