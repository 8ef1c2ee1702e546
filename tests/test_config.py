"""Config loading: TOML → frozen Structs, unknown keys named, env overlay."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from common.config import build_config, env_overlay, load_config
from tools.config import DualpathConfig
from common.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_defaults_load_without_a_file():
    cfg = load_config(None, DualpathConfig, environ={})
    assert cfg.rpc.host == "127.0.0.1"
    assert cfg.transport.traffic_classes["kv"].options["TLS"] == "tcp,sm,self"


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[transport]\nmax_mesage_bytes = 5\n")
    with pytest.raises(ConfigError, match="max_mesage_bytes") as e:
        load_config(p, DualpathConfig, environ={})
    assert "transport" in str(e.value)


def test_unknown_section_is_named(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[rpcc]\nhost = '1'\n")
    with pytest.raises(ConfigError, match="rpcc"):
        load_config(p, DualpathConfig, environ={})


def test_wrong_type_names_the_key(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[rpc]\nmax_frame_bytes = 'big'\n")
    with pytest.raises(ConfigError, match=r"max_frame_bytes"):
        load_config(p, DualpathConfig, environ={})


def test_bad_toml_and_missing_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[rpc\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p, DualpathConfig, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", DualpathConfig, environ={})


def test_env_overlay_parses_values_and_wins_over_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[rpc]\nmax_frame_bytes = 100\n")
    env = {"DUALPATH__RPC__MAX_FRAME_BYTES": "2048", "DUALPATH__RPC__USE_UVLOOP": "false",
           "DUALPATH__TRANSPORT__TRAFFIC_CLASSES__KV__OPTIONS__IB_SL": "3",
           "DUALPATH__LOGGING__LEVEL": "debug", "OTHER": "x"}
    cfg = load_config(p, DualpathConfig, environ=env)
    assert cfg.rpc.max_frame_bytes == 2048 and cfg.rpc.use_uvloop is False
    assert cfg.logging.level == "debug"
    assert cfg.transport.traffic_classes["kv"].ucx_options() == {"IB_SL": "3"}


def test_env_overlay_typo_is_rejected():
    with pytest.raises(ConfigError, match="max_fram"):
        build_config({}, DualpathConfig, environ={"DUALPATH__RPC__MAX_FRAM": "1"})


def test_env_overlay_cannot_descend_into_a_value():
    with pytest.raises(ConfigError):
        env_overlay({"rpc": {"host": "x"}}, {"DUALPATH__RPC__HOST__X": "1"})


def test_config_is_frozen():
    cfg = load_config(None, DualpathConfig, environ={})
    with pytest.raises(AttributeError):
        cfg.rpc = None  # type: ignore[misc]


# ``sim-*.toml`` are simulator configs and ``local-*.toml`` / ``vllm-*.toml`` cluster configs
# (a ``[cluster]`` section on top of the service sections); each has its own loader and tests.
SERVICE_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.toml")
                         if not p.name.startswith(("sim-", "local-", "vllm-")))


@pytest.mark.parametrize("path", SERVICE_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    """Every plain service config shipped loads with the shared root."""
    cfg = load_config(path, DualpathConfig, environ={})
    assert isinstance(cfg, DualpathConfig)
    assert msgspec.to_builtins(cfg)


def test_etcd_step_down_shorter_than_the_lease_is_refused():
    from services.config import ServicesConfig
    with pytest.raises(ConfigError, match="step_down_s"):
        build_config({}, ServicesConfig, environ={"DUALPATH__ETCD__LEASE_S": "5",
                                                  "DUALPATH__ETCD__STEP_DOWN_S": "3"})
    cfg = build_config({}, ServicesConfig, environ={"DUALPATH__ETCD__STEP_DOWN_S": "30"})
    assert cfg.etcd.step_down_s == 30.0
