#!/usr/bin/env bash
# `make bench`'s CUDA part (scripts/bench.sh calls it with BUILD set): the
# bridge against raw cuMemcpyAsync and torch. Without a GPU it says why and
# succeeds; it never fails on time (the bars are checked by `make gpu-check`).
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build/release}
OUT=$BUILD/bench-results
BENCH=$BUILD/bench/cuda/cuda_copy_bench
if [ ! -x "$BENCH" ]; then
  echo "cuda bench: not built (this build has no CUDA backend)"
  exit 0
fi
mkdir -p "$OUT"
rm -f "$OUT/cuda_copy.json" "$OUT/cuda_torch.json"
"$BENCH" --json "$OUT/cuda_copy.json" || exit 1
[ -f "$OUT/cuda_copy.json" ] || exit 0  # skipped: no GPU
PYTHON=$(command -v python3 || true)
[ -n "$PYTHON" ] || exit 0
"$PYTHON" bench/cuda/torch_copy_bench.py --json "$OUT/cuda_torch.json" || true
"$PYTHON" bench/cuda/report.py "$OUT/cuda_copy.json" "$OUT/cuda_torch.json" | tee "$OUT/cuda_table.md"
