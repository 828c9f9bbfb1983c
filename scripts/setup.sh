#!/usr/bin/env bash
# Installs what devbridge needs to build and test, idempotently: Debian
# packages (only those missing) and Python packages into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(
  cmake ninja-build g++ clang libclang-rt-dev pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev libspdlog-dev librapidcheck-dev libdlpack-dev
  libssl-dev zlib1g-dev
  # ISA-L's CRC-32 (loaded at run time, zlib's where it is missing): a restore hashes every byte as fast as
  # the page cache hands them.
  libisal2
  ocl-icd-opencl-dev opencl-headers pocl-opencl-icd
  # The Rust crate over the C ABI (bindings/rust): Debian's toolchain is the
  # crate's minimum (rust-version 1.63), so scripts/rust-tests.sh runs its
  # tests with it, and again with a rustup toolchain earlier on PATH.
  rustc cargo
  # Headless Chromium opens the flight recorder's page in tests/trace (ctest label trace).
  chromium
)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Python: a project-local virtual environment, so the system interpreter is untouched.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.devbridge-requirements
if ! cmp -s requirements-dev.txt "$stamp" 2>/dev/null; then
  echo "setup: installing Python packages from requirements-dev.txt"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  cp requirements-dev.txt "$stamp"
fi
