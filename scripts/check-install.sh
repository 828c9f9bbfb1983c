#!/usr/bin/env bash
# Installs the release build into a temporary prefix and builds and runs a
# consumer that uses find_package(devbridge), and a C worker that links the C
# ABI through pkg-config: the packaging works for real.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/release}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$BUILD" --prefix "$work/prefix" >/dev/null
cmake -S examples/find_package -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/quickstart"
echo "check-install: find_package(devbridge) from an install prefix works"
pc=$(find "$work/prefix" -name devbridge_c.pc -print -quit)
if [ -z "$pc" ]; then
  echo "check-install: no devbridge_c.pc installed (the C ABI needs dlpack.h at configure time)" >&2
  exit 1
fi
export PKG_CONFIG_PATH=${pc%/*}
# shellcheck disable=SC2046  # pkg-config's flags are meant to split
cc -std=c11 -Wall -Werror examples/c_worker/worker.c -o "$work/c_worker" $(pkg-config --cflags --libs devbridge_c) \
  -Wl,-rpath,"$(pkg-config --variable=libdir devbridge_c)"
"$work/c_worker"
echo "check-install: a C worker links libdevbridge_c through pkg-config"
