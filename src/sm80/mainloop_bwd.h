// The walk of one backward CTA: for its key block, over every query block
// (of every query head of its GQA group) that can see those keys, recompute
// P from lse, and accumulate dV += P^T dO, dK += dS^T Q in registers while dQ
// gets dS K added into the float32 workspace.
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "common/dropout.h"
#include "common/mask.h"
#include "common/mask_apply.h"
#include "common/mask_summary.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/utils_bwd.h"
#include "common/workspace_bwd.h"

namespace tfb::sm80::bwd {

// Which keys a CTA owns and which query steps it takes. A step is one query
// block of one query head; the heads of the GQA group follow one another, so
// dK and dV sum over the group in registers, in a fixed order. With a mask in
// memory the steps skip the query blocks whose tile it hides.
struct BwdBlock {
  int n_block, head_kv, batch, group;
  int len_q, len_k;  // the batch's (AttnFwdParams::seqlen_q / seqlen_k)
  // Where the batch starts, once per block: q and dO (params.h q_offset,
  // do_offset), and its row statistics of head 0 in the workspace with their
  // stride per head (BwdWorkspace::row0, head_stride).
  int64_t q_offset, do_offset, stat_row0, stat_head_stride;
  int m_begin;  // first query block that sees the keys (the mask's m_blocks)
  int m_count;  // query blocks per head from m_begin on
  // A mask in memory: this key block's column of the tile summary at head 0
  // (null for bands), with its strides per head and per query block.
  const uint8_t* kinds = nullptr;
  int64_t kinds_head_stride = 0;
  int kinds_row_stride = 0;

  template <class Walk>
  CUTE_DEVICE BwdBlock(const AttnBwdParams& p, const BwdWorkspace& ws, Walk const& mask, int n_block_, int head_kv_,
                       int batch_)
      : n_block(n_block_), head_kv(head_kv_), batch(batch_), group(p.heads_q / p.heads_kv),
        len_q(p.seqlen_q(batch_)), len_k(p.seqlen_k(batch_)), q_offset(p.q_offset(batch_)),
        do_offset(p.do_offset(batch_)), stat_row0(ws.row0(batch_, 0, p.heads_q)), stat_head_stride(ws.head_stride()) {
    const auto m_blocks = mask.m_blocks(n_block);
    m_begin = m_blocks.begin;
    m_count = m_blocks.end - m_blocks.begin;
    if constexpr (mask::kReadsMemory<typename Walk::Policy>) {
      kinds = p.mask.tile_kinds + batch * p.mask.tile_kinds_batch_stride + n_block;
      kinds_head_stride = p.mask.tile_kinds_head_stride;
      kinds_row_stride = p.mask.tile_kinds_n_blocks;
    }
  }

  struct Step {
    int head_q, m_block;
  };
  CUTE_DEVICE bool done(Step s) const { return s.head_q >= (head_kv + 1) * group; }
  CUTE_DEVICE bool skipped(Step s) const {
    return kinds != nullptr && kinds[s.head_q * kinds_head_stride + s.m_block * kinds_row_stride] ==
                                   uint8_t(mask::TileKind::kHidden);
  }
  CUTE_DEVICE Step advance(Step s) const {
    return s.m_block + 1 < m_begin + m_count ? Step{s.head_q, s.m_block + 1} : Step{s.head_q + 1, m_begin};
  }
  CUTE_DEVICE Step next(Step s) const {
    do {
      s = advance(s);
    } while (!done(s) && skipped(s));
    return s;
  }
  CUTE_DEVICE Step first() const {
    const Step s{m_count > 0 ? head_kv * group : (head_kv + 1) * group, m_begin};
    return done(s) || !skipped(s) ? s : next(s);
  }
};

// Policy: a band (mask.h Band) or a mask in memory (FromMemory, FromMemoryAdditive).
template <class Traits, class Policy>
struct BwdMainloop {
  using Element = typename Traits::Element;
  static constexpr int kM = Traits::kBlockM, kN = Traits::kBlockN, kE = Traits::kHeadDim;
  using Mask = mask::TileWalk<kM, kN, Policy>;
  using TileQ = Shape<Int<kM>, Int<kE>>;
  using TileKV = Shape<Int<kN>, Int<kE>>;

  Element* smem;
  int tid;

