"""The KV lane's UCX options (docs/qos.md): an option this UCX cannot apply is skipped and
reported (stats, /metrics) — or, with ``[transport.traffic_classes.kv] require = true``, the
start is refused naming the option and this UCX, before anything was created."""

from __future__ import annotations

import gc

import pytest
import structlog

from common.config import TrafficClassConfig, TransportConfig
from common.errors import ConfigError, Unavailable
from common.transport import PageTransport

MIB = 1 << 20
CFG = {"staging_bytes": 32 * MIB}
# the wheel's UCX has no verbs: it cannot apply an InfiniBand service level
REJECTED = {"TLS": "tcp,sm,self", "NET_DEVICES": "lo", "IB_SL": "3"}


async def test_unsupported_option_is_skipped_and_reported():
    options = REJECTED
    cfg = TransportConfig(traffic_classes={"kv": TrafficClassConfig(options=options)}, **CFG)
    with structlog.testing.capture_logs() as logs:
        async with PageTransport(cfg, "qos") as t:
            assert t.skipped_options == ["IB_SL"]
            assert t.stats()["ucx_options_skipped"] == 1.0
            assert t.stats()["ucx_option_applied_IB_SL"] == 0.0     # named in stats/metrics
            assert t.stats()["ucx_option_applied_TLS"] == 1.0
            assert t.stats()["ucx_options_required"] == 0.0
            assert t.address[1] > 0
    skipped = [e for e in logs if e["event"] == "ucx_options_skipped"]
    assert len(skipped) == 1 and skipped[0]["options"] == ["IB_SL"]


async def test_the_lanes_options_reach_metrics_by_name():
    from prometheus_client import generate_latest
    from common.metrics import register_source, registry, unregister_source
    options = REJECTED
    cfg = TransportConfig(traffic_classes={"kv": TrafficClassConfig(options=options)}, **CFG)
    async with PageTransport(cfg, "qos") as t:
        register_source("pe_receiver", "qos-m", lambda: {f"transport_{k}": v
                                                         for k, v in t.stats().items()})
        try:
            text = generate_latest(registry().registry).decode()
        finally:
            unregister_source("pe_receiver", "qos-m")
    assert ('dualpath_stat{name="transport_ucx_option_applied_IB_SL",node="qos-m",'
            'service="pe_receiver"} 0.0') in text
    assert 'name="transport_ucx_option_applied_TLS",node="qos-m",service="pe_receiver"} 1.0' \
        in text


async def test_required_option_this_ucx_rejects_refuses_the_start_and_leaks_nothing():
    """``require = true``: the start fails naming the option and this UCX (version, library,
    transports), before any context, worker or listener exists (docs/qos.md)."""
    from ucxx._lib_async.application_context import ApplicationContext
    options = REJECTED
    lane = TrafficClassConfig(options=options, require=True)
    cfg = TransportConfig(traffic_classes={"kv": lane}, **CFG)
    gc.collect()
    contexts = sum(isinstance(o, ApplicationContext) for o in gc.get_objects())
    t = PageTransport(cfg, "qos")
    with pytest.raises(ConfigError) as info:
        await t.start()
    msg = str(info.value)
    assert "transport.traffic_classes.kv.options.IB_SL = '3'" in msg
    assert "require is true" in msg and "UCX 1." in msg and "libucp.so" in msg
    assert "tcp/lo" in msg                       # the transports this UCX has
    with pytest.raises(Unavailable):
        _ = t.address                             # never listened
    await t.stop()
    gc.collect()
    assert sum(isinstance(o, ApplicationContext) for o in gc.get_objects()) == contexts


async def test_a_node_service_whose_required_lane_is_rejected_fails_its_start_cleanly(tmp_path):
    """The service-level face of ``require``: the PE receiver's start raises the ConfigError,
    the service is FAILED, its shared-memory buffer is unlinked, its engine socket never
    opened, and the transport never listened."""
    from services.pe_receiver.service import PEReceiverService
    from tools.cluster.inprocess import _cfg, base_config
    sock = tmp_path / "p0.sock"
    cfg = _cfg(base_config(tmp_path, {
        "transport": {"traffic_classes": {"kv": {"require": True, "options": {
            "TLS": "tcp,sm,self", "NET_DEVICES": "lo", "IB_TRAFFIC_CLASS": "32"}}}},
        "pe_receiver": {"engine_socket": str(sock)}}))
    svc = PEReceiverService(cfg, "p0")
    with pytest.raises(ConfigError, match=r"traffic_classes\.kv\.options\.IB_TRAFFIC_CLASS"):
        await svc.start()
    assert svc.status.value == "failed"
    assert svc.pool.shm is not None and svc.pool.shm.closed
    assert svc.rpc is None and not sock.exists()
    with pytest.raises(Unavailable):
        _ = svc.transport.address
    await svc.stop()


async def test_a_required_option_set_in_the_environment_is_checked_too(monkeypatch):
    """``UCX_IB_SL`` wins over the config, and a UCX without verbs ignores it silently: with
    ``require`` the environment's value is probed like the config's."""
    monkeypatch.setenv("UCX_IB_SL", "2")
    lane = TrafficClassConfig(options=REJECTED, require=True)
    with pytest.raises(ConfigError, match=r"options\.IB_SL = '2'"):
        await PageTransport(TransportConfig(traffic_classes={"kv": lane}, **CFG), "q").start()


async def test_required_options_this_ucx_applies_start_and_are_listed():
    lane = TrafficClassConfig(options={"TLS": "tcp,sm,self", "NET_DEVICES": "lo"},
                              require=True)
    async with PageTransport(TransportConfig(traffic_classes={"kv": lane}, **CFG), "q") as t:
        stats = t.stats()
        assert stats["ucx_options_required"] == 1.0 and stats["ucx_options_skipped"] == 0.0
        assert stats["ucx_option_applied_TLS"] == stats["ucx_option_applied_NET_DEVICES"] == 1.0
