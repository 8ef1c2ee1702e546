"""A 1P2D cluster across namespace hosts, started the bare-metal way (issue #17 items 1–3).

One set of hosts per module (``ctl``: etcd + scheduler, ``p0``, ``d0``, ``d1``, ``cli``: the
replay driver), each service from its deploy/systemd unit's ExecStart with the host's own
/etc/dualpath files. Needs root (skips loudly, fails under CI=true).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shlex
import subprocess
import sys
import pytest

from tests.helpers import require_etcd, require_namespaces, wait_until
from tools.hosts import cluster as hc
from tools.hosts import ucx_lanes
from tools.hosts.netns import HostNet, root_has_harness_route

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def net():
    require_namespaces()
    require_etcd()
    names = hc.HOST_NAMES + hc.SPARE_HOSTS
    with HostNet(names, storage_on=set(names) - {"nostore"}) as hosts:
        hc.write_host_files(hosts, hc.cluster_data(hosts))
        hc.start_cluster(hosts)
        yield hosts


_SEEDS = iter(range(100, 200))


def test_a_probe_past_its_limit_is_a_failed_try_and_tried_again(monkeypatch):
    """The project's CI on 150eaeb: one probe process outlasted its limit while the whole VM
    stood still, and the harness took that for an error. Judged as a kubelet judges: a failed
    try, tried again until the deadline (no namespaces needed)."""
    stalled = subprocess.TimeoutExpired(["health"], hc.PROBE_LIMIT_S)

    class Net:
        def __init__(self, answers: list[object]) -> None:
            self.answers, self.tries = answers, 0

        def run(self, host, argv, **kw):
            self.tries += 1
            got = self.answers.pop(0) if self.answers else 1
            if isinstance(got, BaseException):
                raise got
            return subprocess.CompletedProcess(argv, got)

    monkeypatch.setattr(hc, "unit_env", lambda net, host: {})
    late = Net([stalled, 0])
    assert hc.answers(late, "cli", "10.0.0.1:7500", deadline_s=30) and late.tries == 2
    down = Net([stalled])
    assert not hc.answers(down, "cli", "10.0.0.1:7500", deadline_s=0.5)
    assert down.tries >= 2                          # tried until the deadline, then False
    tries = iter([stalled, True])

    def ready() -> bool:                            # any readiness check, not only the probe
        got = next(tries)
        if isinstance(got, BaseException):
            raise got
        return got
    hc.wait_for(Net([]), "cli", ready, "probe", deadline_s=30)


def _replay_ok(net: HostNet, *args: str) -> dict:
    """A replay with --check on ``cli``; a fresh seed each time (the store keeps the blocks of
    earlier runs, and a repeated workload would hit more than the replay predicts)."""
    out = net.hosts["cli"].root / "var" / f"out{next(_SEEDS)}"
    r = hc.replay(net, "--agents", "4", "--max-turns", "3", "--check", "--out", str(out),
                  "--seed", out.name[3:], *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_replay_across_hosts_passes_every_check(net):
    checks = _replay_ok(net)["summary"]["checks"]
    assert checks["all_finished"] and checks["every_prompt_verified"]
    assert checks["storage_read_matches_hits"]
    # the scheduler ran on ctl, elected through etcd on ctl
    assert "scheduler_elected" in net.log_text("ctl", "dualpath-scheduler")


def test_ucx_crosses_hosts_over_tcp_only(net):
    for nid in hc.NODES:
        configs = ucx_lanes.parse(net.log_text(nid, f"dualpath-node@{nid}"))
        assert ucx_lanes.cross_host_violations(configs) == [], nid
        assert all("tcp" in c.transports for c in configs if c.inter_node)
        # sm / cma only ever on the node's own host (its gateway), never across
        assert all(not c.transports & ucx_lanes.LOCAL_ONLY for c in configs if c.inter_node)


def test_lane_check_fails_on_shared_memory_across_hosts():
    line = ("[1.0] [d0:1:0] ucp_worker.c:1984 UCX INFO ucp_context_0 inter-node cfg#3 "
            "tag(sysv/memory tcp/eth0)  rma(cma/memory)")
    bad = ucx_lanes.cross_host_violations(ucx_lanes.parse(line))
    assert bad and "sysv" in bad[0] and "cma" in bad[0]
    assert ucx_lanes.cross_host_violations([])[0].startswith("no inter-node")


def test_hosts_are_separate_machines(net):
    assert not root_has_harness_route()
    names = {h: net.run(h, ["hostname"]).stdout.strip() for h in net.hosts}
    assert names == {h: h for h in net.hosts}
    # private /dev/shm and IPC: a segment on p0 is not on d0
    assert net.run("p0", ["sh", "-c", "echo x > /dev/shm/i17-probe"]).returncode == 0
    assert net.run("d0", ["test", "-e", "/dev/shm/i17-probe"]).returncode != 0
    # shared storage: what p0 writes through its mount d0 reads through its own
    probe = net.mount_point / "i17-probe"
    assert net.run("p0", ["sh", "-c", f"echo shared > {probe}"]).returncode == 0
    assert net.run("d0", ["cat", str(probe)]).stdout.strip() == "shared"
    assert not probe.exists()                # the machine's own namespace has no mount
    # and the hosts reach each other only over their veths
    ctl = net.hosts["ctl"].address
    r = net.run("d1", ["python3", "-c", f"import socket; socket.create_connection(('{ctl}', "
                                        f"{hc.SCHEDULER_PORT}), 2)"])
    assert r.returncode == 0, r.stderr
    net.link("d1", up=False)
    try:
        r = net.run("d1", ["python3", "-c", f"import socket; socket.create_connection(('{ctl}', "
                                            f"{hc.SCHEDULER_PORT}), 1)"])
        assert r.returncode != 0
    finally:
        net.link("d1", up=True)


# ---------------------------------------------------------------------------- bad input

def _serve(net: HostNet, host: str, service: str, node: str, **kw) -> object:
    argv = [*hc.unit_command("dualpath-node@.service", net, host, node)]
    argv[argv.index("node")] = service
    return net.run(host, argv, env=hc.unit_env(net, host), cwd=str(net.hosts[host].root / "var"),
                   **kw)


def _host_file(net: HostNet, host: str, data: dict) -> None:
    from tools.cluster.toml_write import dumps
    (net.hosts[host].etc / "cluster.toml").write_text(dumps(data))


def test_a_host_naming_an_address_it_does_not_own_refuses_to_start(net):
    r = _serve(net, "cli", "gateway", "p0", timeout=60)
    assert r.returncode == 2
    assert "10.213.0.11, not an address of this machine (cli)" in r.stderr


def test_a_host_without_the_storage_mount_refuses_to_start(net):
    data = hc.node_moved(hc.cluster_data(net), "d1", net.hosts["nostore"].address)
    _host_file(net, "nostore", data)
    r = _serve(net, "nostore", "gateway", "d1", timeout=60)
    assert r.returncode == 2
    assert "storage directory" in r.stderr and "missing on this host (nostore)" in r.stderr


def test_two_nodes_with_one_id_the_scheduler_refuses_the_second(net):
    data = hc.node_moved(hc.cluster_data(net), "d0", net.hosts["spare"].address)
    _host_file(net, "spare", data)
    gw = hc.start_service(net, "spare", "dualpath-gateway@.service", "d0", log_name="gw-dup")
    node = hc.start_service(net, "spare", "dualpath-node@.service", "d0", log_name="node-dup")
    assert node.wait(timeout=90) != 0
    assert "two nodes with one id: d0/de_loader is live at 10.213.0.12" in net.log_text(
        "spare", "node-dup")
    from tools.hosts.netns import stop_process
    stop_process(gw)


def test_mismatched_ucx_transports_the_scheduler_refuses_the_node(net):
    data = hc.node_moved(hc.cluster_data(net), "d2", net.hosts["spare"].address,
                         TLS="tcp,self")
    _host_file(net, "spare", data)
    gw = hc.start_service(net, "spare", "dualpath-gateway@.service", "d2", log_name="gw-tls")
    node = hc.start_service(net, "spare", "dualpath-node@.service", "d2", log_name="node-tls")
    assert node.wait(timeout=90) != 0
    text = net.log_text("spare", "node-tls")
    assert "KV transports 'tcp,self' differ from" in text and "'tcp,sm,self'" in text
    from tools.hosts.netns import stop_process
    stop_process(gw)
    # the cluster is unaffected: a replay still passes every check
    _replay_ok(net)


# ---------------------------------------------------------------------------- the deploy doc

def doc_commands(section: str = "## Bare metal") -> list[str]:
    """Every command of docs/deploy.md's bare-metal section: lines of its code blocks and
    inline code spans that start with a command (so the doc and this test cannot drift)."""
    import re
    text = (hc.REPO / "docs" / "deploy.md").read_text()
    body = text[text.index(section):]
    body = body[:body.find("\n## ", 1)] if "\n## " in body[1:] else body
    cmds = [line.split("#")[0].strip() for block in re.findall(r"```\n(.*?)```", body, re.S)
            for line in block.splitlines()]
    cmds += re.findall(r"`((?:dualpath|python -m|systemctl) [^`]+)`", body)
    return [c for c in cmds if c]


def test_every_bare_metal_command_of_the_deploy_doc_runs_on_the_hosts(net):
    """Placed before the chaos tests (the doc's replay uses the default seed on a clean store)."""
    cmds = doc_commands()
    assert any(c.startswith("dualpath replay") for c in cmds), cmds
    ran = 0
    for cmd in cmds:
        words = cmd.split()
        if words[0] == "systemctl":
            # the units it names exist in deploy/systemd, and each service unit is one the
            # harness started (from that unit's ExecStart) and that is still running
            for u in (w for w in words[1:] if w.startswith("dualpath")):
                name = u if u.endswith((".service", ".target")) else u + ".service"
                assert (hc.UNITS / re.sub(r"@[^.]+\.service$", "@.service", name)).exists(), u
                if name.endswith(".service"):
                    log = name.removesuffix(".service")
                    host = "ctl" if "@" not in log else log.split("@")[1]
                    assert log in net.log_names(host), (u, net.log_names(host))
            ran += 1
            continue
        cmd = cmd.replace("/etc/dualpath/", str(net.hosts["cli"].etc) + "/")
        if "HOST:PORT" in cmd:
            addrs = [f"{net.hosts['ctl'].address}:{hc.SCHEDULER_PORT}"] + [
                f"{net.hosts[n].address}:{p}" for n in hc.NODES
                for p in (hc.GATEWAY_PORT, hc.RPC_PORT)]
        else:
            addrs = [""]
        for addr in addrs:
            argv = shlex.split(cmd.replace("HOST:PORT", addr))
            if argv[0] == "dualpath":
                argv[0] = str(hc.Path(sys.executable).parent / "dualpath")
            elif argv[0] == "python":
                argv[0] = sys.executable
            r = net.run("cli", argv, env=hc.unit_env(net, "cli"), timeout=300,
                        cwd=str(hc.REPO))
            assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
            ran += 1
    assert ran >= 6


# ---------------------------------------------------------------------------- compose's shape

def compose_shape() -> dict[str, set[tuple[str, str | None, int]]]:
    """docker-compose.yml's cluster: per machine (a container's own network, or the one it
    joins with ``network_mode: service:X``) the ``(service, node, port)`` it serves, the port
    from the service's own health check; profile-only services (the smoke client) aside."""
    import yaml
    doc = yaml.safe_load((hc.REPO / "docker-compose.yml").read_text())
    shape: dict[str, set[tuple[str, str | None, int]]] = {}
    for name, svc in doc["services"].items():
        if svc.get("profiles"):
            continue
        mode = svc.get("network_mode", "")
        host = mode.split(":", 1)[1] if mode.startswith("service:") else svc["hostname"]
        cmd = svc["command"]
        node = cmd[cmd.index("--node") + 1] if "--node" in cmd else None
        probe_host, port = svc["healthcheck"]["test"][-1].rsplit(":", 1)
        assert probe_host == host, (name, probe_host, host)
        shape.setdefault(host, set()).add((cmd[1], node, int(port)))
    return shape


def hosts_shape(net: HostNet) -> dict[str, set[tuple[str, str | None, int]]]:
    """The namespace cluster's: per host, each live service process (``serve KIND``; the node
    unit's ``node`` is the role's service) and the port the host file gives it."""
    from common.config import read_toml
    c = read_toml(net.hosts["cli"].etc / "cluster.toml")["cluster"]
    from tools.cluster.config import ROLE_SERVICE
    nodes = {n["id"]: n for n in c["nodes"]}
    shape: dict[str, set[tuple[str, str | None, int]]] = {}
    for name, host in net.hosts.items():
        for proc in host.procs:
            argv = [str(a) for a in proc.args]
            if proc.poll() is not None or "serve" not in argv:
                continue
            kind = argv[argv.index("serve") + 1]
            node = argv[argv.index("--node") + 1] if "--node" in argv else None
            if node is None:
                port = c["scheduler_port"]
            else:
                kind = ROLE_SERVICE[nodes[node]["role"]] if kind == "node" else kind
                port = nodes[node]["gateway_port" if kind == "gateway" else "rpc_port"]
            shape.setdefault(name, set()).add((kind, node, port))
    return shape


def test_the_hosts_reproduce_the_compose_files_shape(net):
    """Same machines, services, nodes and ports as docker-compose.yml (+ its cluster file),
    each port answering the health probe across the network; a node's services share its
    host (network, IPC: the gateway preads into the node service's /dev/shm buffer) and every
    node host mounts the one storage directory, as compose's shared volume."""
    from common.config import read_toml
    want = compose_shape()
    want["ctl"] = want.pop("scheduler")           # compose's scheduler container = host ctl
    assert hosts_shape(net) == want
    compose = read_toml(hc.REPO / "deploy" / "compose-1p2d.toml")["cluster"]
    mine = read_toml(net.hosts["cli"].etc / "cluster.toml")["cluster"]
    fields = ("id", "role", "gateway_port", "rpc_port")
    assert [{k: n[k] for k in fields} for n in mine["nodes"]] == \
        [{k: n[k] for k in fields} for n in compose["nodes"]]
    for key in ("scheduler_port", "engines_per_node", "storage_link_bytes_per_s",
                "compute_link_bytes_per_s"):
        assert mine[key] == compose[key], key
    for host, services in want.items():
        for _, _, port in services:
            assert hc.answers(net, "cli", f"{net.hosts[host].address}:{port}"), (host, port)
    for nid in hc.NODES:
        shm = net.run(nid, ["sh", "-c", "ls /dev/shm"]).stdout.split()
        assert any(f.startswith("dualpath") for f in shm), (nid, shm)
        assert net.run(nid, ["test", "-d", str(net.mount_point / "dualpath")]).returncode == 0


# ---------------------------------------------------------------------------- operations view

_PROM_API = ("import json, sys, urllib.parse, urllib.request\n"
             "url = f'http://{sys.argv[1]}/api/v1/{sys.argv[2]}?' + "
             "urllib.parse.urlencode(json.loads(sys.argv[3]))\n"
             "print(urllib.request.urlopen(url, timeout=5).read().decode())")


def prom(net: HostNet, addr: str, path: str, **params: str):
    """Prometheus's HTTP API, asked from ``cli`` (nothing outside the hosts reaches it);
    None while it does not answer."""
    r = net.run("cli", [sys.executable, "-c", _PROM_API, addr, path, json.dumps(params)],
                timeout=30)
    if r.returncode != 0:
        return None
    body = json.loads(r.stdout)
    assert body["status"] == "success", body
    return body["data"]


def test_prometheus_on_a_host_scrapes_every_service_and_the_dashboard_has_data(net, tmp_path):
    """Debian's prometheus on ``cli`` with the manifests' scrape config over the host file's
    metrics ports (namespace addresses); after a replay every Grafana query returns data."""
    import shutil
    import time

    import yaml

    from tests.test_prometheus_ops import MUST_BE_POSITIVE, require_prometheus
    from tools.cluster.config import ROLE_SERVICE, load_cluster
    from tools.cluster.observability import (dashboard_queries, engine_queries, load_dashboard,
                                             metrics_targets, prometheus_config)
    binary = require_prometheus()
    groups = metrics_targets(load_cluster(net.hosts["cli"].etc / "cluster.toml"))
    assert len(groups) == 1 + 2 * len(hc.NODES)
    root = net.hosts["cli"].root / "prometheus"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    (root / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(groups, 0.5)))
    addr = f"{net.hosts['cli'].address}:9090"
    net.spawn("cli", [binary, f"--config.file={root / 'prometheus.yml'}",
                      f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address={addr}",
                      "--log.level=warn"], log_name="prometheus")

    def query(expr: str) -> list:
        return (prom(net, addr, "query", query=expr, time=f"{time.time():.3f}") or {}
                ).get("result", [])

    def all_up() -> bool:
        t = (prom(net, addr, "targets", state="active") or {}).get("activeTargets", [])
        return len(t) == len(groups) and all(x["health"] == "up" for x in t)
    wait_until(all_up, timeout=90, what="every service's target scraped and up", interval=0.5)
    _replay_ok(net)

    def up_now() -> set[str]:
        return {r["metric"]["dualpath_service"] + ":" + r["metric"].get("node_id", "")
                for r in query("up") if r["value"][1] == "1"}

    # Every service, by name, answers its scrapes after the replay. Awaited, not sampled once:
    # Prometheus caps a scrape's timeout at the 0.5-s interval, so on the busy 2-core host one
    # scrape can time out and read "up 0" for that sample (ci138: gateway:p0, right after the
    # replay, the replay's checks passed) although the service serves the next one.
    expected = {"scheduler:"} | {f"{s}:{n}" for n, role in hc.NODES.items()
                                 for s in ("gateway", ROLE_SERVICE[role])}
    wait_until(lambda: up_now() == expected, timeout=60, interval=0.5,
               what=lambda: f"every service up by name (up now: {sorted(up_now())})")
    wait_until(lambda: all(any(float(r["value"][1]) > 0 for r in query(e))
                           for e in MUST_BE_POSITIVE), timeout=60,
               what="a scrape that saw the replay's reads", interval=0.5)
    queries = dashboard_queries(load_dashboard())
    assert len(queries) >= 8
    engine = engine_queries(queries)       # the vLLM instances' panels: none here
    assert {t for t, _ in engine} == {t for t, _ in queries if t.startswith("vLLM")}
    empty = [(title, e) for title, e in queries if (title, e) not in engine and not query(e)]
    assert not empty, f"dashboard queries without data: {empty}"
    roles = {r["metric"]["role"] for r in query(MUST_BE_POSITIVE[0])}
    assert roles == {"prefill", "decode"}


