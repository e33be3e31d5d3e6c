#!/usr/bin/env bash
# Builds a binary timing the sm80 forward (head dims 64 and 128, bf16) and
# backward (head dim 128) of the working tree against those of another commit,
# on the benchmark grid's shapes, calls of the two taken in turns:
#   bash benchmarks/sm80_ab/build.sh <commit>    # then run ./build/sm80_ab/run
# The base is compiled with -Dtfb=tfb_base (side.cu and the kernels), so the two
# link into one binary and each fills its own params struct. Both are compiled
# to compute_80 PTX, as the library ships them, so a Hopper part runs them
# through the driver's JIT, as it runs the library's. PTX=..., OUT=... override.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BASE=${1:?usage: build.sh <commit>}
OUT=$(realpath -m "${OUT:-$ROOT/build/sm80_ab}")
rm -rf "$OUT/base" && mkdir -p "$OUT/base"
git -C "$ROOT" archive "$BASE" src | tar -x -C "$OUT/base"
CUTLASS=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
NVCC=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
FLAGS="-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math -I$CUTLASS -I$ROOT/benchmarks"
PTX="${PTX:--gencode=arch=compute_80,code=compute_80}"
cd "$OUT"
sources=(sm80/instantiations/fwd_hdim64_sm80.cu sm80/instantiations/fwd_hdim128_sm80.cu
         sm80/instantiations/bwd_hdim128_sm80.cu sm80/bwd_workspace.cu)
for side in head base; do
  src=$ROOT/src; renames=""
  [[ $side == base ]] && { src=$OUT/base/src; renames="-Dtfb=tfb_base"; }
  for f in "${sources[@]}" side.cu; do
    path=$src/$f; [[ $f == side.cu ]] && path=$ROOT/benchmarks/sm80_ab/side.cu
    while (( $(jobs -rp | wc -l) >= ${JOBS:-2} )); do wait -n || true; done
    $NVCC $FLAGS $PTX $renames -I"$src" -c "$path" -o "${side}_$(basename "$f" .cu).o" &
  done
done
wait
for side in head base; do for f in "${sources[@]}" side.cu; do
  [[ -f ${side}_$(basename "$f" .cu).o ]] || { echo "${side}_$(basename "$f" .cu).o failed to build"; exit 1; }
done; done
$NVCC $FLAGS -gencode=arch=compute_90a,code=sm_90a -I"$ROOT/src" -c "$ROOT/benchmarks/sm80_ab/main.cu" -o main.o
$NVCC -gencode=arch=compute_90a,code=sm_90a main.o head_*.o base_*.o -o run
echo "built $OUT/run (working tree against $BASE)"
