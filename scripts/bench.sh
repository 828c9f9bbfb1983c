#!/usr/bin/env bash
# `make bench`: run after the release build (build/release). Installs nothing;
# the one thing it builds besides the CMake targets is the Rust reference, with
# cargo, into build/seed-rust-target (../shared is read-only).
#
#  1. the seed-rust reference benchmark (workloads a-f), when cargo is there,
#  2. and devbridge's replay of the same workloads over a null backend,
#     alternating, BENCH_ROUNDS times (default 5);
#  3. one comparison table of medians (bench/compare.py), then workload e set
#     beside an unsynchronized model of the same view (bench/view_floor.cpp);
#     workloads a-d through the C ABI beside the C++ API (bench/c_abi_overhead.cpp),
#     and the Rust crate's wrapper beside its own C calls (bindings/rust/examples/overhead.rs);
#  4. the host backend against memcpy, and the 4 KiB round trip; the drop
#     queue's reclamation latency (release -> memory back, with and without a
#     pending launch fence); the caching pool against a driver allocation per
#     call; a pitched 2-D copy against a row loop of 1-D copies; the OpenCL
#     backend against raw OpenCL calls, where it is built;
#  5. bench/cuda, when the CUDA helper has added it and a GPU is present;
#  6. the tinygrad hand-off benchmark, when bench/tinygrad_handoff.py exists;
#  7. Prefetcher-fed training and upload/download against numpy (bench/prefetch_bench.py).
#  8. devbridge.ray: worker-to-worker hand-off vs ray.put/get, pipeline on 1 vs 2 workers (bench/ray_bench.py).
# No step fails on time; a step fails only when a program itself fails.
set -uo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build/release}
OUT=$BUILD/bench-results
REFERENCE_DIR=../shared/bench/seed-rust
status=0

if [ ! -x "$BUILD/bench/bridge_workloads" ] || [ ! -x "$BUILD/bench/view_floor" ]; then
  # `make bench` builds everything first; rebuild only the benchmarks if run alone.
  if [ -f "$BUILD/build.ninja" ] || [ -f "$BUILD/Makefile" ]; then
    cmake --build "$BUILD" --target bridge_workloads view_floor host_copy reclaim pool_alloc pitched_copy trace_dump -j "$(nproc)" || exit 1
  else
    echo "bench: no build in $BUILD; run 'make bench'" >&2
    exit 1
  fi
fi
# The C ABI benchmark exists only where the C library is built
# (DEVBRIDGE_BUILD_C_API, and dlpack/dlpack.h found).
if [ ! -x "$BUILD/bench/c_abi_overhead" ] && [ -e "$BUILD/src/c_api/libdevbridge_c.so" ]; then
  cmake --build "$BUILD" --target c_abi_overhead -j "$(nproc)" || exit 1
fi
mkdir -p "$OUT"

echo "== machine: $(nproc) CPUs, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n1), $(uname -r) =="

# 1-2. The reference and devbridge's replay, interleaved: the machine's
# speed drifts (a shared VM: +-25% over tens of seconds), so each side runs
# BENCH_ROUNDS times (default 5), alternating, and the table takes medians.
# The first round runs everything; later ones skip the long growth runs (f).
rounds=${BENCH_ROUNDS:-5}
reference_outs=()
devbridge_outs=()
have_reference=1
if ! command -v cargo >/dev/null 2>&1; then
  echo "bench: cargo is not installed; skipping the Rust reference, devbridge's figures alone"
  have_reference=0
elif [ ! -f "$REFERENCE_DIR/Cargo.toml" ]; then
  echo "bench: $REFERENCE_DIR not found; devbridge's figures alone"
  have_reference=0
fi
for round in $(seq 1 "$rounds"); do
  skip_growth=$([ "$round" -eq 1 ] && echo 0 || echo 1)
  if [ "$have_reference" -eq 1 ]; then
    echo "== seed-rust reference (cargo, release), round $round of $rounds =="
    if BENCH_SKIP_GROWTH=$skip_growth CARGO_TARGET_DIR=build/seed-rust-target cargo run --quiet --release \
        --manifest-path "$REFERENCE_DIR/Cargo.toml" --bin bench | tee "$OUT/reference.$round.txt"; then
      reference_outs+=(--reference "$OUT/reference.$round.txt")
    else
      echo "bench: the reference benchmark failed in round $round" >&2
    fi
  fi
  echo "== devbridge replay (null backend), round $round of $rounds =="
  BENCH_SKIP_GROWTH=$skip_growth "$BUILD/bench/bridge_workloads" | tee "$OUT/devbridge.$round.txt" || status=1
  devbridge_outs+=(--devbridge "$OUT/devbridge.$round.txt")
done

# 3. The table.
python3 bench/compare.py "${devbridge_outs[@]}" "${reference_outs[@]}" || status=1

