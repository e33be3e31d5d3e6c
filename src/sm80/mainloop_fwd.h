// The forward mainloop: one CTA owns kBlockM query rows of one (batch, head)
// and walks the key tiles it sees from the last to the first, so the tiles that
// need masking (the diagonal, the sequence end) come first. Per tile:
// S = Q.K^T (both operands ldmatrix'ed from shared memory), mask, online
// softmax, O += P.V with P converted in registers to the A-operand layout.
#pragma once

#include "params.h"
#include "common/dropout.h"
#include "common/mask_apply.h"
#include "common/softmax.h"
#include "sm80/kernel_traits_fwd.h"
#include "sm80/utils.h"

namespace tfb {
namespace sm80 {

// Policy: a band (mask.h Band) or a mask in memory
// (FromMemory), whose hidden tiles the walk skips.
template <class Traits, class Policy>
struct FwdMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  using Mask = mask::TileWalk<kBlockM, kBlockN, Policy>;

  template <class T>
  CUTE_DEVICE static auto at_stage(T const& stage0, int stage) {
    return make_tensor(stage0.data() + stage * Traits::kTileKV, stage0.layout());
  }

  // Accumulates the tile's un-normalised output into acc_o and the row
  // statistics into softmax. Leaves no cp.async in flight and every thread
  // past its last read of Q's shared buffer (the epilogue reuses it). Returns
  // the softmax's flag: with kExact false, whether a row of this thread needs
  // the run redone with kExact.
  template <bool kExact, bool kDropout, class AccO, class Softmax>
  CUTE_DEVICE static bool run(AttnFwdParams const& p, char* smem, Mask const& mask, int m_block, int head,
                              int batch, AccO& acc_o, Softmax& softmax) {
    const int tid = threadIdx.x;
    const int kv_head = head / (p.heads_q / p.heads_kv);
    const int len_q = mask.policy.len_q, len_k = mask.policy.len_k;  // this batch's (p.seqlen_q / seqlen_k)
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

    auto rows = [](void const* base, int64_t batch_off, int64_t head_off, int len, int64_t row_stride) {
      auto ptr = static_cast<Element const*>(base) + batch_off + head_off;
      return make_tensor(make_gmem_ptr(ptr), make_shape(len, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
    };
    Tensor mQ = rows(p.q, p.q_offset(batch), head * p.q_head_stride, len_q, p.q_row_stride);
    Tensor mK = rows(p.k, p.k_offset(batch), kv_head * p.k_head_stride, len_k, p.k_row_stride);
    Tensor mV = rows(p.v, p.v_offset(batch), kv_head * p.v_head_stride, len_k, p.v_row_stride);
    Tensor gQ = local_tile(mQ, TileQ{}, make_coord(m_block, 0));  // (M, D)
    Tensor gK = local_tile(mK, TileKV{}, make_coord(_, 0));       // (N, D, n_block)
    Tensor gV = local_tile(mV, TileKV{}, make_coord(_, 0));

    Element* smem_q = reinterpret_cast<Element*>(smem);
    Element* smem_k = reinterpret_cast<Element*>(smem + Traits::kSmemQ);
    Element* smem_v = reinterpret_cast<Element*>(smem + Traits::kSmemQ + Traits::kSmemKV);
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
    // Stage 0's buffers; at_stage moves a view (or any partition of it) to another stage.
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});  // (N, D)
    Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutVt{});  // (D, N)
    Tensor sVtPlain = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutVtPlain{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});

    // Global -> shared.
    typename Traits::GmemLoad gmem_load;
    auto thr_load = gmem_load.get_thread_slice(tid);
    Tensor tQgQ = thr_load.partition_S(gQ);
    Tensor tQsQ = thr_load.partition_D(sQ);
    Tensor tQcQ = thr_load.partition_S(make_identity_tensor(TileQ{}));
    Tensor tKgK = thr_load.partition_S(gK);  // (CPY, CPY_N, CPY_D, n_block)
    Tensor tKsK = thr_load.partition_D(sK);  // (CPY, CPY_N, CPY_D)
    Tensor tVgV = thr_load.partition_S(gV);
    Tensor tVsV = thr_load.partition_D(sV);
    Tensor tKVcKV = thr_load.partition_S(make_identity_tensor(TileKV{}));
    auto load_k = [&](int n_block, int stage) {
      copy_rows_zfill(gmem_load, tKgK(_, _, _, n_block), at_stage(tKsK, stage), tKVcKV, len_k - n_block * kBlockN,
                      p.qk_dim);
    };
    auto load_v = [&](int n_block, int stage) {
      copy_rows_zfill(gmem_load, tVgV(_, _, _, n_block), at_stage(tVsV, stage), tKVcKV, len_k - n_block * kBlockN,
                      p.v_dim);
    };

