#!/usr/bin/env bash
# Installs the release build into a temporary prefix and builds and runs a
# consumer that uses find_package(devbridge): the packaging works for real.
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
