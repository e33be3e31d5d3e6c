// Online softmax over key tiles (exp2 form), for rows held in MMA accumulators.
//
// Scores arrive already multiplied by scale_log2 = scale * log2(e) (see
// scale_scores), and masked to -inf after that multiplication: with the scale
// applied first, a zero scale gives uniform attention instead of -inf * 0 = NaN,
// a negative scale needs no special case, and a row's largest score minus the
// running max is exactly 0. The fused alternative, one FFMA s * scale - max *
// scale per score, leaves a residual of half an ulp of max * scale, which is
// 2^13 for scores near 1e11 (bf16 inputs near 1e5) and turns exp2 into 0 or inf.
#pragma once

#include "sm80/utils.h"

namespace tfb {
namespace sm80 {

constexpr float kLn2 = 0.6931471805599453f;

template <class Engine, class Layout>
CUTE_DEVICE void scale_scores(Tensor<Engine, Layout>& acc, float scale_log2) {
#pragma unroll
  for (int i = 0; i < size(acc); ++i) acc(i) *= scale_log2;
}

template <int kRows>
struct OnlineSoftmax {
  // Per row this thread holds: running max of the scaled scores, and the sum
  // of 2^(s - max) over this thread's columns only (the quad's partial sums are
  // combined once, in finalize).
  Tensor<ArrayEngine<float, kRows>, Layout<Shape<Int<kRows>>>> row_max;
  Tensor<ArrayEngine<float, kRows>, Layout<Shape<Int<kRows>>>> row_sum;

  CUTE_DEVICE OnlineSoftmax() {
    fill(row_max, -INFINITY);
    fill(row_sum, 0.f);
  }

  // Folds a tile of scores into the running statistics: rescales acc_o's rows
  // for the new max and overwrites acc_s with unnormalised probabilities.
  // acc_s / acc_o are accumulator fragments (4, MMA_M, MMA_N) with kRows rows.
  template <class TensorS, class TensorO>
  CUTE_DEVICE void update(TensorS& acc_s, TensorO& acc_o) {
    Tensor s = acc_rowcol(acc_s);
    Tensor o = acc_rowcol(acc_o);
    update_rows(s, o);
  }

  // The same on (row, col) views of the fragments, for any MMA's layout.
  template <class RowColS, class RowColO>
  CUTE_DEVICE void update_rows(RowColS& s, RowColO& o) {
    static_assert(decltype(size<0>(o))::value == kRows);
    Tensor correction = update_stats(s);
    scale_rows(o, correction);
  }

  // update_rows without touching O: returns the per-row factor O must be
  // scaled by, so a kernel can compute it while a GEMM still writes O.
  template <class RowColS>
  CUTE_DEVICE auto update_stats(RowColS& s) {
    static_assert(decltype(size<0>(s))::value == kRows);
    Tensor new_max = make_tensor_like(row_max);
    copy(row_max, new_max);
    reduce_rows_local(s, new_max, MaxOp{});
    Tensor bias = make_tensor_like(row_max);
    Tensor correction = make_tensor_like(row_max);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      new_max(r) = lane_allreduce<4>(new_max(r), MaxOp{});
      // A row with no visible key yet keeps max -inf; bias 0 maps its -inf
      // scores (and the old max) to 0 instead of (-inf) - (-inf) = NaN.
      bias(r) = new_max(r) == -INFINITY ? 0.f : new_max(r);
      correction(r) = exp2f(row_max(r) - bias(r));
      row_sum(r) *= correction(r);
      row_max(r) = new_max(r);
    }
    exp2_rows(s, bias);
    reduce_rows_local(s, row_sum, SumOp{});
    return correction;
  }

  // Normalises acc_o and returns, per row, the natural-log logsumexp of the
  // scaled scores, max * ln(2) + ln(sum). A row whose sum is 0 (no visible key,
  // or every score -inf) or NaN keeps acc_o as it is and gets lse +inf, as
  // PyTorch's flash kernels do: the backward's P = exp(s - lse) is then 0 for
  // its finite scores, and NaN stays where the forward had it.
  template <class TensorO>
  CUTE_DEVICE auto finalize(TensorO& acc_o) {
    Tensor o = acc_rowcol(acc_o);
    return finalize_rows(o);
  }

  template <class RowColO>
  CUTE_DEVICE auto finalize_rows(RowColO& o) {
    Tensor lse = make_tensor_like(row_sum);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = lane_allreduce<4>(row_sum(r), SumOp{});
      const bool empty = sum == 0.f || sum != sum;
      const float inv = empty ? 1.f : 1.f / sum;
      lse(r) = empty ? INFINITY : row_max(r) * kLn2 + __logf(sum);
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
    }
    return lse;
  }
};

}  // namespace sm80
}  // namespace tfb
