#!/usr/bin/env bash
# Builds a binary timing the sm80 forward (head dims 64 and 128, bf16) of the
# working tree against the one of another commit, on the benchmark grid's
# shapes, calls of the two taken in turns:
#   bash benchmarks/sm80_ab/build.sh <commit>    # then run ./build/sm80_ab/run
# Both are compiled to compute_80 PTX, as the library ships them, so a Hopper
# part runs them through the driver's JIT, as it runs the library's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BASE=${1:?usage: build.sh <commit>}
OUT=${OUT:-$ROOT/build/sm80_ab}
rm -rf "$OUT/base" && mkdir -p "$OUT/base"
git -C "$ROOT" archive "$BASE" src | tar -x -C "$OUT/base"
CUTLASS=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
NVCC=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
FLAGS="-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math -I$CUTLASS -I$ROOT/benchmarks"
PTX="${PTX:--gencode=arch=compute_80,code=compute_80}"
cd "$OUT"
for e in 64 128; do
  $NVCC $FLAGS $PTX -I"$ROOT/src" -c "$ROOT/src/sm80/instantiations/fwd_hdim${e}_bf16_sm80.cu" -o head_$e.o &
  # The base's kernels live in namespace tfb::sm80_base, so both link into one binary.
  $NVCC $FLAGS $PTX -Dsm80=sm80_base -I"$OUT/base/src" -c "$OUT/base/src/sm80/instantiations/fwd_hdim${e}_bf16_sm80.cu" -o base_$e.o &
done
wait
$NVCC $FLAGS -gencode=arch=compute_90a,code=sm_90a -I"$ROOT/src" -c "$ROOT/benchmarks/sm80_ab/main.cu" -o main.o
$NVCC -gencode=arch=compute_90a,code=sm_90a main.o head_*.o base_*.o -o run
echo "built $OUT/run (working tree against $BASE)"
