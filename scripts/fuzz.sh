#!/usr/bin/env bash
# Builds the libFuzzer target (CMake preset `fuzz`: clang with
# -fsanitize=fuzzer,address,undefined; only the target and the library are
# built) and runs it for FUZZ_SECONDS (default 60) over a scratch copy of the
# seed corpus (tests/fuzz/corpus/, which stays untouched). Exits non-zero on
# any finding: a disagreement with the reference model, a sanitizer report, a
# crash, a hang or running out of memory. The finding's input is kept in
# FUZZ_ARTIFACTS (default build/fuzz-artifacts); replay it with
#   build/fuzz/tests/fuzz/$FUZZ_TARGET <file>
# Prints executions per second and the total executions.
#
# FUZZ_TARGET picks the target: devbridge_fuzz (the default: the bridge
# against the reference model, seeds in tests/fuzz/corpus/) or
# devbridge_checkpoint_fuzz (the checkpoint header reader over hostile files,
# seeds in tests/fuzz/checkpoint_corpus/).
#
# FUZZ_ARGS adds libFuzzer flags (e.g. -jobs=N -workers=N, -seed=S; for long
# runs -entropic=0, whose bookkeeping otherwise takes about half the time);
# DEVBRIDGE_MODEL_RELAX (see tests/model/bridge_model.hpp, Config::relax)
# looks past known findings.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"
# FUZZ_PRESET=fuzz-fast builds without ASan (UBSan and the model only), about
# 1.75x the executions per second, for long runs.
preset="${FUZZ_PRESET:-fuzz}"
build="${FUZZ_BUILD:-build/$preset}"
artifacts="${FUZZ_ARTIFACTS:-build/fuzz-artifacts}"
jobs="${JOBS:-$(nproc)}"
target="${FUZZ_TARGET:-devbridge_fuzz}"
case "$target" in
  devbridge_fuzz) corpus=tests/fuzz/corpus; target_args=() ;;
  # Inputs up to 64 KiB: the 50k-tensor seed is read truncated (it is whole
  # in tests/portable); mutating megabyte inputs would cost most of the run.
  devbridge_checkpoint_fuzz) corpus=tests/fuzz/checkpoint_corpus; target_args=(-max_len=65536) ;;
  *) echo "fuzz: unknown FUZZ_TARGET $target (devbridge_fuzz, devbridge_checkpoint_fuzz)" >&2; exit 2 ;;
esac

cmake --preset "$preset" -B "$build" >/dev/null
cmake --build "$build" --target "$target" -j "$jobs"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$artifacts"
cp "$corpus"/* "$work/corpus/"

# FUZZ_RUNS=N (with FUZZ_SEED, default 1) runs exactly N inputs from a fixed
# seed instead of a time: the same inputs on every machine, so CI's bounded
# run is reproducible; exploratory runs keep libFuzzer's random seed.
if [ -n "${FUZZ_RUNS:-}" ]; then
  bound=(-runs="$FUZZ_RUNS" -seed="${FUZZ_SEED:-1}")
  what="$FUZZ_RUNS inputs from seed ${FUZZ_SEED:-1}"
else
  bound=(-max_total_time="$seconds")
  what="${seconds}s"
fi
echo "fuzz: running $target for $what (artifacts in $artifacts)"
status=0
# allocator_may_return_null: a huge allocation the code under test asks for is
# its to refuse (AllocationFailed), not ASan's to abort on.
ASAN_OPTIONS="allocator_may_return_null=1:${ASAN_OPTIONS:-}" \
UBSAN_OPTIONS="print_stacktrace=1:${UBSAN_OPTIONS:-}" \
  "$build/tests/fuzz/$target" "${bound[@]}" "${target_args[@]}" -timeout=30 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" ${FUZZ_ARGS:-} "$work/corpus" >"$work/log" 2>&1 || status=$?

execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/log" | grep -o '[0-9]*$' | tail -1 || true)"
rate="$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$work/log" | grep -o '[0-9]*$' | tail -1 || true)"
# The fake backend reports on stderr whatever the bridge does to it that the
# contract forbids (memory freed under a copy or a part, a double free, a leak
# at its destruction): a finding too.
if [ "$status" -ne 0 ] || grep -qE 'devbridge model mismatch|checkpoint fuzz invariant broken|ERROR: (AddressSanitizer|libFuzzer|LeakSanitizer)|runtime error:|^FakeBackend: ' "$work/log"; then
  echo "fuzz: FINDING (exit $status) after ${execs:-?} executions:"
  grep -v -E '^(\s+NEW_FUNC|#[0-9]+\s+(NEW|REDUCE|pulse|INITED))' "$work/log" | tail -80
  ls -1 "$artifacts" | sed 's/^/fuzz: artifact: /'
  exit 1
fi
echo "fuzz: clean: ${execs:-?} executions ($what, ${rate:-?} exec/s)"
