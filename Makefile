# dualpath — every install step lives here (a fresh machine needs only python3 >= 3.11).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: venv lint test test-fast test-chaos demo bench bench-quick reliability sim-accel clean etcd

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# ruff, mypy (files in pyproject's [tool.mypy]) and the import-linter layering contracts; all
# three run, each failure is named, and any failure fails the target (.ci/run runs it first)
lint: $(STAMP)
	@rc=0; \
	echo "== ruff check"; $(VENV)/bin/ruff check . || { echo "lint FAILED: ruff check" >&2; rc=1; }; \
	echo "== mypy"; $(VENV)/bin/mypy || { echo "lint FAILED: mypy" >&2; rc=1; }; \
	echo "== lint-imports"; $(VENV)/bin/lint-imports --no-logo \
		|| { echo "lint FAILED: lint-imports (import-linter contracts)" >&2; rc=1; }; \
	exit $$rc

test: $(STAMP)
	$(PY) -m pytest -q

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
BENCHES += engine_ipc

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
	@etcd --version | head -1

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis results data

# Namespace hosts (tests/test_hosts_netns.py, `dualpath bench multihost`): ip (iproute2) and
# unshare/nsenter/mount (util-linux) from Debian. Needs root or sudo; the tests need root.
netns-tools:
	@command -v ip >/dev/null && command -v nsenter >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq iproute2 util-linux; }
	@ip -V
