#!/usr/bin/env bash
# `make bench`: run after the release build (build/release). Installs nothing;
# the one thing it builds besides the CMake targets is the Rust reference, with
# cargo, into build/seed-rust-target (../shared is read-only).
#
#  1. the seed-rust reference benchmark (workloads a-f), when cargo is there;
#  2. devbridge's replay of the same workloads over a null backend;
#  3. one comparison table (bench/compare.py);
#  4. the host backend against memcpy, and the 4 KiB round trip;
#  5. bench/cuda, when the CUDA helper has added it and a GPU is present;
#  6. the tinygrad hand-off benchmark, when bench/tinygrad_handoff.py exists.
# No step fails on time; a step fails only when a program itself fails.
set -uo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build/release}
OUT=$BUILD/bench-results
REFERENCE_DIR=../shared/bench/seed-rust
status=0

if [ ! -x "$BUILD/bench/bridge_workloads" ]; then
  # `make bench` builds everything first; rebuild only the benchmarks if run alone.
  if [ -f "$BUILD/build.ninja" ] || [ -f "$BUILD/Makefile" ]; then
    cmake --build "$BUILD" --target bridge_workloads host_copy -j "$(nproc)" || exit 1
  else
    echo "bench: no build in $BUILD; run 'make bench'" >&2
    exit 1
  fi
fi
mkdir -p "$OUT"

echo "== machine: $(nproc) CPUs, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n1), $(uname -r) =="

# 1. Reference.
reference_out=""
if command -v cargo >/dev/null 2>&1 && [ -f "$REFERENCE_DIR/Cargo.toml" ]; then
  echo "== seed-rust reference (cargo, release) =="
  if CARGO_TARGET_DIR=build/seed-rust-target cargo run --quiet --release \
      --manifest-path "$REFERENCE_DIR/Cargo.toml" --bin bench | tee "$OUT/reference.txt"; then
    reference_out="$OUT/reference.txt"
  else
    echo "bench: the reference benchmark failed; devbridge's figures alone" >&2
  fi
elif ! command -v cargo >/dev/null 2>&1; then
  echo "bench: cargo is not installed; skipping the Rust reference, devbridge's figures alone"
else
  echo "bench: $REFERENCE_DIR not found; devbridge's figures alone"
fi

# 2. devbridge's replay.
echo "== devbridge replay (null backend) =="
"$BUILD/bench/bridge_workloads" | tee "$OUT/devbridge.txt" || status=1

# 3. The table.
if [ -n "$reference_out" ]; then
  python3 bench/compare.py --devbridge "$OUT/devbridge.txt" --reference "$reference_out" || status=1
else
  python3 bench/compare.py --devbridge "$OUT/devbridge.txt" || status=1
fi

# 4. Host backend.
echo
echo "== host backend: async upload vs memcpy, 4 KiB round trip =="
"$BUILD/bench/host_copy" | tee "$OUT/host_copy.txt" || status=1

# 5. CUDA (its own helper's programs; each decides whether a GPU is there).
if [ -f bench/cuda/run.sh ]; then
  echo
  echo "== CUDA benchmarks =="
  BUILD="$BUILD" bash bench/cuda/run.sh || status=1
fi

# 6. tinygrad hand-off.
if [ -f bench/tinygrad_handoff.py ]; then
  echo
  echo "== tinygrad hand-off =="
  if [ -x .venv/bin/python ]; then
    # The module must be current in the venv; make bench does not run the tests.
    { bash scripts/python-tests.sh --build-only && .venv/bin/python bench/tinygrad_handoff.py; } || status=1
  else
    echo "bench: .venv/bin/python missing (run 'make setup'); skipping bench/tinygrad_handoff.py"
  fi
fi

echo
echo "bench: raw outputs in $OUT"
exit $status