    // Shared -> registers, MMA fragments.
    typename Traits::TiledMma mma;
    auto thr_mma = mma.get_thread_slice(tid);
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_mma.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K)
    Tensor tOrVt = thr_mma.partition_fragment_B(sVtPlain);
    auto copy_q = make_tiled_copy_A(typename Traits::SmemCopyQK{}, mma);
    auto copy_k = make_tiled_copy_B(typename Traits::SmemCopyQK{}, mma);
    auto copy_v = make_tiled_copy_B(typename Traits::SmemCopyVt{}, mma);
    auto thr_copy_q = copy_q.get_thread_slice(tid);
    auto thr_copy_k = copy_k.get_thread_slice(tid);
    auto thr_copy_v = copy_v.get_thread_slice(tid);
    Tensor tSsQ = thr_copy_q.partition_S(sQ);
    Tensor tSsK = thr_copy_k.partition_S(sK);   // (CPY, CPY_N, CPY_K)
    Tensor tOsVt = thr_copy_v.partition_S(sVt);  // (CPY, CPY_D, CPY_K)
    Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

    // A negative scale flips which score is largest; the softmax wants
    // scale >= 0, so such a kernel negates the scores instead.
    const bool flip = p.scale_log2 < 0.f;
    const float scale_log2 = fabsf(p.scale_log2);
    const int m0 = m_block * kBlockM;
    const int n_last = mask.visited_at_or_below(m_block, mask.n_blocks(m_block).end - 1);

    // A tile the mask hides entirely (or whose rows all precede a bottom-right
    // diagonal) loads nothing: no copy in flight for the epilogue's reuse of Q's buffer.
    if (n_last >= 0) {
      copy_rows_zfill(gmem_load, tQgQ, tQsQ, tQcQ, len_q - m0, p.qk_dim);
      load_k(n_last, 0);
    }
    cp_async_fence();
    if constexpr (kStages == 2) {
      if (n_last >= 0) load_v(n_last, 0);
      cp_async_fence();
    }

    Tensor o = acc_rowcol(acc_o);
    int stage = 0;
    bool inexact = false;
#pragma unroll 1
    for (int n_block = n_last, n_next; n_block >= 0; n_block = n_next) {
      n_next = mask.visited_at_or_below(m_block, n_block - 1);
      const int next = kStages == 2 ? stage ^ 1 : 0;
      cp_async_wait<kStages - 1>();  // K[n_block] (and Q) have landed
      __syncthreads();               // ... for every thread, and step n_block + 1 is done everywhere
      if constexpr (kStages == 2) {
        if (n_next >= 0) load_k(n_next, next);
      } else {
        load_v(n_block, 0);
      }
      cp_async_fence();

      Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_ss(mma, acc_s, tSrQ, tSrK, thr_copy_q.retile_D(tSrQ), thr_copy_k.retile_D(tSrK), tSsQ,
              at_stage(tSsK, stage), copy_q, copy_k);
      if (flip) negate_scores(acc_s);
      Tensor s = acc_rowcol(acc_s);
      if (mask.needs_predicate(m_block, n_block)) {
        mask::mask_scores<false>(mask, acc_s, tScS, s, acc_rowcol(tScS), m_block, n_block);
      }
      // With two stages V[n_block] is already on its way: do the softmax while it lands.
      if constexpr (kStages == 2) inexact |= softmax.template update_rows<kExact>(s, o, scale_log2);

      cp_async_wait<kStages - 1>();  // V[n_block] has landed
      __syncthreads();               // ... for every thread, and the buffer refilled next is unread
      if (n_next >= 0) {
        if constexpr (kStages == 2) {
          load_v(n_next, next);
        } else {
          load_k(n_next, 0);
        }
      }
      cp_async_fence();
      if constexpr (kStages == 1) inexact |= softmax.template update_rows<kExact>(s, o, scale_log2);
      // Dropout after the row sums (which count every pair); O's 1 / (1 - p) comes at the end.
      if constexpr (kDropout) {
        Dropout::of(p.dropout, batch, head, p.heads_q)
            .for_each(acc_rowcol(tScS), m0, n_block * kBlockN,
                      [&](int r, int c, bool kept) { s(r, c) = kept ? s(r, c) : 0.f; });
      }

      Tensor p_frag = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(p_frag.data(), acc_as_a_operand_layout(p_frag.layout()));
      gemm_rs(mma, acc_o, tOrP, tOrVt, thr_copy_v.retile_D(tOrVt), at_stage(tOsVt, stage), copy_v);
      stage = next;
    }
    return inexact;
  }
};

}  // namespace sm80
}  // namespace tfb
