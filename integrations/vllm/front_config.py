"""The front's configuration: :class:`FrontConfig`, its command line (:func:`parse_args`) and
the scheduler client it builds from them (:func:`scheduler_client`) — apart from the server
(``integrations/vllm/front.py``), which only reads a built config.

``python -m integrations.vllm.front --help`` lists every flag; docs/vllm.md "The front".
"""

from __future__ import annotations

import argparse
from typing import Annotated

import msgspec

from common.auth import load_secret
from common.config import RpcConfig
from integrations.vllm import openai_api as api
from services.scheduler.client.client import SchedulerClient
from services.scheduler.client.leader import LeaderResolver
from services.scheduler.service_config import EtcdConfig

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]


class FrontConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the scheduler and the engines are, and the limits the front states."""

    model_name: str
    tokenizer: str
    scheduler_host: str
    scheduler_port: int
    engines: dict[str, str]                   # dualpath engine id -> vLLM base URL
    host: str = "127.0.0.1"
    port: int = 0
    max_prompt_tokens: PositiveInt = 2000
    max_tokens: PositiveInt = 512
    max_inflight: PositiveInt = 64
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    # after an engine call failed: how long a re-plan or the outcome may still come
    engine_failure_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    # after vLLM's whole output: how long the outcome (write-back durable) is waited for;
    # above the nodes' writeback_timeout_s (30 s) + a report, so a slow write-back completes
    finish_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    recompute_engine: str = ""                # kv_loading=false goes here ("" = first engine)
    auth_secret_file: str = ""                # the scheduler's rpc.auth_secret_file, if set
    etcd_endpoints: list[str] = []            # find the scheduler leader there (etcd mode)
    etcd_prefix: str = "/dualpath"
    api_key: str = ""                         # clients send it as a Bearer token
    api_key_file: str = ""                    # ... or read from here (preferred: not in `ps`)
    rpc_tls_ca_file: str = ""                 # the scheduler's RPC over TLS (rpc.tls_*)
    rpc_tls_cert_file: str = ""               # our certificate, when it requires one
    rpc_tls_key_file: str = ""
    # log the stack that held the front's event loop this long (0: no watch): a stalled front
    # holds every client's stream (tools/cluster/loop_watch.py, as every dualpath serve process)
    loop_stall_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0


def scheduler_client(cfg: FrontConfig) -> SchedulerClient:
    """The scheduler's frontend client: the static address, or the etcd-elected leader
    (resolved before every connection, so a leader change is followed), with the RPC
    secret when the cluster sets ``rpc.auth_secret_file``."""
    secret = (load_secret(RpcConfig(auth_secret_file=cfg.auth_secret_file))
              if cfg.auth_secret_file else None)
    resolve = (LeaderResolver(EtcdConfig(endpoints=cfg.etcd_endpoints, prefix=cfg.etcd_prefix))
               if cfg.etcd_endpoints else None)
    rpc = RpcConfig(tls_ca_file=cfg.rpc_tls_ca_file or None,
                    tls_cert_file=cfg.rpc_tls_cert_file or None,
                    tls_key_file=cfg.rpc_tls_key_file or None)
    return SchedulerClient(cfg.scheduler_host, cfg.scheduler_port, client_id="front",
                           rpc=rpc, auth_secret=secret, resolve=resolve)


def parse_args(argv: list[str] | None = None) -> FrontConfig:
    ap = argparse.ArgumentParser(description="dualpath's OpenAI-compatible front for vLLM")
    ap.add_argument("--model-name", required=True, help="the name clients ask for")
    ap.add_argument("--tokenizer", required=True, help="model directory (vLLM's --model)")
    ap.add_argument("--scheduler", required=True, help="HOST:PORT of the dualpath scheduler")
    ap.add_argument("--engine", action="append", default=[], metavar="ID=URL",
                    help="a dualpath engine id and its vLLM base URL (repeat)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-prompt-tokens", type=int, default=2000)
    ap.add_argument("--request-timeout-s", type=float, default=300.0,
                    help="each request's dualpath deadline (and the HTTP calls' to vLLM)")
    ap.add_argument("--engine-failure-grace-s", type=float, default=10.0,
                    help="after a vLLM call failed, how long a re-plan may still come before "
                         "the failure is answered (502) and the request cancelled")
    ap.add_argument("--finish-grace-s", type=float, default=60.0,
                    help="after vLLM's whole output, how long dualpath's outcome (the turn's "
                         "write-back durable) is waited for before the output is served")
    ap.add_argument("--recompute-engine", default="",
                    help="engine id for requests with kv_loading=false (default: the first)")
    ap.add_argument("--auth-secret-file", default="",
                    help="the cluster's rpc.auth_secret_file (scheduler RPC authentication)")
    ap.add_argument("--etcd", default="", metavar="HOST:PORT[,...]",
                    help="etcd endpoints: connect to the elected scheduler leader, following "
                         "leader changes (--scheduler is then only the first guess)")
    ap.add_argument("--etcd-prefix", default="/dualpath", help="the cluster's [etcd] prefix")
    ap.add_argument("--api-key", default="",
                    help="clients must send 'Authorization: Bearer KEY' on /v1/*")
    ap.add_argument("--api-key-file", default="", help="the same key, read from a file")
    ap.add_argument("--loop-stall-s", type=float, default=1.0,
                    help="log the stack that held the front's event loop this long (0: off)")
    for what in ("ca", "cert", "key"):
        ap.add_argument(f"--rpc-tls-{what}-file", default="",
                        help=f"the cluster's rpc.tls_{what}_file (scheduler RPC over TLS)")
    a = ap.parse_args(argv)
    try:                      # a bad key file stops the front here, before the model loads
        api.load_api_key(a.api_key, a.api_key_file)
    except ValueError as e:
        ap.error(str(e))
    host, _, port = a.scheduler.rpartition(":")
    engines = dict(e.split("=", 1) for e in a.engine)
    if a.recompute_engine and a.recompute_engine not in engines:
        ap.error(f"--recompute-engine {a.recompute_engine!r} is not one of --engine "
                 f"{sorted(engines)}")
    return msgspec.convert({"model_name": a.model_name, "tokenizer": a.tokenizer,
                            "scheduler_host": host, "scheduler_port": int(port),
                            "engines": engines, "host": a.host, "port": a.port,
                            "max_prompt_tokens": a.max_prompt_tokens,
                            "request_timeout_s": a.request_timeout_s,
                            "engine_failure_grace_s": a.engine_failure_grace_s,
                            "finish_grace_s": a.finish_grace_s,
                            "recompute_engine": a.recompute_engine,
                            "auth_secret_file": a.auth_secret_file,
                            "etcd_endpoints": [e for e in a.etcd.split(",") if e],
                            "etcd_prefix": a.etcd_prefix, "api_key": a.api_key,
                            "api_key_file": a.api_key_file,
                            "rpc_tls_ca_file": a.rpc_tls_ca_file,
                            "rpc_tls_cert_file": a.rpc_tls_cert_file,
                            "rpc_tls_key_file": a.rpc_tls_key_file,
                            "loop_stall_s": a.loop_stall_s}, FrontConfig)
