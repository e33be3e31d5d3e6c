#!/usr/bin/env bash
# One command on a GPU machine: build (or use a carried build), run the GPU
# tests, compute-sanitizer on a small grid (forward pinned to sm80, then the
# default families), the main job and the benchmark; with scripts/compile_times.py
# present, its report too. Logs go to $OUT (or ./out). Choose steps with STEPS
# (default: all), e.g.
#   STEPS=tests,bench bash scripts/gpu_check.sh
# Steps outside the default: decode (benchmarks/bench_decode.py with $DECODE_ARGS,
# run once per ';'-separated argument list), masks (benchmarks/bench_masks.py
# with $MASK_ARGS), model (benchmarks/bench_model.py with $MODEL_ARGS) and cp
# (benchmarks/bench_cp.py under torchrun over every GPU, or $CP_RANKS of them,
# once per ';'-separated argument list in $CP_ARGS; default: causal and not, with
# --check).
# The tests step runs pytest with $TEST_ARGS (default -m gpu) over $TEST_PATHS
# (default: the whole test directory; e.g. TEST_PATHS="test/test_cuda_masks.py").
# SANITIZE_GRID names a grid of scripts/sanitize_small.py (sm80, default, windows, varlen, fp8,
# decode, masks) for the sanitize step (default: the sm80 and default passes).
# A build made on another machine against the same torch can be carried in
# torch_flash_backend/lib/; without one, the script builds here (needs the
# nvidia-cutlass wheel: pip-installed, or as a file under .whl/, as are
# other missing wheels such as expecttest).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STEPS=${STEPS:-env,compile_times,tests,sanitize,main,bench}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
has() { [[ ",$STEPS," == *",$1,"* ]]; }
step() { echo "== $(date +%T) $*"; }

# Wheels the machine lacks (nvidia-cutlass for a build, expecttest for the tests).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [[ ! -f torch_flash_backend/lib/libtorch_flash_backend.so ]]; then
  step "build"
  start=$(date +%s)
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build took $(( $(date +%s) - start )) s"
fi
# A compiler that links libstdc++ statically gives the library a private C++
# runtime: every exception it throws (a bad-argument error) then crashes the
# process. Such a build is refused; build with a toolchain that links it
# dynamically (CXX=...) or carry a build from another machine.
if nm -D --defined-only torch_flash_backend/lib/libtorch_flash_backend.so 2>/dev/null | grep -q ' T __cxa_throw$'; then
  echo "torch_flash_backend/lib/libtorch_flash_backend.so carries its own libstdc++ (static link): rebuild with CXX set to a g++ that links it dynamically"
  exit 1
fi

if has env; then
  step "environment"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  python3 -c "import torch, torch_flash_backend as t; print('torch', torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability()); print('kernels', t.built_kernels())"
  python3 -c "import torch, torch_flash_backend as t; q = torch.empty(2, 16, 1024, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True); print('bf16 E=128 causal:', t.explain(q, q, q, is_causal=True))"
fi
if has compile_times && [[ -f scripts/compile_times.py ]]; then
  step "compile times"
  python3 scripts/compile_times.py 2>&1 | tee "$OUT/compile_times.log" | tail -40
  [[ ${PIPESTATUS[0]} -eq 0 ]] || echo "(compile_times.py failed; a report only, the check goes on)"
fi
if has tests; then
  step "tests"
  # shellcheck disable=SC2086
  python3 -m pytest -q -rs ${TEST_ARGS:--m gpu} ${TEST_PATHS:-test} 2>&1 | tee "$OUT/tests.log" | tail -40 || status=1
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool"
    # shellcheck disable=SC2086
    compute-sanitizer --tool $tool --error-exitcode 3 python3 scripts/sanitize_small.py ${SANITIZE_GRID:-} \
      >"$OUT/sanitize_$tool${SANITIZE_GRID:+_$SANITIZE_GRID}.log" 2>&1 \
      && tail -3 "$OUT/sanitize_$tool${SANITIZE_GRID:+_$SANITIZE_GRID}.log" \
      || { status=1; tail -30 "$OUT/sanitize_$tool${SANITIZE_GRID:+_$SANITIZE_GRID}.log"; }
  done
fi
if has main; then
  step "main job"
  python3 -m torch_flash_backend 2>&1 | tee "$OUT/main.log" | tail -40 || status=1
fi
if has bench; then
  step "benchmark"
  python3 benchmarks/bench_sdpa.py --gemm --memory ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.md" || status=1
fi
if has decode; then
  IFS=';' read -ra runs <<<"${DECODE_ARGS:-}"
  for args in "${runs[@]:-}"; do
    step "decode benchmark $args"
    # shellcheck disable=SC2086
    python3 benchmarks/bench_decode.py $args 2>&1 | tee -a "$OUT/bench_decode.md" || status=1
  done
fi
if has masks; then
  step "mask benchmark"
  # shellcheck disable=SC2086
  python3 benchmarks/bench_masks.py ${MASK_ARGS:-} 2>&1 | tee "$OUT/bench_masks.md" || status=1
fi
if has model; then
  step "model benchmark"
  # shellcheck disable=SC2086
  python3 benchmarks/bench_model.py ${MODEL_ARGS:-} 2>&1 | tee "$OUT/bench_model.md" || status=1
fi
if has cp; then
  ranks=${CP_RANKS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
  IFS=';' read -ra runs <<<"${CP_ARGS:---check;--no-causal --check}"
  for args in "${runs[@]}"; do
    step "context parallelism over $ranks GPUs: bench_cp.py $args"
    # shellcheck disable=SC2086
    python3 -m torch.distributed.run --nproc-per-node "$ranks" benchmarks/bench_cp.py $args 2>&1 \
      | tee -a "$OUT/bench_cp.md"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
fi
step "done (status $status)"
exit $status
