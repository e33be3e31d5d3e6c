#!/usr/bin/env bash
# PyTorch's own flash-attention dropout tests (test/test_transformers.py of the
# installed torch's version, at $PT_TESTS) with our provider active
# (scripts/pytorch_sdpa_tests.py): the tests rebuild the math reference from the
# debug mask the flash op returns, so they check the mask our kernels applied.
#   PT_TESTS=/path/to/pytorch/test bash scripts/pytorch_sdpa_tests.sh
# K: the pytest -k selection (default: the flash dropout variants in bf16 and fp16).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
: "${PT_TESTS:?the directory holding PyTorch test/test_transformers.py}"
K=${K:-"(test_flash_attention_vs_math_ref_grads and dropout_p_0_22 and enable_gqa_False and scale0) or (test_fused_attention_vs_math_ref_grads_cudagraph and dropout_p_0_22 and fused_kernel0) or (test_flash_attention_vs_math_ref_grads_nestedtensor and dropout_p_0_1)"}
export PYTHONPATH=$PWD:$PWD/scripts:$PT_TESTS${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout "${STEP_S:-300}" python3 -m pytest -q -p pytorch_sdpa_tests -p no:cacheprovider -rfE --maxfail=20 \
  "$PT_TESTS/test_transformers.py" -k "$K" > "$OUT/pytorch_sdpa_tests.log" 2>&1
echo "rc=$?"
grep -E "passed|failed|served|passed on" "$OUT/pytorch_sdpa_tests.log" | tail -5
