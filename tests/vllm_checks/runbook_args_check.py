"""Parse each vLLM command line of the runbook (stdin, one per line) with vLLM's own server
parser and its serve-args validation, as ``python -m vllm.entrypoints.openai.api_server``
would at start; prints ``RESULT {json}`` with what it parsed. Run by
tests/test_vllm_runbook.py in the vLLM venv."""

from __future__ import annotations

import json
import shlex
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    parsed = []
    for line in sys.stdin.read().splitlines():
        argv = shlex.split(line.replace("$MODEL", "/nonexistent/model"))
        argv = argv[argv.index("vllm.entrypoints.openai.api_server") + 1:]
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(ns)
        ktc = ns.kv_transfer_config
        parsed.append({"dtype": ns.dtype, "enable_prefix_caching": ns.enable_prefix_caching,
                       "enable_chunked_prefill": ns.enable_chunked_prefill,
                       "kv_role": ktc.kv_role, "kv_connector": ktc.kv_connector,
                       "extra": ktc.kv_connector_extra_config, "port": ns.port})
    print("RESULT " + json.dumps(parsed), flush=True)


if __name__ == "__main__":
    main()