# 3b. Workload e against an unsynchronized model of the same view and a
# reference-like wrap, in one process: how much of e any lease design could save.
echo
echo "== workload e: devbridge's view vs an unsynchronized model vs a reference-like wrap =="
"$BUILD/bench/view_floor" | tee "$OUT/view_floor.txt" || status=1

# 3c. The C ABI against the C++ API on workloads a-d, both in one process
# (rounds alternate inside it; the table is its last lines).
if [ -x "$BUILD/bench/c_abi_overhead" ]; then
  echo
  echo "== C ABI vs C++ API: workloads a-d over the host backend =="
  "$BUILD/bench/c_abi_overhead" | tee "$OUT/c_abi_overhead.txt" || status=1
else
  echo
  echo "bench: no $BUILD/bench/c_abi_overhead (no C library: DEVBRIDGE_BUILD_C_API off or dlpack/dlpack.h missing); skipping the C ABI comparison"
fi
# 3d. The Rust crate's safe wrapper against its own sys calls, one process.
if command -v cargo >/dev/null && [ -e "$BUILD/src/c_api/libdevbridge_c.so" ]; then
  echo
  echo "== Rust DeviceBridge vs the C ABI called directly (bindings/rust/examples/overhead.rs) =="
  DEVBRIDGE_C_LIB_DIR=$PWD/$BUILD/src/c_api CARGO_TARGET_DIR=$PWD/build/rust-target \
    cargo run --offline --release --quiet --example overhead --manifest-path bindings/rust/Cargo.toml |
    tee "$OUT/rust_overhead.txt" || status=1
fi

# 4. Host backend.
echo
echo "== host backend: async upload vs memcpy, 4 KiB round trip =="
"$BUILD/bench/host_copy" | tee "$OUT/host_copy.txt" || status=1

# 4a. Deferred-free reclamation latency, with and without a pending fence.
if [ -x "$BUILD/bench/reclaim" ]; then
  echo
  echo "== drop queue: release -> memory back in the host backend =="
  "$BUILD/bench/reclaim" | tee "$OUT/reclaim.txt" || status=1
fi

# 4a'. The caching pool: mixed-size alloc+free through it vs a driver allocation per call.
if [ -x "$BUILD/bench/pool_alloc" ]; then
  echo
  echo "== caching pool: alloc+free of mixed sizes, pool vs driver =="
  "$BUILD/bench/pool_alloc" | tee "$OUT/pool_alloc.txt" || status=1
fi

# 4a''. Pitched 2-D copies: a 4096 x 4095 float32 window in one copy vs a row loop.
if [ -x "$BUILD/bench/pitched_copy" ]; then
  echo
  echo "== pitched 2-D copy vs a row loop of 1-D copies =="
  "$BUILD/bench/pitched_copy" | tee "$OUT/pitched_copy.txt" || status=1
fi

# 4a'''. The flight recorder: the time to dump 10^6 recorded events as trace-event JSON.
if [ -x "$BUILD/bench/trace_dump" ]; then
  echo
  echo "== flight recorder: trace_json of 10^6 events =="
  "$BUILD/bench/trace_dump" | tee "$OUT/trace_dump.txt" || status=1
fi

# 4b. OpenCL backend against raw OpenCL (when built; it skips without a device).
if [ -x "$BUILD/bench/opencl_copy" ]; then
  echo
  echo "== OpenCL backend: async upload vs raw OpenCL =="
  "$BUILD/bench/opencl_copy" | tee "$OUT/opencl_copy.txt" || status=1
fi

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

# 7. Prefetcher-fed TinyJit training against Tensor(numpy) feeding, and upload/download of 256 MiB
# against numpy.copyto (bench/prefetch_bench.py; each comparison in one process).
if [ -f bench/prefetch_bench.py ]; then
  echo
  echo "== Prefetcher and staging =="
  if [ -x .venv/bin/python ]; then
    { bash scripts/python-tests.sh --build-only && .venv/bin/python bench/prefetch_bench.py \
        | tee "$OUT/prefetch_bench.txt"; } || status=1
  else
    echo "bench: .venv/bin/python missing (run 'make setup'); skipping bench/prefetch_bench.py"
  fi
fi

# 8. devbridge.ray on a local Ray cluster (devbridge.ray.init_local: on 127.0.0.1 only): 256 MiB hand-off between two workers (export/import_) against
# ray.put + ray.get of the same numpy array, and pipeline throughput with 1 vs 2 workers (skips without Ray).
if [ -f bench/ray_bench.py ]; then
  echo
  echo "== devbridge.ray: hand-off and pipeline =="
  if [ -x .venv/bin/python ]; then
    { bash scripts/python-tests.sh --build-only && .venv/bin/python bench/ray_bench.py \
        | tee "$OUT/ray_bench.txt"; } || status=1
  else
    echo "bench: .venv/bin/python missing (run 'make setup'); skipping bench/ray_bench.py"
  fi
fi

echo
echo "bench: raw outputs in $OUT"
exit $status
