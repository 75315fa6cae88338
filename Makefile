# The README's commands. The venv is rebuilt from scratch whenever pyproject.toml changes. pip does not
# byte-compile what it installs (--no-compile): of the ~22,000 modules (torch's, transformers' ~400
# model families) a run imports a few thousand, which Python compiles and caches on their first import;
# compiling them all cost ~70 CPU-s of `make setup`. That cache is written only where
# PYTHONDONTWRITEBYTECODE is unset (some shells set it): with it set, every process of a run (each Ray
# worker imports torch, transformers, Ray and mmserve) compiles again each module it imports that has
# no cached bytecode, mmserve's own always on a fresh clone (docs/testing.md, "CI's setup").
SHELL := /bin/bash
PYTHON ?= python3
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-$(shell sha256sum pyproject.toml | cut -c1-16)
PYTEST_ARGS ?= --durations=25
BENCH_ARGS ?=

.PHONY: setup serve test test-fast lint bench

$(STAMP): pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	touch $@

setup: $(STAMP)

serve: setup
	$(VENV)/bin/mmserve serve

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# The unit tests without the slow ones (over 10 s each): no Ray, a few minutes.
test-fast: lint
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) -m "not slow" tests/unit; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

bench: setup
	$(PY) -m cluster.bench $(BENCH_ARGS)

# Coverage-guided fuzzing (cluster/bench/fuzz): each target for FUZZ_SECONDS, then a table.
FUZZ_SECONDS ?= 600
.PHONY: fuzz
fuzz: setup
	$(PY) -m cluster.bench.fuzz --all --seconds $(FUZZ_SECONDS)

# The chaos tier (tests/integration/chaos: node loss, kills during scale-up and overlap prefill, a head
# restart with GCS fault tolerance, E/P/D's prefill, decode and hand-off kills, E/P/D's pools on three
# nodes scaled by their own bursts): minutes each, deselected from `make test` by pyproject's addopts.
# The head-restart test needs redis-server (Debian: apt-get install -y redis-server).
.PHONY: chaos
chaos: setup
	@command -v redis-server >/dev/null || { echo "installing redis-server (GCS fault tolerance)"; \
	  apt-get update -qq && apt-get install -y -qq redis-server; }
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) -m chaos tests/integration/chaos; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc
