"""The real-engine runbook (docs/vllm.md "Runbook") is what the code renders and what the
tests run: its command lines equal ``tools.vllm_serve.runbook()`` (built from the argv the
real-engine tests start), every JSON in the doc parses, its cluster file renders each node with
an engine socket and the instances' fp32 preset, and (vLLM venv present) vLLM's own parser
accepts the vLLM lines."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tools.cluster import serve
from tools.cluster.config import engine_socket_path, load_cluster, service_config
from tools.vllm_engines import DTYPE, PRESET, REPO, VLLM_PYTHON
from services.compute_model.batching import vllm_budget
from services.compute_model.cost_model import cost_model
from tools.vllm_serve import RUNBOOK_CONFIG, VLLM_PORTS, runbook, step_tokens, vllm_server_argv

DOC = REPO / "docs" / "vllm.md"


def doc_runbook_block() -> str:
    text = DOC.read_text()
    section = text[text.index("## Runbook"):]
    section = section[:section.index("\n## ", 1)]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S)
              if b.startswith("dualpath serve scheduler")]
    assert len(blocks) == 1, blocks
    return blocks[0]


def lines(kind: str) -> list[str]:
    return [ln for ln in runbook().splitlines() if kind in ln]


def test_the_doc_shows_exactly_what_the_renderer_renders():
    assert doc_runbook_block() == runbook(), "rerun `python -m tools.vllm_serve` into the doc"


def test_every_json_of_the_doc_parses():
    text = DOC.read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, re.S)
    assert blocks
    for b in blocks:
        json.loads(b)
    configs = [w for ln in text.splitlines() if "--kv-transfer-config" in ln
               for w in _after(shlex.split(ln.replace("$MODEL", "M")), "--kv-transfer-config")]
    assert len(configs) == 2
    roles = {json.loads(c)["kv_role"] for c in configs}
    assert roles == {"kv_producer", "kv_consumer"}


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, w in enumerate(argv) if w == flag]


def test_the_runbooks_vllm_lines_are_the_tests_argv():
    """Same argv as tools/vllm_serve.vllm_server (what the real-engine tests start), with the
    fp32 dtype and preset the equality tests need, vLLM's default prefix caching (on: no flag
    turns it off) and chunked prefill at the paper's quota mapped by batching.vllm_budget."""
    loaded = load_cluster(REPO / RUNBOOK_CONFIG, environ={})
    spec = loaded.spec
    budget = vllm_budget(cost_model(loaded.cfg.scheduler.model).attention_s,
                         loaded.cfg.scheduler.ref_context_tokens)["max_num_batched_tokens"]
    step = min(budget, 2048)                    # at most --max-model-len
    vllm = lines("vllm.entrypoints.openai.api_server")
    assert len(vllm) == len(spec.nodes) == 2
    for ln, n in zip(vllm, spec.nodes, strict=True):
        argv = shlex.split(ln.replace("$MODEL", "M"))
        argv = argv[next(i for i, w in enumerate(argv) if w.endswith("/python")):]
        sock = str(spec.state_dir() / f"{n.id}.engine.sock")
        assert argv == vllm_server_argv(".venv-vllm/bin/python", "M", n.role, sock,
                                        f"{n.id}.e0", VLLM_PORTS[n.role], step=step_tokens(
                                            loaded.cfg))
        assert _after(argv, "--dtype") == [DTYPE]
        assert not any("prefix-caching" in w for w in argv)
        assert "--enable-chunked-prefill" in argv and _after(argv, "--max-model-len") == ["2048"]
        assert (_after(argv, "--max-num-batched-tokens")
                == _after(argv, "--long-prefill-token-threshold") == [str(step)])
        extra = json.loads(_after(argv, "--kv-transfer-config")[0])["kv_connector_extra_config"]
        assert extra["kv_preset"] == PRESET
    front = lines("integrations.vllm.front")
    assert len(front) == 1
    assert f"--scheduler 127.0.0.1:{spec.scheduler_port}" in front[0]


def test_the_runbook_config_gives_each_node_an_engine_socket():
    """configs/vllm-1p1d.toml: the preset the instances serve, one engine per node on the
    node's socket (the path each vLLM line names, resolved from the repository root), fixed
    ports, and every `dualpath serve` line of the runbook loads with it."""
    c = load_cluster(REPO / RUNBOOK_CONFIG, environ={})
    assert c.spec.shape == "1P1D" and c.spec.remote_engines
    assert c.cfg.kv.preset == PRESET
    assert c.spec.scheduler_port and all(n.gateway_port and n.rpc_port for n in c.spec.nodes)
    socks = {json.loads(_after(shlex.split(ln.replace("$MODEL", "M")), "--kv-transfer-config")[0])
             ["kv_connector_extra_config"]["engine_socket"]
             for ln in lines("--kv-transfer-config")}
    for n in c.spec.nodes:
        svc = "pe_receiver" if n.role == "prefill" else "de_loader"
        section = getattr(service_config(c, svc, n.id), svc)
        assert section.engines == 1
        assert section.engine_socket == engine_socket_path(c, n.id)
        assert Path(section.engine_socket).relative_to(REPO.resolve()).as_posix() in socks
    for ln in lines("dualpath serve"):
        argv = shlex.split(ln)[2:]
        target = serve.load_target(str(REPO / argv[argv.index("-c") + 1]), None)
        node = argv[argv.index("--node") + 1] if "--node" in argv else None
        assert target.config(target.service(argv[0], node), node) is not None


@pytest.mark.vllm
@pytest.mark.vllm_light
@pytest.mark.slow
def test_vllms_own_parser_accepts_the_runbooks_vllm_lines():
    """`python -m vllm.entrypoints.openai.api_server` with these arguments gets past argument
    parsing and vLLM's serve-args validation (the connector config included)."""
    if not VLLM_PYTHON.exists():
        from tests.vllm_env import skip_or_fail
        skip_or_fail(f"{VLLM_PYTHON} missing")
    out = subprocess.run([str(VLLM_PYTHON), str(REPO / "tests" / "vllm_checks" /
                                                 "runbook_args_check.py")],
                         input="\n".join(lines("vllm.entrypoints.openai.api_server")),
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert [(p["kv_role"], p["dtype"], p["enable_prefix_caching"] is not False,
             p["enable_chunked_prefill"]) for p in parsed] == [
        ("kv_producer", DTYPE, True, True), ("kv_consumer", DTYPE, True, True)]
    assert {p["extra"]["kv_preset"] for p in parsed} == {PRESET}
