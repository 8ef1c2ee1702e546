"""Typed configuration: TOML files in ``configs/`` → frozen msgspec Structs, env overlay on top.

One loader for every service (no second loader with its own defaults); the caller names the
root class (``tools.config.DualpathConfig`` for a whole host file). Unknown keys are
rejected at start with the key's full path, e.g. ``unknown field `tlss` at $.transport.kv``.

Environment overlay: ``DUALPATH__SECTION__KEY=value`` sets ``[section] key = value``; the value
is parsed as a TOML value when it parses (numbers, booleans, arrays, quoted strings), else it is
taken as a bare string. Example: ``DUALPATH__RPC__MAX_FRAME_BYTES=1048576``.
"""

from __future__ import annotations

import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from common.errors import ConfigError

ENV_PREFIX = "DUALPATH__"

# Declared field constraints (docs/contributing.md, 'Declare, don't check by hand'): msgspec checks
# them when a file or dict is decoded (build_config / load_config) and names the key, e.g.
# "Expected `int` >= 1 - at `$.pe_receiver.engines`". A direct constructor call does not check
# them: code that builds a section from outside input goes through build_config.
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]    # NaN fails too
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
# msgspec takes no infinite bound; the largest finite float keeps inf out (TOML can write inf)
FinitePositiveFloat = Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]
FiniteNonNegFloat = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]      # 0: any free port
Device = Literal["host", "cuda"]                          # numpy host memory | cupy (extra "gpu")


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: immutable, typos rejected."""


class LoggingConfig(Section, frozen=True):
    """``[logging]``: the level and format of a service's log, and its loop watch.

    ``loop_stall_s``: a ``dualpath serve`` process logs ``event_loop_blocked`` with its event
    loop's stack when the loop has not run for this long, and ``event_loop_resumed`` with the
    stall's length (``tools/cluster/loop_watch.py``; 0: no watch). A node whose loop stands
    still misses its heartbeats and loses its lease; the stack names the code that held it.
    ``loop_stall_dump_s``: once a stall lasts this long, every thread's Python stack goes to
    the log (stderr) *during* the stall, even when the loop holds the GIL in a C call (0: no
    dump). Why the defaults: 1 s is a fifth of a node's lease (``[scheduler_service] lease_s``
    = 5 s) and far above any callback this code means to run; 10 s is past that lease, so a
    dump comes only for a stall long enough to have cost a node its lease."""

    level: str = "info"
    json: bool | None = None  # None: JSON when stderr is not a TTY
    loop_stall_s: FiniteNonNegFloat = 1.0
    loop_stall_dump_s: FiniteNonNegFloat = 10.0


class RpcConfig(Section, frozen=True):
    """Control-plane RPC limits (msgspec msgpack over TCP, length-prefixed frames)."""

    host: str = "127.0.0.1"
    max_frame_bytes: int = 4 * 1024 * 1024
    max_inflight_calls: int = 256          # per connection; above → OVERLOADED
    send_queue_frames: int = 1024          # per connection outbound queue bound
    stream_queue_items: int = 1024         # per server-push stream
    default_deadline_s: float = 30.0
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    reconnect_initial_s: float = 0.05
    reconnect_max_s: float = 5.0
    reconnect_attempts: int = 20           # 0 = try forever
    use_uvloop: bool = True
    auth_secret_file: str | None = None    # shared secret for challenge/response in the hello
    auth_secret_env: str | None = None
    # TLS (common/tls.py): on when a certificate or CA is set; empty = plaintext.
    tls_cert_file: str | None = None       # this process's certificate (PEM), served/presented
    tls_key_file: str | None = None        # its private key (PEM)
    tls_ca_file: str | None = None         # CA that signs peers' certificates; unset: system
    tls_require_client_cert: bool = False  # servers refuse clients without a CA-signed cert
    tls_server_name: str | None = None     # name checked in servers' certs; unset: the host


class TrafficClassConfig(Section, frozen=True):
    """UCX options of one traffic class (``UCX_`` prefix omitted), e.g. the low-priority KV lane.

    ``IB_SL`` / ``IB_TRAFFIC_CLASS`` put KV on a lower InfiniBand service level or RoCE class
    than the model's collectives. Options the UCX build cannot apply are reported once and
    skipped, unless ``require``: then the service refuses to start, naming the option and the
    UCX that rejected it, so KV never silently shares the collectives' lane (docs/qos.md,
    "Requiring the lane"). ``require`` is off by default because the PyPI UCX has no verbs:
    with it on, no service could start on a host with the wheel alone.
    """

    options: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)
    require: bool = False

    def ucx_options(self) -> dict[str, str]:
        """Options as UCX wants them: upper-case names, string values (booleans as y/n)."""
        def text(v: object) -> str:
            return ("y" if v else "n") if isinstance(v, bool) else str(v)
        return {k.upper(): text(v) for k, v in self.options.items()}


def _default_traffic_classes() -> dict[str, TrafficClassConfig]:
    return {"kv": TrafficClassConfig(options={"TLS": "tcp,sm,self", "NET_DEVICES": "lo"})}


class TransportConfig(Section, frozen=True):
    """UCX page transport. Defaults measured on 2-core loopback hosts (docs/performance.md)."""

    host: str = "127.0.0.1"
    port: int = 0
    traffic_classes: dict[str, TrafficClassConfig] = msgspec.field(
        default_factory=_default_traffic_classes)
    kv_class: str = "kv"
    max_message_bytes: int = 16 * 1024 * 1024   # coalesced runs are cut at this size
    pack_below_bytes: int = 256 * 1024          # smaller non-contiguous runs are packed
    staging_bytes: int = 64 * 1024 * 1024       # gather/scatter staging per transport
    max_inflight_messages: int = 64             # per transfer
    connect_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    shared_memory: bool = True                  # sets UCX_{POSIX,SYSV}_ERROR_HANDLING=y
    # same-host links: "shm" = the sender copies pages straight into the receiver's /dev/shm
    # arena (one copy, docs/datapath.md "Same host: one copy"); "ucx" = UCX tag messages only
    same_host: Literal["shm", "ucx"] = "shm"
    # how pages cross the other links (docs/datapath.md "One-sided RMA"): "tag" = UCX tag
    # messages; "rma" = the sender puts them straight into the receiver's registered arena
    # (one-sided, one commit message per transfer) wherever both ends offer it; "auto" = rma
    # where both ends' KV lane can use verbs (real one-sided DMA), tag elsewhere
    kv_mode: Literal["tag", "rma", "auto"] = "auto"


class BufferConfig(Section, frozen=True):
    """A preallocated host page pool (PE buffer, DE buffer, staging)."""

    page_bytes: int = 256 * 1024
    num_pages: int = 1024
    device: Device = "host"                     # "host" (numpy) or "cuda" (cupy, lazily)


class KVConfig(Section, frozen=True):
    """The model's KV layout; ``preset`` names one in ``common.kv.PRESETS``."""

    preset: str = "test-small"
    num_layers: int | None = None
    kv_bytes_per_token_per_layer: int | None = None
    block_tokens: int | None = None
    dtype: str | None = None


