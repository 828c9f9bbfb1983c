# The user's entry points. Each target installs what it needs (idempotently),
# configures and builds before it runs.
SHELL := /bin/bash
JOBS ?= $(shell nproc)
PRESET ?= release
BUILD := build/$(PRESET)

.PHONY: setup build test test-core test-sanitizers test-no-toolkit fuzz bench run run-ray gpu-check install clean

setup:
	@bash scripts/setup.sh

build: setup
	@cmake --preset $(PRESET) >/dev/null
	@cmake --build --preset $(PRESET) -j $(JOBS)

# Every test: the C++ suites (ctest, the C ABI's included), the installed package, the Python suite, then the
# Rust crate over the C ABI.
test: build
	@ctest --preset $(PRESET) -j $(JOBS) --output-on-failure
	@BUILD=$(BUILD) bash scripts/check-install.sh
	@bash scripts/python-tests.sh
	@bash scripts/rust-tests.sh

# The core, conformance, checkpoint-reader and C ABI suites under AddressSanitizer+UBSan and ThreadSanitizer
# (the core suite includes the state-machine test against the reference model).
# A test that fails runs up to twice more: LeakSanitizer's exit-time tracer can
# crash on PoCL's driver threads ("Tracer caught signal 11") without any
# finding, and did twice in a row for one OpenCL test under a loaded CI run; a
# real failure fails three times. The sanitizer presets build at -O1 with line tables
# only (-g1): what the sanitizers recommend, at half the compile time of -O2 -g.
SANITIZED_TESTS := devbridge_core_tests devbridge_conformance_tests devbridge_portable_tests devbridge_c_api_tests
test-sanitizers: setup
	@for p in asan tsan; do \
	  cmake --preset $$p >/dev/null && cmake --build --preset $$p -j $(JOBS) --target $(SANITIZED_TESTS) && \
	  ctest --preset $$p -j $(JOBS) -L 'core|conformance|portable|c_api' --repeat until-pass:3 || exit 1; \
	done

# Every backend built with no vendor SDK reachable (the CUDA toolkit and CL/cl.h
# hidden in a private mount namespace: root), its CUDA (emulated driver) and
# OpenCL (PoCL) suites, the wheel in a fresh venv, and the Python suite's CUDA
# column against that wheel (scripts/test-no-toolkit.sh; CI runs this).
test-no-toolkit: setup
	@bash scripts/test-no-toolkit.sh

# The libFuzzer target (bridge over the fake backend against the reference
# model) for FUZZ_SECONDS, or for exactly FUZZ_RUNS inputs from FUZZ_SEED;
# fails on any finding (scripts/fuzz.sh).
FUZZ_SECONDS ?= 60
fuzz: setup
	@FUZZ_SECONDS=$(FUZZ_SECONDS) JOBS=$(JOBS) bash scripts/fuzz.sh

bench: build
	@bash scripts/bench.sh

run: build
	@$(BUILD)/tools/devbridge/devbridge stream --backend host --bytes 1GiB --chunk 4MiB --inflight 8 --ring-bytes 64MiB

# A two-stage pipeline on two devbridge Ray workers (host and OpenCL when available), one killed halfway
# and restored from its checkpoint; checks the result against a single-process run (examples/ray_pipeline.py).
run-ray: setup
	@bash scripts/python-tests.sh --build-only
	@.venv/bin/python examples/ray_pipeline.py

gpu-check:
	@bash scripts/gpu-check.sh

install: build
	@cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf build