  CUTE_DEVICE Element* q_buf(int stage) const { return smem + Traits::kOffQ + stage * Traits::kQElems; }
  CUTE_DEVICE Element* do_buf(int stage) const { return smem + Traits::kOffdO + stage * Traits::kQElems; }
  template <class Layout>
  CUTE_DEVICE static auto view(Element* ptr, Layout layout) { return make_tensor(make_smem_ptr(ptr), layout); }

  // Rows at and past rows_valid and columns at and past cols (the tensor's
  // head dim) are zero-filled.
  template <class Gmem, class Smem>
  CUTE_DEVICE void load_tile(Gmem const& g, Smem&& s, int rows_valid, int cols) const {
    typename Traits::GmemLoad tc;
    auto thr = tc.get_thread_slice(tid);
    Tensor coord = thr.partition_S(make_identity_tensor(shape(g)));
    copy_rows_zfill(tc, thr.partition_S(g), thr.partition_D(s), coord, rows_valid, cols);
  }

  CUTE_DEVICE void load_k_v(const AttnBwdParams& p, const BwdBlock& blk) const {
    const int n0 = blk.n_block * kN;
    const Element* k = static_cast<const Element*>(p.k) + p.k_offset(blk.batch) + blk.head_kv * p.k_head_stride +
                       n0 * p.k_row_stride;
    const Element* v = static_cast<const Element*>(p.v) + p.v_offset(blk.batch) + blk.head_kv * p.v_head_stride +
                       n0 * p.v_row_stride;
    using Layout = typename Traits::SmemLayoutKV;
    load_tile(make_tensor(make_gmem_ptr(k), TileKV{}, make_stride(p.k_row_stride, _1{})),
              view(smem + Traits::kOffK, Layout{}), blk.len_k - n0, p.qk_dim);
    load_tile(make_tensor(make_gmem_ptr(v), TileKV{}, make_stride(p.v_row_stride, _1{})),
              view(smem + Traits::kOffV, Layout{}), blk.len_k - n0, p.v_dim);
  }

  // Q (or dO, with the dO pointer, batch offset and strides) of one step into a stage.
  CUTE_DEVICE void load_rows_of(const void* base, int64_t batch_offset, int64_t head_stride, int64_t row_stride,
                                int cols, const BwdBlock& blk, BwdBlock::Step step, Element* s) const {
    const int h = step.head_q, m0 = step.m_block * kM;
    const Element* g = static_cast<const Element*>(base) + batch_offset + h * head_stride + m0 * row_stride;
    load_tile(make_tensor(make_gmem_ptr(g), TileQ{}, make_stride(row_stride, _1{})),
              view(s, typename Traits::SmemLayoutQ{}), blk.len_q - m0, cols);
  }
  CUTE_DEVICE void load_q(const AttnBwdParams& p, const BwdBlock& blk, BwdBlock::Step step, int stage) const {
    load_rows_of(p.q, blk.q_offset, p.q_head_stride, p.q_row_stride, p.qk_dim, blk, step, q_buf(stage));
  }
  CUTE_DEVICE void load_do(const AttnBwdParams& p, const BwdBlock& blk, BwdBlock::Step step, int stage) const {
    load_rows_of(p.dout, blk.do_offset, p.do_head_stride, p.do_row_stride, p.v_dim, blk, step, do_buf(stage));
  }

  // Float accumulator fragment -> dtype -> shared tile (for the transposed
  // reads); with `value`, value(x) of each.
  template <class Acc>
  CUTE_DEVICE void store_frag(Acc const& acc, Element* s) const {
    store_regs(convert_fragment<Element>(acc), s);
  }
  template <class Acc, class Value>
  CUTE_DEVICE void store_frag(Acc const& acc, Element* s, Value value) const {
    Tensor r = make_tensor<Element>(acc.layout());
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) r(i) = Element(value(acc(i)));
    store_regs(r, s);
  }
  template <class Regs>
  CUTE_DEVICE void store_regs(Regs const& r, Element* s) const {
    auto r2s = make_tiled_copy_C(typename Traits::StoreFrag{}, typename Traits::TiledMmaSdP{});
    auto thr = r2s.get_thread_slice(tid);
    Tensor src = thr.retile_S(r);
    Tensor dst = thr.partition_D(view(s, typename Traits::SmemLayoutP{}));
    copy(r2s, src, dst);
  }

