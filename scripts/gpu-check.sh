#!/usr/bin/env bash
# `make gpu-check`: the CUDA backend on a machine with an NVIDIA GPU and no
# network. Installs nothing; uses what is there (cmake, ninja, nvcc only for the PTX check, and
# python3 with torch / tinygrad / pytest when importable, skipping those parts
# with a message otherwise). Finishes within GPU_CHECK_BUDGET_S (default 470 s,
# under 8 minutes) and writes everything into $GPU_CHECK_OUT (default
# ./gpu-check-out): gpu-check.log (all output), table.md (copy throughput),
# summary.txt (pass/fail per part), and the JSON reports.
#
# Parts, in order (a part whose prerequisites failed is skipped):
#   build       configure + build build/gpu-check (Release, CUDA backend on)
#   device      the backend opens the GPU (device name, driver, compute capability)
#   ctest       the conformance suite and the CUDA tests (labels conformance, cuda),
#               with no real-device test skipped
#   stream      `devbridge stream --backend cuda` verified: 4 GiB, and a wrapping ring
#   python      the Python tests with DEVBRIDGE_TEST_BACKEND=cuda
#   tinygrad    the tinygrad CUDA hand-off tests (skipped without tinygrad)
#   throughput  bridge vs raw cuMemcpyAsync vs torch (bench/cuda), with the bars of
#               issue 5: bridge >= 0.95 x raw at >= 4 MiB, duplex >= 1.6 x one direction
# Exit status: 0 when no part failed, 1 otherwise.
#
# Missing C++ packages (GoogleTest, fmt, spdlog, CLI11, nlohmann-json): run
#   scripts/gpu-check.sh --bundle-deps [DIR]      (default DIR: .deps/gpu-check)
# on a machine where `make setup` worked, carry DIR along, and gpu-check uses
# it when a plain configure fails (GoogleTest is built from source there;
# the others are header-only). DEVBRIDGE_GPU_CHECK_DEPS names another DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DEPS=${DEVBRIDGE_GPU_CHECK_DEPS:-$ROOT/.deps/gpu-check}

# ---- --bundle-deps: make the carried dependency bundle (on a dev machine) ----
bundle_deps() {
  local dest=${1:-$DEPS}
  local inc=/usr/include
  for need in "$inc/fmt/format.h" "$inc/spdlog/spdlog.h" "$inc/CLI/CLI.hpp" "$inc/nlohmann/json.hpp" \
              /usr/src/googletest/CMakeLists.txt; do
    [ -e "$need" ] || { echo "gpu-check --bundle-deps: $need is missing (run scripts/setup.sh first)" >&2; return 1; }
  done
  rm -rf "$dest" && mkdir -p "$dest/include" "$dest/src" "$dest/cmake" || return 1
  cp -r /usr/src/googletest "$dest/src/googletest"
  for d in fmt spdlog CLI nlohmann dlpack; do
    [ -d "$inc/$d" ] && cp -r "$inc/$d" "$dest/include/"
  done
  local version
  # Header-only stand-ins for the packages' own CMake configs.
  write_config() {  # package target defines links [version]
    local pkg=$1 target=$2 defines=$3 links=$4 version=${5:-}
    mkdir -p "$dest/cmake/$pkg"
    {
      echo "# Written by scripts/gpu-check.sh --bundle-deps: $pkg as headers only."
      [ -n "$links" ] && [ "$pkg" = spdlog ] && echo "include(CMakeFindDependencyMacro)" && echo "find_dependency(fmt)"
      echo "if(NOT TARGET $target)"
      echo "  add_library($target INTERFACE IMPORTED)"
      echo "  set_target_properties($target PROPERTIES"
      echo "    INTERFACE_INCLUDE_DIRECTORIES \"\${CMAKE_CURRENT_LIST_DIR}/../../include\""
      [ -n "$defines" ] && echo "    INTERFACE_COMPILE_DEFINITIONS \"$defines\""
      [ -n "$links" ] && echo "    INTERFACE_LINK_LIBRARIES \"$links\""
      echo "  )"
      echo "endif()"
    } > "$dest/cmake/$pkg/${pkg}Config.cmake"
    if [ -n "$version" ]; then
      cat > "$dest/cmake/$pkg/${pkg}ConfigVersion.cmake" <<EOF
set(PACKAGE_VERSION "$version")
if(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
EOF
    fi
  }
  pkg_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null | sed 's/^[0-9]*://; s/[-+~].*//'; }
  write_config fmt fmt::fmt "FMT_HEADER_ONLY=1" "" "$(pkg_version libfmt-dev)"
  write_config spdlog spdlog::spdlog "SPDLOG_FMT_EXTERNAL=1" "fmt::fmt" "$(pkg_version libspdlog-dev)"
  write_config CLI11 CLI11::CLI11 "" "" "$(pkg_version libcli11-dev)"
  write_config nlohmann_json nlohmann_json::nlohmann_json "" "" "$(pkg_version nlohmann-json3-dev)"
  [ -d "$dest/include/dlpack" ] && write_config dlpack dlpack::dlpack "" "" "$(pkg_version libdlpack-dev)"
  echo "gpu-check: dependency bundle in $dest ($(du -sh "$dest" | cut -f1)); carry it to the GPU machine"
}

