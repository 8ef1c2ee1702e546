"""``dualpath cluster up`` of a real-engine cluster file, the parts that need no vLLM: the config
(``[cluster] engine = "vllm"``), the command lines the launcher starts (one vLLM OpenAI server
per engine on its node's socket, then the front), the front's READY line, ``cluster status`` of
services started by hand, and stopping a process group so that nothing is left in
``/dev/shm`` (tools/proc_group.py). The whole cluster with real vLLM instances runs in
tests/test_vllm_demo.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from common.errors import ConfigError
from tests.helpers import wait_until
from tests.vllm_env import skip_or_fail
from tools.cluster import cli
from tools.cluster.config import free_port, load_data, read_toml
from tools.cluster.real_engines import (front_command, front_url, instance_commands,
                                        on_loopback)
from tools.proc_group import end_group_blocking, group_files, group_pids, private_ipc_env
from tools.vllm_engines import REPO, VLLM_PYTHON
from tools.vllm_serve import instance_port, runbook

# `cluster status` configures logging onto the captured stderr: put it back after each test
pytestmark = pytest.mark.usefixtures("keep_logging")

CONFIG_1P2D = REPO / "configs" / "vllm-1p2d.toml"


def test_a_real_engine_cluster_needs_engine_sockets():
    data = read_toml(CONFIG_1P2D, "cluster config")
    data["cluster"]["remote_engines"] = False
    with pytest.raises(ConfigError, match="remote_engines"):
        load_data(data, "x.toml", environ={})


def test_one_vllm_instance_per_engine_on_its_nodes_socket_then_the_front(tmp_path):
    cluster = load_data(read_toml(CONFIG_1P2D, "cluster config"), str(CONFIG_1P2D), environ={})
    model = tmp_path / "model"
    cmds = instance_commands(cluster, model)
    assert [c.name for c in cmds] == ["vllm:p0.e0", "vllm:d0.e0", "vllm:d1.e0"]
    for cmd, node, role, port in zip(cmds, ("p0", "d0", "d1"), ("producer", "consumer",
                                                                   "consumer"), (8001, 8002, 8003)):
        argv = cmd.argv
        assert argv[:3] == [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
        assert argv[argv.index("--port") + 1] == str(port) and cmd.url.endswith(f":{port}")
        ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert ktc["kv_role"] == f"kv_{role}"
        extra = ktc["kv_connector_extra_config"]
        assert extra["engine_id"] == f"{node}.e0"
        assert extra["engine_socket"].endswith(f"/vllm-1p2d/{node}.engine.sock")
        assert cmd.env["PYTHONPATH"] == str(REPO)
    front = front_command(cluster, model, ("127.0.0.1", 7000),
                          {c.name.split(":")[1]: str(c.url) for c in cmds})
    argv = front.argv
    assert argv[argv.index("--port") + 1] == "8000"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--engine"] == [
        "p0.e0=http://127.0.0.1:8001", "d0.e0=http://127.0.0.1:8002",
        "d1.e0=http://127.0.0.1:8003"]
    assert argv[argv.index("--scheduler") + 1] == "127.0.0.1:7000"


def test_the_runbook_serves_each_instance_on_its_configured_port():
    spec = load_data(read_toml(CONFIG_1P2D, "cluster config"), "x", environ={}).spec
    assert [instance_port(n) for n in spec.nodes] == [8001, 8002, 8003]
    text = runbook("configs/vllm-1p2d.toml")
    for port in (8001, 8002, 8003):
        assert f"--port {port}" in text


def test_the_loopback_copy_frees_every_fixed_port(tmp_path):
    cluster = on_loopback(CONFIG_1P2D, tmp_path)
    spec = cluster.spec
    assert spec.engine == "vllm" and spec.shape == "1P2D"
    assert spec.scheduler_port == 0 and spec.front_port == 0 and not spec.scheduler_metrics_port
    for n in spec.nodes:
        assert (n.gateway_port, n.rpc_port, n.engine_port, n.metrics_port) == (0, 0, 0, None)
    assert Path(spec.data_dir) == tmp_path / "cluster"
    ports = {int(c.argv[c.argv.index("--port") + 1]) for c in instance_commands(cluster, tmp_path)}
    assert len(ports) == 3 and 0 not in ports


def test_in_etcd_mode_the_front_follows_the_elected_leader(tmp_path):
    """``[etcd] endpoints``: ``cluster up`` starts the front with ``--etcd`` as the node
    services follow the leader there; without them, the static scheduler address only."""
    static = front_command(on_loopback(CONFIG_1P2D, tmp_path), tmp_path, ("127.0.0.1", 1), {})
    assert "--etcd" not in static.argv
    cluster = on_loopback(CONFIG_1P2D, tmp_path,
                          sections={"etcd": {"endpoints": ["h1:1", "h2:2"], "prefix": "/x"}})
    argv = front_command(cluster, tmp_path, ("127.0.0.1", 1), {}).argv
    assert argv[argv.index("--etcd"):][:4] == ["--etcd", "h1:1,h2:2", "--etcd-prefix", "/x"]


def test_a_longer_model_length_reaches_every_instance_and_the_fronts_prompt_limit(tmp_path):
    cluster = on_loopback(CONFIG_1P2D, tmp_path, vllm_max_model_len=4608,
                          sections={"pe_receiver": {"buffer_bytes": 384 << 20}})
    assert cluster.cfg.pe_receiver.buffer_bytes == 384 << 20
    for cmd in instance_commands(cluster, tmp_path):
        argv = cmd.argv
        assert argv[argv.index("--max-model-len") + 1] == "4608"
        assert int(argv[argv.index("--max-num-batched-tokens") + 1]) <= 4608
    front = front_command(cluster, tmp_path, ("127.0.0.1", 1), {"p0.e0": "http://x:1"}).argv
    assert front[front.index("--max-prompt-tokens") + 1] == "4560"
    assert "--max-prompt-tokens" not in front_command(       # the default: the front's own 2000
        on_loopback(CONFIG_1P2D, tmp_path), tmp_path, ("127.0.0.1", 1), {}).argv
    assert "--max-model-len 4608" in runbook_of(tmp_path, 4608)
    with pytest.raises(ConfigError, match="vllm_max_model_len"):
        on_loopback(CONFIG_1P2D, tmp_path, vllm_max_model_len=100)


def runbook_of(tmp_path: Path, max_len: int) -> str:
    text = CONFIG_1P2D.read_text().replace("[cluster]\n",
                                           f"[cluster]\nvllm_max_model_len = {max_len}\n")
    (tmp_path / "configs").mkdir(exist_ok=True)
    (tmp_path / "configs" / "x.toml").write_text(text)
    return runbook(str(tmp_path / "configs" / "x.toml"))


def test_a_fixed_engine_port_in_use_is_refused_before_anything_starts(tmp_path):
    import socket

    from tools.cluster.config import check_ports_free

    data = read_toml(CONFIG_1P2D, "cluster config")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        data["cluster"]["nodes"][2]["engine_port"] = held.getsockname()[1]
        cluster = load_data(data, "x.toml", environ={})
        with pytest.raises(ConfigError, match=r"engine_port \+ 0 \(d1\.e0\)"):
            check_ports_free(cluster)


def test_the_fronts_url_is_its_latest_ready_line(tmp_path):
    log = tmp_path / "front.log"
    assert front_url(log) is None
    log.write_text("==== start 1\nREADY http://127.0.0.1:1234\n\n==== start 2\nloading\n")
    assert front_url(log) is None                         # the latest run is not ready yet
    log.write_text(log.read_text() + "READY http://127.0.0.1:5678\n")
    assert front_url(log) == "http://127.0.0.1:5678"


# a group like a vLLM server's: the leader and a child that maps a /dev/shm segment it created;
# the child outlives the leader unless the group is killed
_GROUP = textwrap.dedent("""
    import mmap, os, socket, sys, time
    name, sock_path = sys.argv[1], sys.argv[2]
    closed = socket.socket(socket.AF_UNIX)  # vLLM's handshake: bound, closed, its file left
    closed.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "handshake"))
    closed.close()
    if os.fork() == 0:
        fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 20)
        m = mmap.mmap(fd, 1 << 20)
        m[:5] = b"hello"
        s = socket.socket(socket.AF_UNIX)     # as vLLM's ZeroMQ IPC queues: a socket file
        s.bind(sock_path)
        s.listen()
        print("MAPPED", flush=True)
        time.sleep(600)
    else:
        time.sleep(600)