  // dq_accum: the split of the dQ accumulator this CTA adds into.
  template <bool kDropout, class AccdK, class AccdV>
  CUTE_DEVICE void run(const AttnBwdParams& p, const BwdWorkspace& ws, float* dq_accum, const BwdBlock& blk,
                       AccdK& acc_dk, AccdV& acc_dv) const {
    using LoadN = typename Traits::LoadN;
    using LoadT = typename Traits::LoadT;
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);

    Tensor sK = view(smem + Traits::kOffK, typename Traits::SmemLayoutKV{});
    Tensor sV = view(smem + Traits::kOffV, typename Traits::SmemLayoutKV{});
    Tensor sKt = view(smem + Traits::kOffK, typename Traits::SmemLayoutKVt{});
    Tensor sdS = view(smem + Traits::kOffdS, typename Traits::SmemLayoutP{});
    Tensor sPt = view(smem + Traits::kOffP, typename Traits::SmemLayoutPt{});
    Tensor sdSt = view(smem + Traits::kOffdS, typename Traits::SmemLayoutPt{});

    // (row, col) of each accumulator element of S and dP, within the tile.
    Tensor coord = acc_rowcol(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{})));
    constexpr int kRows = decltype(size<0>(coord))::value;
    constexpr int kCols = decltype(size<1>(coord))::value;

    const int n0 = blk.n_block * kN;

    load_k_v(p, blk);
    BwdBlock::Step cur = blk.first();
    if (!blk.done(cur)) {
      load_q(p, blk, cur, 0);
      load_do(p, blk, cur, 0);
    }
    cp_async_fence();

    for (int step = 0; !blk.done(cur); ++step) {
      const int sq = Traits::kStagesQ == 2 ? step & 1 : 0;
      const int sdo = Traits::kStagesdO == 2 ? step & 1 : 0;
      const BwdBlock::Step nxt = blk.next(cur);
      const bool has_next = !blk.done(nxt);
      const Mask mask{mask::policy_of<Policy>(p, blk.batch, cur.head_q, blk.len_q, blk.len_k)};
      const int m0 = cur.m_block * kM;
      const int64_t stat0 = blk.stat_row0 + cur.head_q * blk.stat_head_stride + m0;

      // Everything issued so far (this step's Q and dO) has landed, and every
      // warp is done with the previous step's shared tiles.
      cp_async_wait<0>();
      __syncthreads();
      if (has_next) {
        if (Traits::kStagesQ == 2) load_q(p, blk, nxt, sq ^ 1);
        if (Traits::kStagesdO == 2) load_do(p, blk, nxt, sdo ^ 1);
        cp_async_fence();
      }

      float lse[kRows], dsum[kRows];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(coord(r, 0));
        lse[r] = ws.lse_log2[stat0 + row];
        dsum[r] = ws.dsum[stat0 + row];
      }

      // P = exp(scale * S - lse). Padded query rows have lse = +inf, hence
      // P = 0; masked keys are zeroed explicitly. P goes to shared memory
      // before dP is computed, so that its stores overlap the dP GEMM.
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kM>, Int<kN>>{});
      clear(acc_s);
      gemm_ss_tile<LoadN, LoadN>(acc_s, mma_sdp, view(q_buf(sq), typename Traits::SmemLayoutQ{}), sK, tid);
      const bool need_mask = mask.needs_predicate(cur.m_block, blk.n_block);
      Tensor prob = acc_rowcol(acc_s);
      // Masked tiles take their own unrolled pass, in which row r keeps the
      // band's columns of the tile: a branch per score (the obvious `if
      // (hidden) x = 0`) splits the pass into basic blocks and serialises each
      // exp2 behind the one before.
      auto exp_scores = [&](auto masked) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          int col_begin = 0, col_end = kN;
          if constexpr (decltype(masked)::value && !mask::kReadsMemory<Policy>) {
            const int row = m0 + get<0>(coord(r, 0));
            col_begin = mask.policy.key_begin(row) - n0;
            col_end = mask.policy.key_end(row) - n0;
          }
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const float x = exp2f(fmaf(prob(r, c), p.scale_log2, -lse[r]));
            if constexpr (decltype(masked)::value) {
              const int col = get<1>(coord(r, c));
              prob(r, c) = col < col_end && col >= col_begin ? x : 0.f;
            } else {
              prob(r, c) = x;
            }
          }
        }
      };
      if constexpr (mask::kReadsMemory<Policy>) {
        bool values = false;
        if constexpr (mask::kAddsValues<Policy>) {
          values = need_mask && mask::apply_values<kN>(mask.policy, mask.policy.kind(cur.m_block, blk.n_block), prob,
                                                       coord, m0, n0, mask.policy.values_scale);
        }
        if (values) {
          // Additive and floored tiles: scale (q.k + value / scale) is scale
          // q.k + value whatever scale's sign. Pairs whose scaled logit is -inf
          // (hidden) and keys past len_k take P = 0, whatever the row's lse (a
          // row that sees no key may come with -inf).
          const int col_end = mask.policy.len_k - n0;
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < kCols; ++c) {
              const float y = prob(r, c) * p.scale_log2;
              prob(r, c) = get<1>(coord(r, c)) < col_end && y != -INFINITY ? exp2f(y - lse[r]) : 0.f;
            }
          }
        } else if (need_mask) {
          // Mixed tiles: P of the scores the mask hides becomes 0 (after the
          // exp2: a hidden score of -inf times a negative scale would give inf).
          exp_scores(cute::false_type{});
          mask::apply_rows<kN>(mask.policy, prob, coord, m0, n0, 0.f, 0.f);
        } else {
          exp_scores(cute::false_type{});
        }
      } else if (need_mask) {
        exp_scores(cute::true_type{});
      } else {
        exp_scores(cute::false_type{});
      }
      // Dropout: dV takes the kept P times 1 / (1 - p); dS wants P whole and
      // which pairs were kept, so a dropped P keeps its value with its sign
      // flipped until then.
      if constexpr (kDropout) {
        Dropout::of(p.dropout, blk.batch, cur.head_q, p.heads_q).for_each(coord, m0, n0, [&](int r, int c, bool kept) {
          prob(r, c) = kept ? prob(r, c) : -prob(r, c);
        });
        store_frag(acc_s, smem + Traits::kOffP, [keep_scale = p.dropout.keep_scale](float x) {
          return (__float_as_uint(x) >> 31) != 0u ? 0.f : x * keep_scale;
        });
      } else {
        store_frag(acc_s, smem + Traits::kOffP);
      }

      // dS = P * (dP - D); with dropout, P * (dP kept / (1 - p) - D)
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kM>, Int<kN>>{});
      clear(acc_dp);
      gemm_ss_tile<LoadN, LoadN>(acc_dp, mma_sdp, view(do_buf(sdo), typename Traits::SmemLayoutQ{}), sV, tid);
      Tensor ds = acc_rowcol(acc_dp);
      if constexpr (kDropout) {
        const float keep_scale = p.dropout.keep_scale;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) {
            const float x = prob(r, c);
            ds(r, c) = fabsf(x) * (((__float_as_uint(x) >> 31) != 0u ? 0.f : ds(r, c) * keep_scale) - dsum[r]);
          }
        }
      } else {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) ds(r, c) = prob(r, c) * (ds(r, c) - dsum[r]);
        }
      }
      store_frag(acc_dp, smem + Traits::kOffdS);
      __syncthreads();

      gemm_ss_tile<LoadT, LoadT>(acc_dv, mma_dkv, sPt, view(do_buf(sdo), typename Traits::SmemLayoutQt{}), tid);
      if (Traits::kStagesdO == 1 && has_next) {
        // Single buffer: dO is dead after dV; its next tile lands during dQ and dK.
        __syncthreads();
        load_do(p, blk, nxt, 0);
        cp_async_fence();
      }

      // The atomics are fire-and-forget: they drain while dK is computed.
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<kE>>{});
      clear(acc_dq);
      gemm_ss_tile<LoadN, LoadT>(acc_dq, mma_dq, sdS, sKt, tid);
      float* dq_mine = dq_accum + stat0 * kE + tid;
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dq); ++i) atomicAdd(dq_mine + i * Traits::kThreads, acc_dq(i));

      gemm_ss_tile<LoadT, LoadT>(acc_dk, mma_dkv, sdSt, view(q_buf(sq), typename Traits::SmemLayoutQt{}), tid);
      if (Traits::kStagesQ == 1 && has_next) {
        __syncthreads();
        load_q(p, blk, nxt, 0);
        cp_async_fence();
      }
      cur = nxt;
    }
  }
};

}  // namespace tfb::sm80::bwd
