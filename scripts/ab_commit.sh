#!/usr/bin/env bash
# On a GPU machine, against the build carried in torch_flash_backend/lib/: builds
# another commit's library (a tarball made here by
#   git archive -o .carry/base.tar <commit>
# and carried with the call), compares the machine code of every kernel in the
# two (scripts/sass_diff.py: a kernel whose SASS is the same runs the same), and
# times both with benchmarks/bench_sdpa.py, in turns. Logs under $OUT.
#
#   BASE_TAR=.carry/base.tar AB_ARGS="--head-dims 64,128 --lens 4096 --modes fwd,fwdbwd" bash scripts/ab_commit.sh
#
# NCU="FAMILY E CAUSAL" (e.g. "sm80 128 0"): also profiles one forward call,
# bf16 (4, 16, 4096, E), of that family in each tree with ncu (launch stats,
# occupancy, warp states, instruction and scheduler statistics), to
# $OUT/ncu_{base,new}.txt.
#
# BASE_LIB: the other commit's library built elsewhere against the same torch
# (then carried; it skips the build here, minutes of device time); the tarball
# then needs its torch_flash_backend/_built_for.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
BASE_TAR=${BASE_TAR:-.carry/base.tar}
mkdir -p "$OUT" /tmp/ab/base
if ls .whl/*.whl >/dev/null 2>&1; then  # nvidia-cutlass for the build, as scripts/gpu_check.sh
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
fi
tar -xf "$BASE_TAR" -C /tmp/ab/base
if [[ -n "${BASE_LIB:-}" ]]; then
  echo "== $(date +%T) $BASE_TAR with the library $BASE_LIB"
  mkdir -p /tmp/ab/base/torch_flash_backend/lib && cp "$BASE_LIB" /tmp/ab/base/torch_flash_backend/lib/libtorch_flash_backend.so
else
  echo "== $(date +%T) build of $BASE_TAR"
  start=$(date +%s)
  (cd /tmp/ab/base && CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace) \
    >"$OUT/ab_base_build.log" 2>&1 || { tail -40 "$OUT/ab_base_build.log"; exit 1; }
  echo "built in $(( $(date +%s) - start )) s"
fi
if [[ ${SASS:-1} != 0 ]]; then  # SASS=0 skips it (~100 s)
  echo "== $(date +%T) machine code, kernel by kernel"
  python3 scripts/sass_diff.py /tmp/ab/base/torch_flash_backend/lib/libtorch_flash_backend.so \
    torch_flash_backend/lib/libtorch_flash_backend.so | tee "$OUT/sass_diff.md" | tail -30
fi
if [[ -n "${NCU:-}" ]]; then
  read -r family e causal <<<"$NCU"
  for tree in /tmp/ab/base "$PWD"; do
    name=$([[ $tree == /tmp/ab/base ]] && echo base || echo new)
    echo "== $(date +%T) ncu, $name: $family forward, E $e, causal $causal"
    (cd "$tree" && TFB_KERNEL_FAMILIES=$family PYTHONPATH=$tree:${PYTHONPATH:-} ncu --kernel-name regex:fwd_kernel \
      --launch-skip 2 --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section InstructionStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      python3 -c "
import torch, torch_flash_backend as tfb
q, k, v = (torch.randn(4, 16, 4096, $e, device='cuda', dtype=torch.bfloat16) for _ in range(3))
for _ in range(4):
    tfb.flash_attn(q, k, v, is_causal=bool($causal))
torch.cuda.synchronize()
") >"$OUT/ncu_$name.txt" 2>&1
    grep -E "Duration|Registers Per|Achieved Occupancy|Executed Ipc A|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Local Memory|Executed Instructions  " \
      "$OUT/ncu_$name.txt" | sed "s|^|$name |"
  done
fi
# Each tree runs its own package with its own library (the two may differ in
# the ops' interface, which swapping libraries alone would trip on).
ROUNDS=${ROUNDS:-2}
if [[ -n "${AB_ARGS:-}" ]]; then
  echo "== $(date +%T) benchmarks/bench_sdpa.py $AB_ARGS, $ROUNDS rounds, base and new in turns"
  for round in $(seq "$ROUNDS"); do
    for tree in /tmp/ab/base "$PWD"; do
      name=$([[ $tree == /tmp/ab/base ]] && echo base || echo new)
      # shellcheck disable=SC2086
      (cd "$tree" && PYTHONPATH=$tree:${PYTHONPATH:-} python3 benchmarks/bench_sdpa.py $AB_ARGS >"$OUT/ab_$name.log" 2>&1)
      { grep "^| fwd" "$OUT/ab_$name.log" || { echo "(no rows: $name)"; tail -5 "$OUT/ab_$name.log"; }; } \
        | sed "s|^|$name r$round |"
    done
  done | tee "$OUT/ab.md"
fi