# ---------------------------------------------------------------------------- chaos across hosts

# Run on ``cli`` until a condition on the cluster holds (exit 0), or 1 when ``deadline`` s pass:
#   holding NODE [E N] NODE's service is registered and holds an attempt (GetStats over its RPC
#                      port, every 20 ms) once N more requests finished than when the probe
#                      started (E: the epoch if known, else 0); prints the registration epoch
#   registered NODE    the scheduler lists NODE's service (prints its registration epoch)
#   not-epoch NODE E   the scheduler no longer lists NODE under registration epoch E
_PROBE = """
import asyncio, sys, time
from typing import Union
from common.config import RpcConfig
from common.protocol import ErrorReply, GetStats, GetStatsReply
from common.rpc_client import RpcClient
from services.scheduler.client.client import SchedulerClient

async def main(what, node, host, port, sched_host, sched_port, deadline, epoch="0",
               after="0"):
    node_rpc = RpcClient(RpcConfig(), host, int(port), role="monitor", node_id="test",
                         reply_type=Union[GetStatsReply, ErrorReply])
    sched = SchedulerClient(sched_host, int(sched_port))
    end = time.monotonic() + float(deadline)
    finished = None                         # the scheduler's count when the probe started
    try:
        while time.monotonic() < end:
            try:
                if what == "holding":
                    if int(after) > 0:
                        done = (await sched.cluster_status(timeout=2.0)).counters["finished"]
                        finished = done if finished is None else finished
                        if done < finished + int(after):
                            await asyncio.sleep(0.05)
                            continue
                        after = "0"
                    if epoch == "0":
                        st = await sched.cluster_status(timeout=2.0)
                        epoch = next((str(n.epoch) for n in st.nodes if n.node_id == node
                                      and n.role in ("prefill", "decode")), "0")
                        continue
                    r = await node_rpc.call(GetStats(), timeout=2.0)
                    if r.counters.get("attempts_live", 0) >= 1:
                        print(epoch, flush=True)
                        return 0
                else:
                    st = await sched.cluster_status(timeout=2.0)
                    epochs = [n.epoch for n in st.nodes
                              if n.node_id == node and n.role in ("prefill", "decode")]
                    if what == "registered" and epochs:
                        print(epochs[0])
                        return 0
                    if what == "not-epoch" and int(epoch) not in epochs:
                        return 0
            except Exception:
                pass
            await asyncio.sleep(0.02)
        return 1
    finally:
        await node_rpc.close()
        await sched.close()

sys.exit(asyncio.run(main(*sys.argv[1:])))
"""