if [ "${1:-}" = "--bundle-deps" ]; then
  bundle_deps "${2:-}"
  exit $?
fi
if [ $# -gt 0 ]; then
  echo "usage: scripts/gpu-check.sh [--bundle-deps [DIR]]" >&2
  exit 2
fi

# ---- the check ------------------------------------------------------------------
OUT=${GPU_CHECK_OUT:-$ROOT/gpu-check-out}
BUILD=${GPU_CHECK_BUILD:-$ROOT/build/gpu-check}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
START=$(date +%s)
JOBS=$(nproc 2>/dev/null || echo 4)
mkdir -p "$OUT" "$BUILD"
# Only the files this script writes (GPU_CHECK_OUT may be a shared folder).
for f in gpu-check.log summary.txt table.md configure.log build.log device.log info.txt ctest.log \
         ctest-LastTest.log stream-4GiB.json stream-wrap.json python-configure.log python.log tinygrad.log \
         bench.log bench-bridge-raw.json bench-torch.json; do
  rm -f "${OUT:?}/$f"
done
LOG=$OUT/gpu-check.log
exec > >(tee -a "$LOG") 2>&1

PARTS=()
declare -A STATUS DETAIL
record() {  # part status detail
  PARTS+=("$1")
  STATUS[$1]=$2
  DETAIL[$1]=$3
  printf '\n>> %-10s %s  %s\n' "$1" "$2" "$3"
}
elapsed() { echo $(( $(date +%s) - START )); }
# Seconds a step may take: its cap, or what is left of the budget (keeping a
# little for the summary), whichever is less.
allow() {
  local cap=$1 left=$(( START + BUDGET - $(date +%s) - 10 ))
  (( left < cap )) && cap=$left
  (( cap < 0 )) && cap=0
  echo "$cap"
}
section() { printf '\n==== %s (t=%ss) ====\n' "$1" "$(elapsed)"; }
# run <seconds> <command...>: logs the command, runs it under timeout.
run() {
  local seconds=$1
  shift
  echo "\$ $*"
  if (( seconds < 5 )); then
    echo "(no time left in the ${BUDGET}s budget)"
    return 124
  fi
  timeout --kill-after=10 "$seconds" "$@"
}

section "preflight"
echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cores: $JOBS  budget: ${BUDGET}s"
echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') changed file(s)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1 || nvidia-smi -L 2>&1
else
  echo "nvidia-smi: not found"
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
for tool in nvcc cmake ninja c++ python3; do
  if command -v "$tool" >/dev/null; then
    echo "$tool: $(command -v "$tool") ($("$tool" --version 2>&1 | grep -Eo '[0-9]+\.[0-9]+(\.[0-9]+)?' | tail -n1))"
  else
    echo "$tool: not found"
  fi
done
PYTHON=$(command -v python3 || true)
have_module() { [ -n "$PYTHON" ] && "$PYTHON" -c "import $1" >/dev/null 2>&1; }
for module in numpy pytest torch tinygrad nanobind; do
  if have_module "$module"; then
    echo "python: $module $("$PYTHON" -c "import $module; print(getattr($module, '__version__', '?'))" 2>/dev/null)"
  else
    echo "python: $module not importable"
  fi
done
if [ -n "${DEVBRIDGE_LIBCUDA:-}" ]; then
  echo "note: DEVBRIDGE_LIBCUDA=$DEVBRIDGE_LIBCUDA: the backend loads that file, not the system's libcuda.so.1"
fi
GENERATOR=("-G" "Unix Makefiles")
command -v ninja >/dev/null && GENERATOR=("-G" "Ninja")

# ---- build ----------------------------------------------------------------------
section "build"
configure() {  # extra cmake arguments...
  run "$(allow 120)" cmake -S "$ROOT" -B "$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DDEVBRIDGE_WITH_CUDA=ON -DDEVBRIDGE_BUILD_TESTS=ON -DDEVBRIDGE_BUILD_CLI=ON "$@" 2>&1 | tee "$OUT/configure.log"
  return "${PIPESTATUS[0]}"
}
# GoogleTest from the bundle's sources, installed under the build tree.
bundle_prefix() {
  local prefix=$BUILD/deps-prefix
  if [ ! -f "$prefix/.built" ]; then
    run "$(allow 60)" cmake -S "$DEPS/src/googletest" -B "$BUILD/deps-googletest" "${GENERATOR[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null &&
      run "$(allow 120)" cmake --build "$BUILD/deps-googletest" -j "$JOBS" >/dev/null &&
      run "$(allow 30)" cmake --install "$BUILD/deps-googletest" >/dev/null && touch "$prefix/.built" || return 1
  fi
  echo "$prefix;$DEPS/cmake/fmt;$DEPS/cmake/spdlog;$DEPS/cmake/CLI11;$DEPS/cmake/nlohmann_json;$DEPS/cmake/dlpack"
}

built=false
bench_off=()
prefix=""
if configure; then
  configured=true
else
  configured=false
  if [ -d "$DEPS" ]; then
    echo "gpu-check: plain configure failed; using the dependency bundle in $DEPS"
    if prefix=$(bundle_prefix | tail -n1) && [ -n "$prefix" ]; then
      rm -f "$BUILD/CMakeCache.txt"
      if configure -DCMAKE_PREFIX_PATH="$prefix"; then
        configured=true
      elif grep -q "benchmark" "$OUT/configure.log"; then
        # Google Benchmark cannot be bundled from headers; the CUDA copy
        # benchmark itself does not use it.
        bench_off=(-DDEVBRIDGE_BUILD_BENCH=OFF)
        configure -DCMAKE_PREFIX_PATH="$prefix" "${bench_off[@]}" && configured=true
      fi
    fi
  else
    echo "gpu-check: configure failed; if C++ packages are missing, run 'scripts/gpu-check.sh --bundle-deps' on a"
    echo "           machine where 'make setup' worked and carry .deps/gpu-check here"
  fi
fi
if ! $configured; then
  record build FAIL "cmake configure failed (see configure.log)"
elif ! grep -q "devbridge: CUDA backend built" "$OUT/configure.log"; then
  record build FAIL "$(grep -m1 -o 'devbridge: CUDA backend left out.*' "$OUT/configure.log" || echo 'CUDA backend not built')"
elif ! run "$(allow 300)" cmake --build "$BUILD" -j "$JOBS" >"$OUT/build.log" 2>&1; then
  grep -E -B2 -A8 'error|FAILED' "$OUT/build.log" | head -n 80
  tail -n 5 "$OUT/build.log"
  record build FAIL "cmake --build failed (build.log)"
else
  tail -n 3 "$OUT/build.log"
  built=true
  record build PASS "$(grep -m1 -o 'PTX for compute_[0-9;]*' "$OUT/configure.log")${bench_off:+; Google Benchmark programs left out}"
fi

CLI=$BUILD/tools/devbridge/devbridge
CUDA_TESTS=$BUILD/tests/cuda/devbridge_cuda_tests

# ---- device ---------------------------------------------------------------------
section "device"
device_ok=false
if ! $built; then
  record device SKIP "no build"
elif [ ! -x "$CUDA_TESTS" ]; then
  record device FAIL "$CUDA_TESTS was not built"
else
  run "$(allow 60)" "$CUDA_TESTS" --gtest_filter=CudaDeviceTest.DescribesTheDevice 2>&1 | tee "$OUT/device.log"
  if grep -q "^\[  PASSED  \] 1 test" "$OUT/device.log" && ! grep -q "SKIPPED" "$OUT/device.log"; then
    device_ok=true
    record device PASS "$(grep -m1 '^device:' "$OUT/device.log" | cut -d' ' -f2-); $(grep -m1 '^notes:' "$OUT/device.log" | cut -d' ' -f2-)"
  else
    record device FAIL "$(grep -m1 -o 'no usable CUDA device: .*' "$OUT/device.log" || echo 'the backend could not open the GPU (device.log)')"
  fi
  [ -x "$CLI" ] && run 30 "$CLI" info 2>&1 | tee "$OUT/info.txt"
fi

# ---- ctest ----------------------------------------------------------------------
section "ctest: conformance + cuda"
if ! $device_ok; then
  record ctest SKIP "no usable device"
else
  run "$(allow 180)" ctest --test-dir "$BUILD" -L 'conformance|cuda' -j "$(( JOBS < 8 ? JOBS : 8 ))" \
    --output-on-failure --timeout 150 2>&1 | tee "$OUT/ctest.log"
  ctest_rc=${PIPESTATUS[0]}
  cp "$BUILD/Testing/Temporary/LastTest.log" "$OUT/ctest-LastTest.log" 2>/dev/null
  summary_line=$(grep -m1 -E 'tests passed|tests failed' "$OUT/ctest.log" || echo "no ctest summary")
  # Real-device tests must run here: a skip means the tests could not open the GPU.
  device_skips=$(grep -E '\(Skipped\)' "$OUT/ctest.log" | grep -v 'emulated\.' |
    grep -E 'CudaDeviceTest\.|/cuda' | grep -v 'AsyncCompletionOrderAndSafeReleasePoints/cuda' || true)
  if [ "$ctest_rc" -ne 0 ]; then
    record ctest FAIL "$summary_line"
  elif [ -n "$device_skips" ]; then
    record ctest FAIL "device tests skipped on a GPU machine: $(echo "$device_skips" | wc -l) (see ctest.log)"
  else
    record ctest PASS "$summary_line; skipped: $(grep -c '(Skipped)' "$OUT/ctest.log")"
  fi
fi

# ---- stream ---------------------------------------------------------------------
section "devbridge stream --backend cuda"
if ! $device_ok; then
  record stream SKIP "no usable device"
elif [ ! -x "$CLI" ]; then
  record stream FAIL "$CLI was not built"
else
  stream_fail=""
  run "$(allow 90)" "$CLI" stream --backend cuda --bytes 4GiB --chunk 16MiB --inflight 8 --ring-bytes 512MiB \
    --json "$OUT/stream-4GiB.json" || stream_fail+="4GiB/16MiB chunks failed; "
  # A ring far smaller than the data (wraps hundreds of times), one chunk in flight.
  run "$(allow 60)" "$CLI" stream --backend cuda --bytes 256MiB --chunk 1MiB --inflight 1 --ring-bytes 4MiB \
    --json "$OUT/stream-wrap.json" || stream_fail+="wrapping ring failed; "
  if [ -z "$stream_fail" ] && grep -q '"verified": *true' "$OUT/stream-4GiB.json" "$OUT/stream-wrap.json" 2>/dev/null &&
     ! grep -q '"verified": *false' "$OUT/stream-4GiB.json" "$OUT/stream-wrap.json"; then
    gbps=$(grep -o '"end_to_end_gbps": *[0-9.]*' "$OUT/stream-4GiB.json" | grep -o '[0-9.]*$' | cut -c1-5)
    record stream PASS "4 GiB verified (${gbps:-?} GB/s end to end); wrapping 4 MiB ring verified"
  else
    record stream FAIL "${stream_fail:-a report does not say verified}"
  fi
fi

# ---- python + tinygrad ------------------------------------------------------------
section "python tests on CUDA"
PYSTAGE=$BUILD/python-stage
python_ready=false
prepare_python() {
  # The module, built by CMake against this interpreter, staged beside the
  # pure-Python package: no pip, no network.
  run "$(allow 120)" cmake -S "$ROOT" -B "$BUILD-python" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DDEVBRIDGE_BUILD_PYTHON=ON -DDEVBRIDGE_BUILD_TESTS=OFF -DDEVBRIDGE_BUILD_BENCH=OFF -DDEVBRIDGE_BUILD_CLI=OFF \
    -DPython_EXECUTABLE="$PYTHON" ${prefix:+-DCMAKE_PREFIX_PATH="$prefix"} >"$OUT/python-configure.log" 2>&1 ||
    { tail -n 20 "$OUT/python-configure.log"; return 1; }
  run "$(allow 180)" cmake --build "$BUILD-python" --target _devbridge -j "$JOBS" 2>&1 | tail -n 20
  [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
  rm -rf "$PYSTAGE" && mkdir -p "$PYSTAGE" && cp -r "$ROOT/python/devbridge" "$PYSTAGE/" &&
    find "$BUILD-python" -name '_devbridge*.so' -exec cp {} "$PYSTAGE/devbridge/" \; &&
    ls "$PYSTAGE"/devbridge/_devbridge*.so >/dev/null 2>&1
}
if ! $device_ok; then
  record python SKIP "no usable device"
elif [ -z "$PYTHON" ] || ! have_module pytest || ! have_module numpy; then
  record python SKIP "python3 with pytest and numpy not available"
elif grep -q "DEVBRIDGE_OFFLINE" "$ROOT/scripts/python-tests.sh" 2>/dev/null; then
  # The Python suite's own runner, when it can run without installing.
  if DEVBRIDGE_TEST_BACKEND=cuda DEVBRIDGE_OFFLINE=1 DEVBRIDGE_PYTHON="$PYTHON" \
      run "$(allow 180)" bash "$ROOT/scripts/python-tests.sh" 2>&1 | tee "$OUT/python.log"; [ "${PIPESTATUS[0]}" -eq 0 ]; then
    record python PASS "$(grep -m1 -E '[0-9]+ passed' "$OUT/python.log" || echo 'scripts/python-tests.sh passed')"
  else
    record python FAIL "scripts/python-tests.sh failed (python.log)"
  fi
elif [ ! -d "$ROOT/python/devbridge" ] || [ ! -d "$ROOT/tests/python" ]; then
  record python SKIP "no Python module in this tree"
elif ! have_module nanobind; then
  record python SKIP "nanobind not importable by $PYTHON (needed to build the module)"
elif ! "$PYTHON" -c "import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
  record python SKIP "no Python.h for $PYTHON (the python3-dev headers are not installed)"
elif ! prepare_python; then
  record python FAIL "the Python module did not build for $PYTHON (python-configure.log)"
else
  python_ready=true
  PYTHONPATH=$PYSTAGE${PYTHONPATH:+:$PYTHONPATH} DEVBRIDGE_TEST_BACKEND=cuda PYTHONUNBUFFERED=1 \
    run "$(allow 180)" "$PYTHON" -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/python" 2>&1 | tee "$OUT/python.log"
  if [ "${PIPESTATUS[0]}" -eq 0 ]; then
    record python PASS "$(grep -E '[0-9]+ passed' "$OUT/python.log" | tail -n1)"
  else
    record python FAIL "$(grep -E '[0-9]+ (failed|passed|error)' "$OUT/python.log" | tail -n1)"
  fi
fi

section "tinygrad CUDA hand-off"
if ! have_module tinygrad; then
  record tinygrad SKIP "tinygrad not importable by ${PYTHON:-python3} (carry a wheel and put it on PYTHONPATH)"
elif ! $python_ready; then
  record tinygrad SKIP "the Python module is not available here (see the python part)"
else
  PYTHONPATH=$PYSTAGE${PYTHONPATH:+:$PYTHONPATH} DEVBRIDGE_TEST_BACKEND=cuda PYTHONUNBUFFERED=1 \
    run "$(allow 120)" "$PYTHON" -m pytest -q -rs -p no:cacheprovider -k cuda "$ROOT/tests/python/test_tinygrad.py" \
    2>&1 | tee "$OUT/tinygrad.log"
  tiny_rc=${PIPESTATUS[0]}
  if [ "$tiny_rc" -eq 0 ] && grep -qE '[1-9][0-9]* passed' "$OUT/tinygrad.log"; then
    record tinygrad PASS "$(grep -E 'passed' "$OUT/tinygrad.log" | tail -n1)"
  elif [ "$tiny_rc" -eq 5 ]; then
    record tinygrad FAIL "no tinygrad test ran on CUDA (tests/python/test_tinygrad.py -k cuda)"
  else
    record tinygrad FAIL "$(grep -E '[0-9]+ (failed|passed|error)' "$OUT/tinygrad.log" | tail -n1)"
  fi
fi

# ---- throughput -----------------------------------------------------------------
section "throughput: bridge vs raw cuMemcpyAsync vs torch"
BENCH=$BUILD/bench/cuda/cuda_copy_bench
if ! $device_ok; then
  record throughput SKIP "no usable device"
elif [ ! -x "$BENCH" ]; then
  record throughput FAIL "$BENCH was not built${bench_off:+ (bench/ left out: Google Benchmark missing)}"
else
  # GPU_CHECK_BENCH_ARGS: extra options for both benchmarks (e.g. --bytes-mib 512).
  read -r -a bench_args <<<"${GPU_CHECK_BENCH_ARGS:-}"
  run "$(allow 150)" "$BENCH" --check --require-gpu --json "$OUT/bench-bridge-raw.json" "${bench_args[@]}" 2>&1 |
    tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
  torch_note="torch not importable"
  if have_module torch; then
    if PYTHONUNBUFFERED=1 run "$(allow 90)" "$PYTHON" "$ROOT/bench/cuda/torch_copy_bench.py" --json "$OUT/bench-torch.json" "${bench_args[@]}" \
        2>&1 | tee -a "$OUT/bench.log"; [ "${PIPESTATUS[0]}" -eq 0 ]; then
      torch_note="torch measured"
    else
      torch_note="torch benchmark failed"
    fi
  fi
  if [ -n "$PYTHON" ] && [ -f "$OUT/bench-bridge-raw.json" ]; then
    "$PYTHON" "$ROOT/bench/cuda/report.py" "$OUT/bench-bridge-raw.json" "$OUT/bench-torch.json" >"$OUT/table.md" ||
      sed -n '/^| chunk/,/^$/p' "$OUT/bench.log" >"$OUT/table.md"
  else
    sed -n '/^| chunk/,/^$/p' "$OUT/bench.log" >"$OUT/table.md"
  fi
  echo
  cat "$OUT/table.md"
  if [ "$bench_rc" -eq 0 ]; then
    record throughput PASS "bars met; $torch_note (table.md)"
  else
    if grep -q '^  FAIL' "$OUT/bench.log"; then
      record throughput FAIL "$(grep -c '^  FAIL' "$OUT/bench.log") bar(s) missed; $torch_note (table.md, bench.log)"
    else
      record throughput FAIL "cuda_copy_bench failed (exit $bench_rc; bench.log)"
    fi
  fi
fi

# ---- summary --------------------------------------------------------------------
section "summary"
failed=0
{
  echo "gpu-check $(date -u +%FT%TZ), $(elapsed)s of ${BUDGET}s"
  for part in "${PARTS[@]}"; do
    printf '%-10s %-4s %s\n' "$part" "${STATUS[$part]}" "${DETAIL[$part]}"
    [ "${STATUS[$part]}" = FAIL ] && failed=$((failed + 1))
  done
  if (( failed > 0 )); then echo "RESULT: FAIL ($failed part(s))"; else echo "RESULT: PASS"; fi
} | tee "$OUT/summary.txt"
echo "full log: $LOG"
grep -q "RESULT: PASS" "$OUT/summary.txt"
