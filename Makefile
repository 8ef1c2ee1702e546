# dualpath — every install step lives here (a fresh machine needs only python3 >= 3.11).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: venv test test-fast demo bench bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: $(STAMP)
	$(VENV)/bin/dualpath demo

bench: $(STAMP)
	mkdir -p results
	$(VENV)/bin/dualpath bench transport --out results/transport.json
	$(VENV)/bin/dualpath bench scheduler --out results/scheduler.json

bench-quick: $(STAMP)
	mkdir -p results
	$(VENV)/bin/dualpath bench transport --quick --out results/transport-quick.json
	$(VENV)/bin/dualpath bench scheduler --quick --out results/scheduler-quick.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis results data
