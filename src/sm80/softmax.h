// Online softmax over key tiles (exp2 form), for rows held in MMA accumulators.
//
// Scores arrive unscaled (raw q.k). The running max is kept in the same units;
// scale_log2 = scale * log2(e) turns score - max into a power of two, so each
// probability costs one FFMA and one ex2. Requires scale_log2 >= 0: a kernel
// with a negative scale negates the scores first (negate_scores below).
#pragma once

#include "sm80/utils.h"

namespace tfb {
namespace sm80 {

template <class Engine, class Layout>
CUTE_DEVICE void negate_scores(Tensor<Engine, Layout>& acc) {
#pragma unroll
  for (int i = 0; i < size(acc); ++i) acc(i) = -acc(i);
}

template <int kRows>
struct OnlineSoftmax {
  // Per row this thread holds: running max of the raw scores, and the sum of
  // 2^((s - max) * scale_log2) over this thread's columns only (the quad's
  // partial sums are combined once, in finalize).
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
  CUTE_DEVICE void update(TensorS& acc_s, TensorO& acc_o, float scale_log2) {
    Tensor s = acc_rowcol(acc_s);
    Tensor o = acc_rowcol(acc_o);
    update_rows(s, o, scale_log2);
  }

  // The same on (row, col) views of the fragments, for any MMA's layout.
  template <class RowColS, class RowColO>
  CUTE_DEVICE void update_rows(RowColS& s, RowColO& o, float scale_log2) {
    static_assert(decltype(size<0>(o))::value == kRows);
    Tensor correction = update_stats(s, scale_log2);
    scale_rows(o, correction);
  }

  // update_rows without touching O: returns the per-row factor O must be
  // scaled by, so a kernel can compute it while a GEMM still writes O.
  template <class RowColS>
  CUTE_DEVICE auto update_stats(RowColS& s, float scale_log2) {
    static_assert(decltype(size<0>(s))::value == kRows);
    Tensor new_max = make_tensor_like(row_max);
    copy(row_max, new_max);
    reduce_rows_local(s, new_max, MaxOp{});
    Tensor max_scaled = make_tensor_like(row_max);
    Tensor correction = make_tensor_like(row_max);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      new_max(r) = lane_allreduce<4>(new_max(r), MaxOp{});
      max_scaled(r) = new_max(r) * scale_log2;
      // 2^((old - new) * scale_log2); the old max is -inf before the first
      // visible key, giving 0 (and never (-inf) - (-inf)).
      const float bias = new_max(r) == -INFINITY ? 0.f : max_scaled(r);
      correction(r) = exp2f(row_max(r) * scale_log2 - bias);
      row_sum(r) *= correction(r);
      row_max(r) = new_max(r);
    }
    exp2_rows(s, max_scaled, scale_log2);
    reduce_rows_local(s, row_sum, SumOp{});
    return correction;
  }

  // Normalises acc_o and returns, per row, the natural-log logsumexp of the
  // scaled scores: max * scale + ln(sum). A row that saw no key gets output 0
  // and lse -inf.
  template <class TensorO>
  CUTE_DEVICE auto finalize(TensorO& acc_o, float scale) {
    Tensor o = acc_rowcol(acc_o);
    return finalize_rows(o, scale);
  }

  template <class RowColO>
  CUTE_DEVICE auto finalize_rows(RowColO& o, float scale) {
    Tensor lse = make_tensor_like(row_sum);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = lane_allreduce<4>(row_sum(r), SumOp{});
      const bool empty = sum == 0.f || sum != sum;
      const float inv = empty ? 0.f : 1.f / sum;
      lse(r) = empty ? -INFINITY : row_max(r) * scale + __logf(sum);
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
    }
    return lse;
  }
};

}  // namespace sm80
}  // namespace tfb
