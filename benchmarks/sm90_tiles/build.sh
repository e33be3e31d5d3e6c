#!/usr/bin/env bash
# Builds a standalone binary timing sm90 forward tile variants against the sm80
# forward on the benchmark grid's shapes (torch-free: the launchers of src/ alone).
#   bash benchmarks/sm90_tiles/build.sh [variants.txt]   # then run ./build/sm90_tiles/run
# Each line of the variants file: name head_dim block_m block_n stages, where
# stages may carry further FwdTraits arguments ("2,true": Q from registers).
# With BASE="<commit> ...", each variant is also built from each commit's src/
# (as <name>_<commit>, its kernels in namespaces renamed so all link into one
# binary), and the versions are timed in turns. OUT=<dir> builds elsewhere.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VARIANTS=$(realpath "${1:-$ROOT/benchmarks/sm90_tiles/variants.txt}")
OUT=$(realpath -m "${OUT:-$ROOT/build/sm90_tiles}")
mkdir -p "$OUT"
CUTLASS=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
NVCC=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
FLAGS="-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -gencode=arch=compute_90a,code=sm_90a -I$ROOT/benchmarks -I$CUTLASS"
cd "$OUT"
bases=()
for commit in ${BASE:-}; do
  sha=$(git -C "$ROOT" rev-parse --short=7 "$commit")
  bases+=("$sha")
  # Extracted files carry the commit's time, so objects built from them stay valid.
  [[ -d base_$sha ]] || { mkdir base_$sha && git -C "$ROOT" archive "$sha" src | tar -x -C base_$sha; }
  # The renamed launchers check the call with the working tree's can_run_fwd.
  printf '#include "api.h"\nnamespace tfb { namespace sm90_%s {\nbool can_run_fwd(const AttnFwdParams& p) { return sm90::can_run_fwd(p); }\n} }\n' \
    "$sha" > api_$sha.cu
  [[ -f api_$sha.o ]] || $NVCC $FLAGS -I"$ROOT/src" -c api_$sha.cu -o api_$sha.o
done
for e in 64 128; do  # the reference the variants are checked against
  [[ -f sm80_$e.o ]] || $NVCC $FLAGS -I"$ROOT/src" -c "$ROOT/src/sm80/instantiations/fwd_hdim${e}_sm80.cu" -o sm80_$e.o
done
$NVCC $FLAGS -I"$ROOT/src" -DTFB_WITH_SM90 -c "$ROOT/src/sm90/api_sm90.cu" -o api_sm90.o
decls=""; table=""; objs=""
while read -r name e m n stages; do
  [[ -z "$name" ]] && continue
  echo "$name $e $m $n $stages $ROOT/src"
  for sha in "${bases[@]}"; do
    echo "${name}_$sha $e $m $n $stages $OUT/base_$sha/src -Dsm90=sm90_$sha -Dsm80=sm80_$sha"
  done
done < "$VARIANTS" > variants.resolved
while read -r name e m n stages src renames; do
  printf '#include "sm90/launch_fwd.h"\ncudaError_t %s(const tfb::AttnFwdParams& p, cudaStream_t s) {\n  return tfb::sm90::launch_fwd_with<tfb::sm90::FwdTraits<cutlass::bfloat16_t, %s, %s, %s, %s>>(p, s);\n}\n' \
    "$name" "$e" "$m" "$n" "$stages" > "v_$name.new"
  objs+=" v_$name.o"
  # Kept from an earlier build when neither the variant nor the sources changed.
  if cmp -s "v_$name.new" "v_$name.cu" && [[ -f "v_$name.o" && -z $(find "$src" -newer "v_$name.o" -name '*.h') ]]; then
    rm "v_$name.new"
  else
    mv "v_$name.new" "v_$name.cu"; rm -f "v_$name.o"
  fi
  decls+="cudaError_t $name(const tfb::AttnFwdParams&, cudaStream_t); "
  table+="{\"$name\", $e, &$name}, "
  [[ -f "v_$name.o" ]] && continue
  while (( $(jobs -rp | wc -l) >= ${JOBS:-2} )); do wait -n || true; done
  { $NVCC $FLAGS -I"$src" $renames -Xptxas -v -c "v_$name.cu" -o "v_$name.o" 2>&1 | grep -E "error|spill|serialized" | sed "s/^/$name: /"; } &
done < variants.resolved
wait
for o in $objs; do [[ -f $o ]] || { echo "$o failed to build"; exit 1; }; done
python - "$ROOT/benchmarks/sm90_tiles/main.cu" main.cu "$decls" "$table" <<'PY'
import sys
src, dst, decls, table = sys.argv[1:]
open(dst, "w").write(open(src).read().replace("//DECLS", decls).replace("//TABLE", table))
PY
$NVCC $FLAGS -I"$ROOT/src" -c main.cu -o main.o
$NVCC -gencode=arch=compute_90a,code=sm_90a main.o api_*.o sm80_*.o $objs -o run
echo "built $OUT/run"
