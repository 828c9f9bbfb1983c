#!/usr/bin/env bash
# Instructions per operation of the seed workloads (bench/bridge_workloads),
# by the slope method of docs/DECISIONS.md: each workload runs under callgrind
# at N and at 2N operations, and the difference in instructions divided by
# the difference in operations leaves out everything paid once (start-up,
# pre-fill, the bridge's construction). Counts instructions, not time, so the
# figure does not move with the machine's load.
#
#   scripts/callgrind-slope.sh [BUILD_DIR] [WORKLOAD...]   # default build/release, a b c d e
#
# Prints one line per workload: `workload=<name> instructions_per_op=<x>`.
# An operation is the benchmark's own unit (a: one alloc_device + free_device;
# c: one copy). Each run makes 2 x N of them (bench's discarded warm-up
# repetition, then one timed): figures quoted before this script (issue #24's
# "a 362 -> 436", "e 417 -> 454") divided by N alone, and are twice these.
set -euo pipefail
cd "$(dirname "$0")/.."

build="${1:-build/release}"
shift || true
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(a b c d e)
bench="$build/bench/bridge_workloads"
n="${SLOPE_N:-100000}"
if [ ! -x "$bench" ]; then
  echo "callgrind-slope: no $bench; build it first (cmake --build --preset release --target bridge_workloads)" >&2
  exit 2
fi
command -v valgrind >/dev/null || { echo "callgrind-slope: valgrind is not installed" >&2; exit 2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

instructions() {  # workload, ops
  local out="$work/cg.$1.$2"
  BENCH_N="$2" BENCH_REPS=1 BENCH_SKIP_GROWTH=1 valgrind --tool=callgrind --callgrind-out-file="$out" \
    "$bench" --benchmark_filter="^$1_" >/dev/null 2>"$work/log" || { cat "$work/log" >&2; exit 1; }
  grep -m1 '^summary:' "$out" | awk '{print $2}'
}

for w in "${workloads[@]}"; do
  small="$(instructions "$w" "$n")"
  large="$(instructions "$w" "$((2 * n))")"
  # One warm-up repetition and one timed: each run makes 2 x N operations.
  awk -v w="$w" -v s="$small" -v l="$large" -v n="$n" \
    'BEGIN { printf "workload=%s instructions_per_op=%.1f\n", w, (l - s) / (2 * n) }'
done
