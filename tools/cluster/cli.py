"""``dualpath cluster up|down|status|check -c configs/local-1p2d.toml [--mode M]``.

* ``up`` starts every service as a subprocess on loopback (see :mod:`.launcher`), prints the
  endpoints and returns; the services keep running. Exit 2: bad config (one message, nothing
  started); exit 1: a service failed to start (the others are stopped, its log tail printed).
* ``down`` stops the services recorded in the state file (SIGTERM, SIGKILL after the grace).
* ``status`` prints the endpoints and asks the scheduler which nodes hold leases.
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
    return 0


def _status(launcher: Launcher) -> int:
    state = load_state_or_none(launcher.cluster)
    if state is None:
        print(f"cluster {launcher.cluster.spec.name} is not running")
        return 3
    print(endpoints_table(state))
    dead = [p.name for p in state.procs if not alive(p)]
    if dead:
        print(f"not running: {', '.join(dead)}")
        return 1
    from services.scheduler.client.client import SyncSchedulerClient
    host, port = state.scheduler
    with SyncSchedulerClient(host, port, client_id="status") as client:
        st = client.cluster_status(timeout=5.0)
    print(f"scheduler policy {st.policy}; leases: "
          + ", ".join(f"{n.node_id}/{n.service}" for n in st.nodes)
          + f"; queues {st.queues}; requests {st.requests}")
    for key, what in sorted(st.discovery.items()):      # etcd mode: registered keys
        print(f"etcd {key}: {what}")
    return 0


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
