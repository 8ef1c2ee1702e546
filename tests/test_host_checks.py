"""Start-time host checks and the transport-list rule (no namespaces needed; issue #17)."""

from __future__ import annotations

import pytest

from common.config import read_toml
from common.errors import ConfigError
from tools.cluster.config import load_data
from tools.cluster.host_checks import check_storage_root, multi_host, owns_address


def test_the_bare_metal_example_keeps_tcp_for_listener_connections():
    data = read_toml("deploy/cluster-example.toml")
    assert "tcp" in data["transport"]["traffic_classes"]["kv"]["options"]["TLS"].split(",")
    load_data(data, "deploy/cluster-example.toml")                 # passes the check
    data["transport"]["traffic_classes"]["kv"]["options"]["TLS"] = "rc,sm,self"
    with pytest.raises(ConfigError, match="has no tcp: UCX listener connections need it"):
        load_data(data, "bad.toml")


def test_an_address_is_owned_only_when_it_can_be_bound():
    assert owns_address("127.0.0.1") and owns_address("0.0.0.0")
    assert not owns_address("192.0.2.77")          # TEST-NET-1: never on this machine


def test_a_multi_host_cluster_never_creates_its_storage_directory(tmp_path):
    cluster = load_data(read_toml("deploy/cluster-example.toml"), "example.toml")
    assert multi_host(cluster)
    with pytest.raises(ConfigError, match="missing on this host"):
        check_storage_root(cluster, str(tmp_path / "not-mounted"))
    check_storage_root(cluster, str(tmp_path))
    one = load_data(read_toml("configs/local-1p2d.toml"), "local.toml")
    assert not multi_host(one)
    check_storage_root(one, str(tmp_path / "created-later"))     # one machine: created later