""")


def test_ending_a_group_kills_its_children_and_unlinks_what_it_left(tmp_path):
    """The group's ``/dev/shm`` file, the socket file it was bound to and its private IPC
    directory (with a socket file closed long before) are removed once it is gone (vLLM leaves
    all of them: docs/vllm.md); files of ours the group never held stay."""
    name = f"/dev/shm/psm_dualpath_test_{os.getpid()}_{time.monotonic_ns()}"
    sock_path = str(tmp_path / "ipc.sock")
    other = Path(f"{name}_not_mapped")
    other.write_bytes(b"x")               # ours, but not the group's: left alone
    other_sock = socket.socket(socket.AF_UNIX)     # a live socket of ours: left alone
    other_sock.bind(str(tmp_path / "mine.sock"))
    ipc_env = private_ipc_env()
    ipc_dir = ipc_env["VLLM_RPC_BASE_PATH"]
    proc = subprocess.Popen([sys.executable, "-c", _GROUP, name, sock_path],
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, **ipc_env))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "MAPPED"
        assert len(group_pids(proc.pid)) == 2
        left_files = group_files(proc.pid)
        assert left_files == {name, sock_path, ipc_dir}, left_files
        assert Path(ipc_dir, "handshake").is_socket()
        proc.terminate()                  # the leader goes; its child would stay
        proc.wait(timeout=10)
        wait_until(lambda: len(group_pids(proc.pid)) == 1, 10, "the leader gone, its child left")
        removed = end_group_blocking(proc.pid, left_files | {str(tmp_path / "mine.sock")},
                                     grace_s=0.5)
        assert removed == sorted([name, sock_path, ipc_dir]), removed
        assert not any(Path(f).exists() for f in (name, sock_path, ipc_dir))
        assert group_pids(proc.pid) == [] and other.exists()
        assert (tmp_path / "mine.sock").exists()      # bound by a live socket: in use
    finally:
        end_group_blocking(proc.pid, set(), grace_s=0)
        other_sock.close()
        Path(name).unlink(missing_ok=True)
        other.unlink(missing_ok=True)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_status_of_services_started_by_hand_asks_the_configured_scheduler(tmp_path, capsys):
    """No state file (the runbook, systemd): ``cluster status`` asks the scheduler at the
    config's fixed port, naming the nodes that hold no lease."""
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(textwrap.dedent(f"""
        [cluster]
        name = "byhand"
        data_dir = "{tmp_path / 'cluster'}"
        storage_root = "{tmp_path / 'storage'}"
        scheduler_port = {port}
        engines_per_node = 1
        [[cluster.nodes]]
        id = "p0"
        role = "prefill"
        [[cluster.nodes]]
        id = "d0"
        role = "decode"
    """))
    assert cli.main(["status", "-c", str(cfg)]) == 3             # nobody answers there
    assert "does not answer" in capsys.readouterr().out
    sched = subprocess.Popen([sys.executable, "-m", "tools.cluster.serve", "scheduler", "-c",
                              str(cfg), "--ready-file", str(tmp_path / "ready")],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (tmp_path / "ready").exists() or sched.poll() is not None, 60,
                   "the scheduler ready")
        assert sched.poll() is None
        assert cli.main(["status", "-c", str(cfg)]) == 1         # no node holds a lease
        out = capsys.readouterr().out
        assert "no state file" in out and "nodes without a lease: d0, p0" in out
    finally:
        sched.terminate()
        sched.wait(timeout=30)


