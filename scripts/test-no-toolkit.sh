#!/usr/bin/env bash
# Every backend from a build that cannot see any vendor SDK: the CUDA toolkit
# (cuda.h, nvcc) and the OpenCL headers (CL/cl.h) are hidden while the library,
# its CUDA/OpenCL/conformance suites and the Python wheel are built, as on a
# machine with only the drivers. Then, with nothing hidden:
#   1. the CUDA suites (emulated driver) and the OpenCL suites (PoCL) run
#      against that build;
#   2. the wheel goes into a fresh venv outside the tree, whose module must
#      list all four backends, say why each can or cannot run, and move bytes
#      through the emulated CUDA driver (scripts/check_wheel.py);
#   3. the Python suite runs with its CUDA column (DEVBRIDGE_TEST_BACKEND=cuda,
#      emulated driver) against that wheel in .venv.
#
# Hiding needs a private mount namespace (`unshare -m`), so root. Run after
# scripts/setup.sh (make test-no-toolkit does both).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

if [ "$(id -u)" -ne 0 ] || ! unshare -m true 2>/dev/null; then
  echo "test-no-toolkit: needs root and unshare -m (a private mount namespace) to hide the SDKs" >&2
  exit 1
fi

build=build/no-toolkit
wheel_dir=build/no-toolkit-wheel
suite_targets=(devbridge_cuda_tests devbridge_emulated_libcuda devbridge_opencl_tests devbridge_conformance_tests)

# Binds an empty folder over every SDK location and drops nvcc from PATH, in
# this process's own mount namespace; fails unless the compiler then finds
# neither header and no nvcc is left.
hide_sdks() {
  local empty sdk header
  empty=$(mktemp -d)
  for sdk in /usr/local/cuda /usr/local/cuda-* /opt/cuda /usr/include/CL; do
    if [ -e "$sdk" ]; then mount --bind "$empty" "$(realpath "$sdk")"; fi
  done
  # nvcc may sit on PATH outside those folders too (e.g. Debian's nvidia-cuda-toolkit).
  PATH=$(printf '%s' "$PATH" | tr ':' '\n' | while read -r dir; do [ -x "$dir/nvcc" ] || printf '%s:' "$dir"; done)
  export PATH=${PATH%:}
  for header in cuda.h CL/cl.h; do
    if printf '#include <%s>\n' "$header" | c++ -fsyntax-only -x c++ - 2>/dev/null; then
      echo "test-no-toolkit: $header is still reachable; hide it too" >&2
      return 1
    fi
  done
  if command -v nvcc >/dev/null; then
    echo "test-no-toolkit: nvcc is still on PATH ($(command -v nvcc))" >&2
    return 1
  fi
}

# Runs "$@" (a command or a function of this script) with the SDKs hidden.
without_sdks() {
  unshare -m --propagation private bash -euo pipefail -c \
    "$(declare -f hide_sdks build_without_sdks); hide_sdks; \"\$@\"" without_sdks "$@"
}

build_without_sdks() {  # build wheel_dir suite targets...
  local build=$1 wheel_dir=$2 backend
  shift 2
  cmake --preset no-toolkit >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; return 1; }
  grep -E "devbridge: (CUDA|OpenCL)" "$build.configure.log"
  for backend in CUDA OPENCL; do
    if ! grep -q "^DEVBRIDGE_${backend}_BACKEND:INTERNAL=ON" "$build/CMakeCache.txt"; then
      echo "test-no-toolkit: the $backend backend was left out of a build without its SDK" >&2
      return 1
    fi
  done
  cmake --build --preset no-toolkit -j "$(nproc)" --target devbridge "$@"
  .venv/bin/python -m pip wheel --no-build-isolation --no-deps --disable-pip-version-check -q \
    -C build-dir=build/no-toolkit-python -w "$wheel_dir" . >build/no-toolkit-wheel.log 2>&1 ||
    { cat build/no-toolkit-wheel.log; return 1; }
}

echo "test-no-toolkit: building with the CUDA toolkit and CL/cl.h hidden"
rm -rf "$wheel_dir"
without_sdks build_without_sdks "$build" "$wheel_dir" "${suite_targets[@]}"

echo "test-no-toolkit: CUDA (emulated driver) and OpenCL (PoCL) suites against that build"
ctest --test-dir "$build" -L 'cuda|opencl|conformance' -j "$(nproc)" --output-on-failure --no-tests=error

wheel=$(ls "$wheel_dir"/devbridge-*.whl)
echo "test-no-toolkit: $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB"
.venv/bin/python -m auditwheel show "$wheel" | sed 's/^/  auditwheel: /'

emulated_libcuda=$root/$build/tests/cuda/libdevbridge_emulated_libcuda.so
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
python3 -m venv "$fresh/venv"
"$fresh/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
echo "test-no-toolkit: the wheel in a fresh venv ($fresh, no build tree on its path, the SDKs hidden)"
(cd "$fresh" && DEVBRIDGE_EMULATED_LIBCUDA=$emulated_libcuda without_sdks "$fresh/venv/bin/python" "$root/scripts/check_wheel.py")

# The whole suite with DEVBRIDGE_TEST_BACKEND=cuda, as on a GPU: its cuda cases must run (an unavailable
# CUDA backend fails them), the rest run as always.
echo "test-no-toolkit: the Python suite with its CUDA column (emulated driver) against the wheel"
.venv/bin/python -m pip install -q --no-deps --force-reinstall --disable-pip-version-check "$wheel"
DEVBRIDGE_TEST_BACKEND=cuda DEVBRIDGE_LIBCUDA=$emulated_libcuda \
  .venv/bin/python -m pytest tests/python -q -p no:cacheprovider
