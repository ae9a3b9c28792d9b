# The README's two commands are the contract: `make demo` and `make test`, each on a fresh machine.
# Builds of the real parts (Kubernetes control plane, llama.cpp) are cached outside the clone
# under $(CONTINUUM_CACHE), so a warm `make test` only re-runs the tests.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export CONTINUUM_CACHE ?= $(HOME)/.cache/continuum
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
PHASE := tools/phase
export CONTINUUM_PHASE_LOG ?= /tmp/continuum-phases-$(shell date +%s%N)

.PHONY: test demo venv install toolchain images lint unit e2e crds crds-check bench clean

test:
	@$(PHASE) toolchain $(MAKE) --no-print-directory toolchain
	@$(PHASE) install $(MAKE) --no-print-directory install
	@$(PHASE) images $(MAKE) --no-print-directory images
	@$(PHASE) lint $(MAKE) --no-print-directory lint
	@$(PHASE) unit $(MAKE) --no-print-directory unit
	@$(PHASE) e2e $(MAKE) --no-print-directory e2e
	@tools/phase --summary

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# The llama-cpp-python wheel comes from tools/llama's cache (built once per machine).
install: venv
	tools/llama install $(PY)

toolchain:
	tools/cluster build
	tools/llama build

lint: venv
	$(VENV)/bin/ruff check operator tests bench tools
	$(VENV)/bin/ruff format --check operator tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# --durations: the slowest tests named in every run, to keep a warm `make test` under 30 minutes.
unit: venv
	$(VENV)/bin/pytest -q --durations=15 -m 'not e2e' tests

# The chart's images for the real node's tests (tools/images: cached by a digest of their inputs,
# so they are built again only when the package, a Dockerfile or llama.cpp changed).
images:
	tools/images build

e2e: venv images
	$(VENV)/bin/pytest -q --durations=30 -m e2e tests

# The chart carries byte-for-byte copies of crds/ (tests/unit/project/test_chart.py checks the drift).
crds: venv
	$(PY) -m continuum_operator.model.crdgen crds
	cp crds/*.yaml charts/continuum/files/crds/

crds-check: venv
	$(PY) -m continuum_operator.model.crdgen --check crds

# Benchmarks print figures; none is a pass/fail gate. estimate.py and gateway.py need llama.cpp.
bench: install
	$(PY) bench/plan.py
	$(PY) bench/grants.py
	$(PY) bench/cache_memory.py
	$(PY) bench/unschedulable.py
	$(PY) bench/agent.py
	$(PY) bench/estimate.py
	$(PY) bench/gateway.py
	$(PY) bench/reconcile.py
	@# The operator at scale, small here (about 2 minutes); docs/performance.md has the full size.
	$(PY) bench/scale.py --nodes 20 --engines 40 --minds 200 --burst 100 --rest 10 --churn 10
	@# Exits 1 when the contention was not real in that run, 2 when the target was missed:
	@# a figure to read, not a gate.
	-$(PY) bench/contention.py

demo: toolchain install images
	tools/demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
