#!/usr/bin/env bash
# Regenerates the compute role's checked-in PTX (src/backends/cuda/ptx) from
# src/backends/cuda/axpy_kernel.cu with nvcc. The build embeds those files
# as they are and never runs nvcc, so this script alone owns the nvcc flags
# and the architectures; CMake embeds whatever axpy_compute_<arch>.ptx exist.
#
#   scripts/regenerate-ptx.sh           rewrite the PTX files
#   scripts/regenerate-ptx.sh --check   compare them with what this nvcc
#                                       writes (ctest runs this); exit 77 when
#                                       no nvcc is found
#
# nvcc is looked for on PATH, then in $CUDA_PATH/bin, then /usr/local/cuda/bin.
# The comparison ignores the comment lines nvcc puts at the top (compiler
# version and build id), so only a change in the code itself counts.
set -euo pipefail
cd "$(dirname "$0")/.."

# PTX targets: Hopper's own, plus the oldest nvcc 13 still accepts, so any
# newer GPU gets a kernel by JIT. Ascending.
archs=(75 90)
# --fmad=false keeps the multiply and the add separately rounded (bit-exact
# with the host backend); -std=c++17 keeps host-compiler demands minimal.
flags=(-ptx --fmad=false -O3 -std=c++17)
kernel=src/backends/cuda/axpy_kernel.cu
ptx_dir=src/backends/cuda/ptx
skip_code=77

mode="write"
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac

find_nvcc() {
  local candidate
  for candidate in "$(command -v nvcc || true)" "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" /usr/local/cuda/bin/nvcc; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then
      printf '%s\n' "$candidate"
      return 0
    fi
  done
  return 1
}

if ! nvcc=$(find_nvcc); then
  echo "regenerate-ptx: no nvcc on PATH, in \$CUDA_PATH/bin or in /usr/local/cuda/bin" >&2
  [ "$mode" = check ] && exit "$skip_code"
  exit 1
fi

# The PTX without nvcc's leading comment block.
ptx_body() { awk 'body || !/^\/\//{ body = 1; print }' "$1"; }

generated=$(mktemp -d)
trap 'rm -rf "$generated"' EXIT
for arch in "${archs[@]}"; do
  "$nvcc" "${flags[@]}" -arch="compute_$arch" "$kernel" -o "$generated/axpy_compute_$arch.ptx"
done

if [ "$mode" = write ]; then
  mkdir -p "$ptx_dir"
  rm -f "$ptx_dir"/axpy_compute_*.ptx
  cp "$generated"/axpy_compute_*.ptx "$ptx_dir/"
  echo "regenerate-ptx: wrote $(cd "$generated" && echo axpy_compute_*.ptx) to $ptx_dir with $("$nvcc" --version | tail -n 1)"
  exit 0
fi

stale=0
for arch in "${archs[@]}"; do
  name=axpy_compute_$arch.ptx
  if [ ! -f "$ptx_dir/$name" ]; then
    echo "regenerate-ptx: $ptx_dir/$name is missing" >&2
    stale=1
  elif ! diff -u --label "$ptx_dir/$name" --label "nvcc's $name" \
    <(ptx_body "$ptx_dir/$name") <(ptx_body "$generated/$name") >&2; then
    stale=1
  fi
done
for checked_in in "$ptx_dir"/axpy_compute_*.ptx; do
  [ -e "$checked_in" ] || continue
  if [ ! -e "$generated/$(basename "$checked_in")" ]; then
    echo "regenerate-ptx: $checked_in is for an architecture this script does not build" >&2
    stale=1
  fi
done
if [ "$stale" -ne 0 ]; then
  echo "regenerate-ptx: the checked-in PTX differs from what $nvcc writes for $kernel;" \
    "run scripts/regenerate-ptx.sh and commit $ptx_dir" >&2
  exit 1
fi
echo "regenerate-ptx: $ptx_dir matches $("$nvcc" --version | tail -n 1)"
