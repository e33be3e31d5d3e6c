// The backward's softmax stage: from one step's S^T and dP^T accumulators,
// P^T and dS^T in their place (BwdMainloop::scores_and_grads issues the two
// wgmmas, then calls this).
#pragma once

#include <cute/tensor.hpp>

#include "common/dropout.h"
#include "common/mask.h"
#include "common/mask_apply.h"
#include "sm90/utils.h"

namespace tfb {
namespace sm90 {

// In place, as the wgmmas of acc_s and then acc_dp complete:
//   P^T = exp2(S^T scale_log2 - lse_log2),  dS^T = P^T (dP^T - D).
// coord: (key, query) of each value within the slice that starts at key k0
// and query q0 of the tiles; lse and dsum: the tile's row statistics.
// Padded query rows have lse = +inf, so their P is 0; where predicate,
// hidden pairs are zeroed (a mask in memory: by `pieces`, mask_apply.h's
// load_bit_pieces'). With dropout (of batch, head_q's pairs), dV's P^T is the
// kept one times 1 / (1 - p) and dS^T = P^T (dP^T kept / (1 - p) - D).
template <int kBlockM, int kBlockN, class Policy, bool kDropout, class Params, class Acc, class Coord, class Mask,
          int kPieces>
CUTE_DEVICE void softmax_grad(Params const& p, Acc& acc_s, Acc& acc_dp, Coord const& coord, float const* lse,
                              float const* dsum, Mask const& mask, bool predicate, uint32_t const (&pieces)[kPieces],
                              int batch, int head_q, int m_block, int n_block, int q0, int k0) {
  const float scale_log2 = p.scale_log2;
  constexpr int kRows = decltype(size<0>(coord))::value;
  constexpr int kCols = decltype(size<1>(coord))::value;
  warpgroup_wait<1>();
  warpgroup_fence_operand(acc_s);
  Tensor s = acc_rowcol(acc_s);
  auto exponentiate = [&] {
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const float l = lse[q0 + get<1>(coord(0, c))];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) s(r, c) = exp2f(fmaf(s(r, c), scale_log2, -l));
    }
  };
  if constexpr (mask::kReadsMemory<Policy>) {
    exponentiate();
    if (predicate) mask::apply_transposed(s, coord, mask.policy.len_k - (n_block * kBlockN + k0), pieces, 0.f);
  } else if (predicate) {
    const int key_base = n_block * kBlockN + k0;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int col = q0 + get<1>(coord(0, c));
      const float l = lse[col];
      const int row = m_block * kBlockM + col;
      const int key_begin = mask.policy.key_begin(row) - key_base, key_end = mask.policy.key_end(row) - key_base;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float x = exp2f(fmaf(s(r, c), scale_log2, -l));
        const int key = get<0>(coord(r, c));
        s(r, c) = key < key_end && key >= key_begin ? x : 0.f;
      }
    }
  } else {
    exponentiate();
  }
  // Dropout's draws while dP^T is still on the tensor cores, a bit per value.
  const auto kept = [&] {
    if constexpr (kDropout) {
      // q0 and the tile's first query are multiples of 32 (kernel_traits_bwd.h).
      return Dropout::of(p.dropout, batch, head_q, p.heads_q)
          .keep_bits_transposed(coord, n_block * kBlockN + k0, m_block * kBlockM + q0);
    } else {
      return 0;
    }
  }();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_dp);
  Tensor dp = acc_rowcol(acc_dp);
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) {
    const float d = dsum[q0 + get<1>(coord(0, c))];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if constexpr (kDropout) {
        // dV's P^T, and dS^T = P^T kept / (1 - p) dP^T - P^T D: four instructions, not six.
        const float kept_p = Dropout::kept_transposed<kCols>(kept, r, c) ? s(r, c) * p.dropout.keep_scale : 0.f;
        dp(r, c) = fmaf(kept_p, dp(r, c), -s(r, c) * d);
        s(r, c) = kept_p;
      } else {
        dp(r, c) = s(r, c) * (dp(r, c) - d);
      }
    }
  }
}

}  // namespace sm90
}  // namespace tfb