def _probe(net: HostNet, what: str, node: str, *extra: str, deadline: float = 120,
           check: bool = True) -> tuple[bool, str]:
    """Wait (on ``cli``) until ``what`` holds for ``node`` (see ``_PROBE``): whether it did,
    and the last line it printed (log lines come first). ``check``: fail the test if not."""
    r = net.run("cli", [sys.executable, "-c", _PROBE, what, node, net.hosts[node].address,
                        str(hc.RPC_PORT), net.hosts["ctl"].address, str(hc.SCHEDULER_PORT),
                        str(deadline), *extra],
                env=hc.unit_env(net, "cli"), timeout=deadline + 30)
    assert r.returncode == 0 or not check, \
        f"{what} {node} {extra} not seen within {deadline} s: {r.stderr[-2000:]}"
    out = r.stdout.strip()
    return r.returncode == 0, out.splitlines()[-1] if out else ""


_PROBES = itertools.count()


def _until_holding(net: HostNet, node: str, replay, after: int = 0) -> int | None:
    """Until ``node`` is registered and holds attempts of the running replay, once ``after`` of
    its requests finished: the fault lands on work in flight, not on a moment that happens to
    be idle (no fixed head start). Returns the registration epoch the fault will end, or None
    when the replay ended first (the scheduler placed none of its work there: the caller runs
    another).

    One probe process watches for the replay's whole run (a probe restarted in slices missed
    short replays under load: its own start-up took most of each slice); it is stopped when
    the replay ends first."""
    name = f"probe-holding-{next(_PROBES)}"
    probe = net.spawn("cli", [sys.executable, "-c", _PROBE, "holding", node,
                              net.hosts[node].address, str(hc.RPC_PORT),
                              net.hosts["ctl"].address, str(hc.SCHEDULER_PORT), "400", "0",
                              str(after)],
                      env=hc.unit_env(net, "cli"), log_name=name)
    try:
        while probe.poll() is None and replay.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                probe.wait(timeout=0.02)        # the probe's exit or the replay's, polled
        if probe.returncode != 0 or replay.poll() is not None:
            return None
        return int(net.log_text("cli", name).strip().splitlines()[-1])
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait(timeout=30)


