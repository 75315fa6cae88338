# The README's commands. The venv is rebuilt from scratch whenever pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= python3
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
	$(PY) -m pip install -q -e '.[dev]'
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
