#!/usr/bin/env bash
# Runs each fuzz target for SECONDS on a scratch copy of its committed corpus
# (tests/fuzz/corpus/<target>), so runs never modify the committed files.
# Fails on any crash, sanitizer report, leak, timeout or limit hit;
# the input that did it is left as BUILD/<target>-{crash,leak,oom,timeout}-*.
#   usage: tests/fuzz/run.sh BUILD_DIR SECONDS TARGET...   (make fuzz / make test-fuzz)
set -euo pipefail
build=$1 seconds=$2
shift 2

# Limits. Inputs are at most 4 KiB, so no legitimate allocation comes near
# 1 MiB (the largest: a HELLO's worker list, ~32 KiB): a bigger malloc means a
# length field was trusted. RSS peaks at ~90 MiB with ASan's quarantine held to
# 32 MiB (the default 256 MiB only costs memory and speed here); 256 MiB means
# a decoder keeps what it read.
flags=(-max_len=4096 -malloc_limit_mb=1 -rss_limit_mb=256 -timeout=10 -print_final_stats=1)
export ASAN_OPTIONS="quarantine_size_mb=32${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

here=$(cd "$(dirname "$0")" && pwd)
# Each target is one process on one core: FUZZ_JOBS of them at a time (default 2).
jobs=${FUZZ_JOBS:-2}

run_one() {
  local t=$1 work=$build/corpus/$1 log=$build/fuzz_$1.log start=$SECONDS
  rm -rf "$work" && mkdir -p "$work"
  cp "$here/corpus/$t"/* "$work/"
  if ! "$build/fuzz_$t" "${flags[@]}" -max_total_time="$seconds" -artifact_prefix="$build/$t-" \
      "$work" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz_$t FAILED (log: $log)" >&2
    return 1
  fi
  local execs rate rss cov
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
  echo "fuzz_$t: ok, $execs inputs in $((SECONDS - start)) s ($rate/s), $cov, peak RSS $rss MiB"
}

failed=0
pids=()
for t in "$@"; do
  run_one "$t" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
exit $failed