def _replay_during(net: HostNet, fault, *, agents: int = 6, turns: int = 4,
                   tries: int = 3) -> tuple[int, str, dict]:
    """Start a replay on ``cli`` and run ``fault(replay)`` while it runs (True: it struck;
    False: its target never held work of this replay, so another replay is run, up to
    ``tries``); return (rc, output, results) of the replay the fault struck."""
    for _ in range(tries):
        seed = next(_SEEDS)
        out = net.hosts["cli"].root / "var" / f"out{seed}"
        argv = [*hc.replay_argv(net, "cli"), "--agents", str(agents), "--max-turns", str(turns),
                "--check", "--out", str(out), "--seed", str(seed)]
        env = hc.unit_env(net, "cli")
        env.pop("UCX_LOG_LEVEL", None)
        proc = net.spawn("cli", argv, env=env, log_name=f"replay{seed}",
                         cwd=str(net.hosts["cli"].root / "var"))
        struck = fault(proc)
        rc = proc.wait(timeout=400)
        if struck:
            res = json.loads((out / "results.json").read_text()) \
                if (out / "results.json").exists() else {}
            return rc, net.log_text("cli", f"replay{seed}"), res
    raise AssertionError(f"the fault's target held no work in {tries} replays")


def _mismatched(res: dict) -> str:
    """The records whose hit differs from the prediction (their attempts included): what a
    failure needs to be explained, since the replay's output directory goes with the hosts."""
    ids = set(res["summary"]["checks"]["hit_mismatch_examples"])
    return "\n" + json.dumps([r for r in res.get("records", []) if r["request_id"] in ids],
                              indent=1)


