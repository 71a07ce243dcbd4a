# Two targets do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench torture clean test-pure test-package test-native test-macos

# The Python paths (no native helpers: an install without a C compiler) on every
# `make test`: the tests of hashing, the read path and restore exactness (~60 s).
PURE_TESTS := tests/test_hashing.py tests/test_files.py tests/test_bank.py \
	tests/test_states.py tests/test_bank_corruption.py tests/test_native_paths.py \
	tests/test_device_copy.py \
	tests/test_runtime_exact.py::test_restores_read_from_payload_files_are_exact \
	tests/test_runtime_exact.py::test_next_turn_restores_all_but_the_tail_exactly

$(STAMP): pyproject.toml setup.py $(shell find cas_bank/_native -type f)
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

# The suite on up to four worker processes (pytest-xdist; two on a 2-core machine:
# 6:31 there against 9:26 on one). Each test keeps its own bank, ports and servers.
test: lint
	$(BIN)/pytest -q -n auto --maxprocesses=4
	$(MAKE) --no-print-directory test-pure

test-pure: $(STAMP)
	CAS_BANK_PURE_PYTHON=1 $(BIN)/pytest -q $(PURE_TESTS)

# The native helpers' C test (tests/native/): built for this machine and, where the
# tools are (Debian's gcc-aarch64-linux-gnu, qemu-user-static; .ci/run installs them),
# for aarch64 and for x86-64 CPUs without AVX2, run under qemu-user.
test-native: $(STAMP)
	$(BIN)/python tests/native/build.py build/native $(NATIVE_FLAGS)

# The native helpers compiled for macOS, arm64 and x86-64, against macOS's headers with
# setup.py's flags (zig's clang from the dev extra's ziglang): compile only, no Mac needed.
test-macos: $(STAMP)
	$(BIN)/python tests/native/macos.py build/macos

# The package as users install it: sdist and wheel built, installed into a fresh
# virtualenv, run from outside the checkout (CI runs it: .ci/run).
test-package: $(STAMP)
	$(BIN)/pytest -q -m slow tests/test_packaging.py

# The fault campaign (not part of `make test`): SIGKILL, byte flips, truncations, ENOSPC.
torture: $(STAMP)
	$(BIN)/python tests/torture.py --seconds $${TORTURE_SECONDS:-180}

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) build dist *.egg-info
