// Online softmax over key tiles (exp2 form), for rows held in MMA accumulators,
// on (row, col) views of them (each family views its own MMA layouts).
//
// Scores arrive unscaled (raw q.k). The running max is kept in the same units;
// scale_log2 = scale * log2(e) turns score - max into a power of two, so each
// probability costs one FFMA and one ex2. Requires scale_log2 >= 0: a kernel
// with a negative scale negates the scores first (negate_scores below), and
// scale_log2 > 0: masked scores are -inf, and -inf * 0 is NaN (the host passes
// FLT_MIN for a zero scale; every finite score times it gives 2^0 = 1).
//
// The FFMA leaves a residual of up to half an ulp of max * scale_log2 on the
// row's largest score: harmless below kFusedLimit (relative error under 2^-14),
// but for scores near 1e11 (bf16 inputs near 1e5) it is 2^13 and turns 2^x
// into 0 or inf. In a warp holding such a row, that row's scores are first
// scaled and shifted with the product rounded as the max's was (its own
// difference is then exactly 0), and the FFMA runs on them with scale 1, bias 0.
// The fix-up sits before the FFMA pass, in a branch the warp takes as one, so
// the common path keeps the pass and the row sums after it in one block (a
// branch between them cost the head dim 64 forward 9-13%). A kernel may also
// run without the fix-up and redo its work with it when a row needed it
// (update_stats' kExact).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/constants.h"
#include "common/fragment.h"

namespace tfb {

template <class Engine, class Layout>
CUTE_DEVICE void negate_scores(cute::Tensor<Engine, Layout>& acc) {
#pragma unroll
  for (int i = 0; i < cute::size(acc); ++i) acc(i) = -acc(i);
}

constexpr float kFusedLimit = 1024.f;

// kLog2PScale: probabilities come out times 2^kLog2PScale (FP8's P, scaled
// into e4m3's normal range at no cost: the shift rides on the exp's bias);
// the row sums carry the same factor, so O's normalisation is unchanged.
// kSumsInO: the kernel's P V also sums P into O's last column (sm90 FP8,
// kernel_traits_fwd.h kSumsInO), so no score is added here, and the sums are
// those of P as P V read it (rounded to e4m3), like O's own.
template <int kRows, int kLog2PScale = 0, bool kSumsInO = false>
struct OnlineSoftmax {
  // Per row this thread holds: running max of the raw scores, and the sum of
  // 2^((s - max) * scale_log2) over this thread's columns only (the quad's
  // partial sums are combined once, in finalize_rows).
  cute::Tensor<cute::ArrayEngine<float, kRows>, cute::Layout<cute::Shape<cute::Int<kRows>>>> row_max;
  cute::Tensor<cute::ArrayEngine<float, kRows>, cute::Layout<cute::Shape<cute::Int<kRows>>>> row_sum;
  // Set by each update: the factor O's rows are to be scaled by.
  cute::Tensor<cute::ArrayEngine<float, kRows>, cute::Layout<cute::Shape<cute::Int<kRows>>>> correction;

  CUTE_DEVICE OnlineSoftmax() {
    cute::fill(row_max, -INFINITY);
    cute::fill(row_sum, 0.f);
  }

  // Folds a tile of scores into the running statistics: rescales o's rows for
  // the new max and overwrites s with unnormalised probabilities. s / o are
  // (row, col) views with kRows rows. Returns update_stats' flag.
  template <bool kExact = true, class RowColS, class RowColO>
  CUTE_DEVICE bool update_rows(RowColS& s, RowColO& o, float scale_log2) {
    static_assert(decltype(cute::size<0>(o))::value == kRows);
    const bool inexact = update_stats<kExact>(s, scale_log2);
    scale_rows(o, correction);
    return inexact;
  }

  // update_rows without touching O: leaves in
  // `correction` the per-row factor O must be scaled by, so a kernel can apply
  // it once a GEMM still writing O is done.
  //
  // kExact = false leaves the fix-up out: in the sm80 forward ptxas turned it
  // into predicated work on every score (4-10% of that kernel's speed). It returns whether one of this thread's rows needed
  // the fix-up; the kernel then redoes its work with kExact = true.
  template <bool kExact = true, class RowColS>
  CUTE_DEVICE bool update_stats(RowColS& s, float scale_log2) {
    static_assert(decltype(cute::size<0>(s))::value == kRows);
    cute::Tensor new_max = cute::make_tensor_like(row_max);
    cute::copy(row_max, new_max);
    reduce_rows_local(s, new_max, MaxOp{});
    cute::Tensor bias = cute::make_tensor_like(row_max);
    cute::Tensor scale = cute::make_tensor_like(row_max);
    bool large = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      new_max(r) = lane_allreduce<4>(new_max(r), MaxOp{});
      // A row that has seen no visible key keeps max -inf; bias 0 maps its
      // -inf scores to 0 instead of (-inf) - (-inf) = NaN. Both products are
      // rounded alike (no FFMA), so an unchanged max gives a factor of exactly 1.
      bias(r) = new_max(r) == -INFINITY ? 0.f : __fmul_rn(new_max(r), scale_log2);
      correction(r) = exp2f(__fmul_rn(row_max(r), scale_log2) - bias(r));
      if constexpr (!kSumsInO) row_sum(r) *= correction(r);
      row_max(r) = new_max(r);
      scale(r) = scale_log2;
      large |= fabsf(bias(r)) >= kFusedLimit;
    }
    if constexpr (kExact) {
      if (__any_sync(0xffffffffu, large)) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (fabsf(bias(r)) >= kFusedLimit) {
#pragma unroll
            for (int c = 0; c < cute::size<1>(s); ++c) s(r, c) = __fmul_rn(s(r, c), scale_log2) - bias(r);
            scale(r) = 1.f;
            bias(r) = 0.f;
          }
        }
      }
    }
    if constexpr (kLog2PScale != 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) bias(r) -= float(kLog2PScale);
    }
    exp2_rows(s, bias, scale);
    if constexpr (!kSumsInO) reduce_rows_local(s, row_sum, SumOp{});
    return !kExact && large;
  }

  // Normalises acc_o (and scales it by out_scale: FP8's v descale, dropout's
  // 1 / (1 - p)) and returns, per row, the natural-log logsumexp of the
  // scaled scores: max * scale + ln(sum). A row whose sum is 0 (no visible key,
  // or every score -inf) keeps acc_o as it is, and one whose sum is NaN becomes
  // NaN (even where dropout kept none of its NaN pairs); both get lse +inf, as
  // PyTorch's flash kernels do: the backward's P = exp(s - lse) is then 0 for
  // its finite scores, and NaN stays where the forward had it. kSumsInO: o's
  // last column holds the rows' sums (in every lane of a quad).
  template <class RowColO>
  CUTE_DEVICE auto finalize_rows(RowColO& o, float scale, float out_scale = 1.f) {
    cute::Tensor lse = cute::make_tensor_like(row_sum);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = kSumsInO ? o(r, cute::size<1>(o) - 1) : lane_allreduce<4>(row_sum(r), SumOp{});
      const bool empty = sum == 0.f || sum != sum;
      const float inv = sum == 0.f ? out_scale : out_scale / sum;
      lse(r) = empty ? INFINITY : row_max(r) * scale + (__logf(sum) - float(kLog2PScale) * kLn2Float);
#pragma unroll
      for (int c = 0; c < cute::size<1>(o); ++c) o(r, c) *= inv;
    }
    return lse;
  }
};

}  // namespace tfb