def test_a_partitioned_decode_host_is_replanned_and_no_request_is_lost(net):
    def partition(replay) -> bool:
        epoch = _until_holding(net, "d1", replay)    # transfers under way on d1
        if epoch is None:
            return False
        net.link("d1", up=False)             # d1's cable pulled at the switch
        try:                                 # until the scheduler gave that lease up (5 s)
            _probe(net, "not-epoch", "d1", str(epoch), deadline=60)
        finally:
            net.link("d1", up=True)
        return True

    rc, text, res = _replay_during(net, partition)
    checks = res["summary"]["checks"]
    if rc != 0:                            # --check: finished, hits, bytes, verified
        pytest.fail(f"{text[-3000:]}\n{json.dumps(checks, indent=1)}")
    assert checks["all_finished"] and checks["every_prompt_verified"], text[-3000:]


def test_a_decode_host_killed_its_requests_finish_on_the_others(net):
    """Last in the module: d1's services stay dead. The kill waits until every agent's first
    turn could have finished (6 requests), so it mostly strikes turns with hits: reads from d1's
    gateway, write-backs the next turn counts on (ci122's mismatch came from such a kill)."""
    def kill(replay) -> bool:
        if _until_holding(net, "d1", replay, after=6) is None:
            return False
        net.kill_host("d1")                  # the machine's services die (SIGKILL)
        return True

    rc, text, res = _replay_during(net, kill)
    s = res["summary"]
    assert s["checks"]["all_finished"], text[-3000:]        # no request lost
    assert s["checks"]["hit_mismatches"] == 0, text[-3000:] + _mismatched(res)
    assert s["checks"]["engine_byte_mismatches"] == 0, text[-3000:]
    sched = net.log_text("ctl", "dualpath-scheduler")
    assert "node_removed" in sched or "lease" in sched, sched[-3000:]
