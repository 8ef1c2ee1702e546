"""Cluster config: shipped configs, validation messages naming the key, rendering, modes."""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path

import msgspec
import pytest

from common.errors import ConfigError
from tools.cluster.config import (MODES, check_local_resources, check_ports_free,
                                     load_cluster, load_data, service_config)
from tools.cluster.toml_write import dumps

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TWO = [{"id": "p0", "role": "prefill"}, {"id": "d0", "role": "decode"}]


def data(**sections) -> dict:
    out = {"cluster": {"nodes": [dict(n) for n in TWO]}}
    for k, v in sections.items():
        out.setdefault(k, {}).update(v)
    return out


def error(d: dict) -> str:
    with pytest.raises(ConfigError) as e:
        load_data(d, "t.toml", environ={})
    return e.value.message


@pytest.mark.parametrize("name,shape", [("local-1p1d", "1P1D"), ("local-1p2d", "1P2D"),
                                        ("local-2p1d", "2P1D")])
def test_shipped_configs_load_and_render_every_service(name, shape):
    c = load_cluster(CONFIGS / f"{name}.toml", environ={})
    assert c.spec.shape == shape and c.spec.name == name
    check_local_resources(c)                      # fits this machine
    for n in c.spec.nodes:
        gw = service_config(c, "gateway", n.id)
        assert gw.gateway.link_rate_bytes_per_s == c.spec.storage_link(n) > 0
        assert gw.gateway.probe_on_miss               # one shared directory
        svc = "pe_receiver" if n.role == "prefill" else "de_loader"
        node = service_config(c, svc, n.id, scheduler=("127.0.0.1", 7), gateway_port=9)
        section = getattr(node, svc)
        assert (section.scheduler_port, section.gateway_port, section.engines) == (7, 9, 2)
        assert node.arbiter.link_rate_bytes_per_s == c.spec.compute_link(n)
    sched = service_config(c, "scheduler")
    assert sched.scheduler.model == "test-small"      # α/β follow the emulated model and links
    assert sched.scheduler.snic_bytes_per_s == c.spec.storage_link_bytes_per_s


def test_embedded_defaults_are_the_local_1p2d_file():
    a, b = load_cluster(None, environ={}), load_cluster(CONFIGS / "local-1p2d.toml", environ={})
    assert msgspec.to_builtins(a.cfg) == msgspec.to_builtins(b.cfg)


@pytest.mark.parametrize("d,where", [
    (data(cluster={"nodez": []}), "`nodez` - at `$.cluster`"),
    ({"cluster": {"nodes": [TWO[0], {"id": "d0", "rol": "decode"}]}}, "$.cluster.nodes[1]"),
    ({"cluster": {"nodes": [TWO[0], {"id": "d0", "role": "decod"}]}},
     "$.cluster.nodes[1].role"),
    (data(gateway={"link_rate": 1}), "`link_rate` - at `$.gateway`"),
    (data(cluster={"time_scale": 0}), "> 0.0 - at `$.cluster.time_scale`"),
])
def test_bad_keys_and_values_name_the_key(d, where):
    assert where in error(d)


def test_shapes_the_services_cannot_run_are_refused():
    assert "at least one prefill and one decode node (got 1P0D)" in error(
        {"cluster": {"nodes": [TWO[0]]}})
    assert "used twice" in error({"cluster": {"nodes": [TWO[0], TWO[1], dict(TWO[1])]}})
    assert "max_engines_per_node" in error(data(cluster={"engines_per_node": 65}))
    assert "disagree" in error(data(engine_sim={"time_scale": 0.5}))
    assert "has no cost model" in error(data(engine_sim={"model": "nope"}))
    msg = error({"cluster": {"nodes": [{"id": "p0", "role": "prefill", "gateway_port": 7000},
                                       {"id": "d0", "role": "decode", "rpc_port": 7000}]}})
    assert "port 7000" in msg and "nodes[0].gateway_port" in msg


def test_a_port_in_use_is_one_clear_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = load_data({"cluster": {"scheduler_port": port, "nodes": TWO}}, "t.toml", environ={})
        with pytest.raises(ConfigError, match=f"cluster.scheduler_port = {port}"):
            check_ports_free(c)


def test_memory_the_machine_lacks_is_refused():
    c = load_data(data(pe_receiver={"buffer_bytes": 1 << 50}), "t.toml", environ={})
    with pytest.raises(ConfigError, match="preallocates"):
        check_local_resources(c)


def test_modes_switch_only_policy_and_engine_mode():
    c = load_cluster(None, environ={})
    for mode, m in MODES.items():
        cfg = service_config(c.with_mode(mode), "pe_receiver", "p0")
        assert (cfg.scheduler.policy, cfg.scheduler.oracle, cfg.scheduler.read_side,
                cfg.scheduler.placement, cfg.engine_sim.mode) == \
            (m.policy, m.oracle, m.read_side, m.placement, m.engine_mode)
    pe_only = service_config(c.with_mode("pe-only"), "pe_receiver", "p0").scheduler
    assert pe_only.read_side_mode() == "pe" and pe_only.placement_mode() == "balanced"
    with pytest.raises(ConfigError, match="unknown mode"):
        c.with_mode("fast")
    with pytest.raises(ConfigError, match="runs de_loader, not pe_receiver"):
        service_config(c, "pe_receiver", "d0")
    with pytest.raises(ConfigError, match="no node 'x9'"):
        service_config(c, "gateway", "x9")


def test_environment_overlay_reaches_the_cluster_section():
    c = load_cluster(None, environ={"DUALPATH__CLUSTER__TIME_SCALE": "0.5"})
    assert c.spec.time_scale == 0.5
    assert service_config(c, "de_loader", "d0").engine_sim.time_scale == 0.5


def test_toml_writer_round_trips_a_cluster_file():
    c = load_cluster(CONFIGS / "local-2p1d.toml", environ={})
    text = dumps(c.data)
    assert tomllib.loads(text) == c.data
    assert load_data(tomllib.loads(text), "x", environ={}).spec == c.spec


def test_free_port_stays_in_this_processs_band(monkeypatch):
    """`make test` runs two pytest processes at once, each handing out ports from its own
    band (DUALPATH_PORT_BAND=k/n), so they never name one port to two services."""
    from tools.cluster.config import _ephemeral_range, free_port
    low, _ = _ephemeral_range()
    start = max(1024, low - 12000)
    width = (low - start) // 2
    monkeypatch.setenv("DUALPATH_PORT_BAND", "1/2")
    assert all(start + width <= free_port() < start + 2 * width for _ in range(50))
    monkeypatch.setenv("DUALPATH_PORT_BAND", "0/2")
    assert all(start <= free_port() < start + width for _ in range(50))
