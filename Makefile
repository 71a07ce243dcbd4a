# Two targets do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench torture clean

$(STAMP): pyproject.toml setup.py $(wildcard cas_bank/_native/*.c cas_bank/_native/blake3/* cas_bank/_native/xxhash/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/cas-bank demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python scripts/check_imports.py

test: lint
	$(BIN)/pytest -q

# The fault campaign (not part of `make test`): SIGKILL, byte flips, truncations, ENOSPC.
torture: $(STAMP)
	$(BIN)/python tests/torture.py --seconds $${TORTURE_SECONDS:-180}

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info
