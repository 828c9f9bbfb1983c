#!/usr/bin/env bash
# The Rust crate's tests (bindings/rust): builds libdevbridge_c into the
# release build when needed, then `cargo test --offline` against it. cargo's
# output goes to build/rust-target, so the source tree stays clean.
#
#   DEVBRIDGE_C_LIB_DIR  test against a libdevbridge_c.so already built there
#                        (nothing is built then); default build/release/src/c_api
#   JOBS                 parallel build jobs (default 2)
# Extra arguments go to `cargo test` (a test name, -- --nocapture, ...).
# Skips (exit 0) where cargo is absent or the C library is configured out.
# Runs the tests twice where a rustup toolchain shadows Debian's: with each.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "rust-tests: skipped: no cargo on PATH (scripts/setup.sh installs Debian's)"
  exit 0
fi

if [ -z "${DEVBRIDGE_C_LIB_DIR:-}" ]; then
  BUILD=build/release
  if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    echo "rust-tests: $BUILD is not configured; run \`make build\` first" >&2
    exit 1
  fi
  if grep -q -e '^DEVBRIDGE_BUILD_C_API:BOOL=OFF' -e '^DEVBRIDGE_DLPACK_INCLUDE_DIR:PATH=.*NOTFOUND' "$BUILD/CMakeCache.txt"; then
    echo "rust-tests: skipped: the C library is not built here (DEVBRIDGE_BUILD_C_API off or no dlpack/dlpack.h)"
    exit 0
  fi
  cmake --build --preset release -j "${JOBS:-2}" --target devbridge_c
  DEVBRIDGE_C_LIB_DIR=$PWD/$BUILD/src/c_api
fi
export DEVBRIDGE_C_LIB_DIR
export CARGO_TARGET_DIR=$PWD/build/rust-target

cd bindings/rust
cargo test --offline "$@"

# The crate promises rust-version 1.63 (Debian's): where that toolchain is
# installed and is not the one just used, the same tests run with it too.
if [ -x /usr/bin/rustc ] && [ -x /usr/bin/cargo ] &&
   [ "$(/usr/bin/rustc --version)" != "$(rustc --version)" ]; then
  echo "rust-tests: again with the crate's minimum toolchain, $(/usr/bin/rustc --version)"
  RUSTC=/usr/bin/rustc CARGO_TARGET_DIR=$CARGO_TARGET_DIR-debian /usr/bin/cargo test --offline "$@"
fi