class CommonConfig(Section, frozen=True):
    """The sections every process reads. Each layer's root extends the one below it —
    ``storage_gateway.config.GatewayNodeConfig`` → ``services.config.ServicesConfig`` →
    ``tools.config.DualpathConfig`` — so one file per host serves every service on it, and
    ``common`` never imports a layer above it."""

    kv: KVConfig = msgspec.field(default_factory=KVConfig)
    rpc: RpcConfig = msgspec.field(default_factory=RpcConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    buffers: BufferConfig = msgspec.field(default_factory=BufferConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)


T = TypeVar("T", bound=msgspec.Struct)


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def env_overlay(data: dict[str, Any], environ: Mapping[str, str] | None = None,
                prefix: str = ENV_PREFIX) -> dict[str, Any]:
    """Return ``data`` with every ``PREFIX__A__B=v`` applied as ``data[a][b] = v``."""
    env = os.environ if environ is None else environ
    out = _deep_copy(data)
    for key, raw in sorted(env.items()):
        if not key.startswith(prefix):
            continue
        path = [p.lower() for p in key[len(prefix):].split("__") if p]
        if not path:
            continue
        node = out
        for part in path[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"environment variable {key}: {part!r} is not a section")
            node = nxt
        node[path[-1]] = _parse_env_value(raw)
    return out


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def build_config(data: dict[str, Any], cls: type[T], source: str = "config",
                 environ: dict[str, str] | None = None) -> T:
    """Validate a dict (from TOML or built in code) into ``cls``; errors name the key."""
    data = env_overlay(data, environ)
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from e


def load_config(path: str | os.PathLike[str] | None, cls: type[T],
                environ: dict[str, str] | None = None) -> T:
    """Load ``path`` (TOML) into ``cls``; ``None`` gives the embedded defaults + env overlay."""
    if path is None:
        return build_config({}, cls, "defaults", environ)
    return build_config(read_toml(path), cls, str(path), environ)


def read_toml(path: str | os.PathLike[str], what: str = "config file") -> dict[str, Any]:
    """The TOML document at ``path``; a missing or malformed file is a ConfigError naming it."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"{what} not found: {p}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from e
