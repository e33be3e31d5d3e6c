#!/usr/bin/env bash
# A/B of built libraries in one run: each library in turn, ROUNDS rounds, one
# bench_sdpa.py process per library and round, rows prefixed with the library
# and round. The library in torch_flash_backend/lib is put back at the end.
#
#   bash benchmarks/ab_libs.sh "--head-dims 128 --lens 4096 --modes fwdbwd" old/libtorch_flash_backend.so new/libtorch_flash_backend.so
#   BENCH=bench_decode.py bash benchmarks/ab_libs.sh "--batch 8 --queries 1" old/... new/...
#
# Build each variant here, copy its torch_flash_backend/lib/libtorch_flash_backend.so
# to a folder of its own, and carry those folders to the GPU machine.
# benchmarks/ab_table.py turns the output into one table, each library's best
# against the first's.
set -eu  # no pipefail: a bench that fails prints its "no rows" line and the rounds go on
cd "$(dirname "$0")/.."
args=$1
shift
ROUNDS=${ROUNDS:-2}
BENCH=${BENCH:-bench_sdpa.py}
# a table row of that bench: bench_sdpa.py's start with the mode, bench_decode.py's with B (bench_fp8.py's E),
# bench_overhead.py's with the device, bench_varlen.py's with the batch's kind
case $BENCH in
  bench_decode.py|bench_fp8.py) ROW='^| [0-9]' ;;
  bench_overhead.py) ROW='^| c[up]' ;;
  bench_varlen.py) ROW='^| [a-z]* | [0-9]' ;;
  *) ROW='^| fwd' ;;
esac
lib=torch_flash_backend/lib/libtorch_flash_backend.so
saved=$(mktemp -d)
cp "$lib" "$saved/"
for candidate in "$@"; do cp "$candidate" "$saved/$(echo "$candidate" | tr / _)"; done
trap 'cp "$saved/libtorch_flash_backend.so" "$lib"' EXIT
for round in $(seq "$ROUNDS"); do
  for candidate in "$@"; do
    cp "$saved/$(echo "$candidate" | tr / _)" "$lib"
    # word splitting of $args is wanted: it holds several options
    # shellcheck disable=SC2086
    python3 "benchmarks/$BENCH" $args 2>&1 | { grep "$ROW" || echo "(no rows: $candidate)"; } | sed "s|^|$candidate r$round |"
  done
done
