#!/usr/bin/env bash
# One device call for dropout: its GPU tests, compute-sanitizer memcheck on
# scripts/sanitize_small.py's dropout grid, the benchmark beside PyTorch's
# backends (bf16, p = $P, forward+backward), then the GPU tests of the paths
# it touched. Logs under $OUT. Each step's time limit: STEP_S (default 170 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
P=${P:-0.1}
S=${STEP_S:-170}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() { echo "== $(date +%T) $*"; }
step "tests: test/test_dropout.py"
timeout "$S" python3 -m pytest -q -m gpu -rfE -p no:cacheprovider test/test_dropout.py > "$OUT/test_dropout.log" 2>&1
tail -25 "$OUT/test_dropout.log"
step "benchmark"
timeout "$S" python3 benchmarks/bench_sdpa.py --dropout "$P" --modes "${MODES:-fwdbwd}" --head-dims "${DIMS:-64,128,256}" \
  --lens "${LENS:-1024,4096,16384}" --backends ours,ours-nodrop,flash,cudnn,efficient --reps "${REPS:-10}" --warmup 3 \
  2>&1 | tee "$OUT/bench_dropout.md"
step "memcheck: sanitize_small.py dropout"
timeout "$S" compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/sanitize_small.py dropout \
  > "$OUT/memcheck_dropout.log" 2>&1; echo "rc=$?"; tail -3 "$OUT/memcheck_dropout.log"
if [[ -n "${MORE_TESTS:-}" ]]; then
  step "tests: $MORE_TESTS"
  # shellcheck disable=SC2086
  timeout "$S" python3 -m pytest -q -m gpu -rfE -p no:cacheprovider $MORE_TESTS > "$OUT/tests_more.log" 2>&1
  tail -8 "$OUT/tests_more.log"
fi