# What a vLLM instance leaves after it exits: a ZeroMQ socket file in VLLM_RPC_BASE_PATH and
# its process group's file store, named as vllm.utils.network_utils.get_file_store_init_method
# names it (in the temporary directory)
_LEAVES_A_SOCKET_AND_A_STORE = (
    "import os, socket, tempfile; s = socket.socket(socket.AF_UNIX); "
    "s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], 'queue')); "
    "path = os.path.join(tempfile.gettempdir(), 'vllm_dist_0123'); open(path, 'w').write('x'); "
    "print(path)")


async def test_a_server_that_died_before_its_stop_still_loses_its_ipc_directory(tmp_path):
    """``tools.vllm_serve.start`` keeps the IPC directory it was given: ``stop`` removes it
    though the process died first (its environment, where ``group_files`` looks, is gone),
    and with it the files the instance left in its temporary directory."""
    from tools.vllm_serve import start, stop
    env = dict(os.environ, **private_ipc_env())
    ipc_dir = Path(env["VLLM_RPC_BASE_PATH"])
    assert env["TMPDIR"] == str(ipc_dir)
    proc = await start([sys.executable, "-c", _LEAVES_A_SOCKET_AND_A_STORE], env,
                       tmp_path / "log", pipe_stdout=True)
    assert proc.stdout is not None
    store = Path((await proc.stdout.readline()).decode().strip())
    assert await proc.wait() == 0
    assert (ipc_dir / "queue").is_socket()            # left behind, as vLLM's are
    assert store.parent == ipc_dir and store.exists()
    await stop(proc)
    assert not ipc_dir.exists() and not store.exists()


def test_a_private_temporary_directory_keeps_the_shared_compile_cache():
    """An instance's private ``TMPDIR`` does not move TorchInductor's cache: the directory
    torch picks by default, so an instance does not recompile at every start."""
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} missing: torch is only there")
    env = private_ipc_env()
    try:
        torch_default = subprocess.run(
            [str(VLLM_PYTHON), "-c", "from torch._inductor.runtime.cache_dir_utils import "
             "default_cache_dir; print(default_cache_dir())"],
            env={k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
            capture_output=True, text=True, timeout=120, check=True).stdout.strip()
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            assert env["TORCHINDUCTOR_CACHE_DIR"] == torch_default
        assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith(env["TMPDIR"])
    finally:
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)
