// The forward's main loop, in its two roles.
//
// load(): one producer thread streams a tile's Q once and its K/V tiles
// through a kStages-deep ring of shared-memory buffers with TMA, each buffer
// completing on its own mbarrier (PipelineTmaAsync). K and V have separate
// barriers so S = Q K^T can start before V has landed.
//
// compute(): each consumer warpgroup runs, per key tile, S = Q K^T (wgmma, K
// from shared memory, Q from shared memory or registers), the mask, the online
// softmax, and O += P V (wgmma with P from registers). Two overlaps hide the
// softmax: within a warpgroup, the softmax of tile j runs while P V of tile
// j+1 is still on the tensor cores; across warpgroups, they take turns
// issuing GEMMs, so one's softmax runs while the other's GEMMs do. Key tiles
// are visited from the last to the first, so the tiles that need the causal or
// length mask come first and the rest run without per-element checks.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "params.h"
#include "common/dropout.h"
#include "common/mask_apply.h"
#include "common/softmax.h"
#include "sm90/mask_walk.h"
#include "sm90/tile_scheduler.h"
#include "sm90/transpose_v.h"
#include "sm90/utils.h"

namespace tfb {
namespace sm90 {

// Named barrier ids (0 is __syncthreads).
enum class Barrier : int {
  kEpilogue = 1,       // + consumer warpgroup index: its warps, around its O rows in shared memory
  kWarpgroupTurn = 4,  // + consumer warpgroup index: whose turn it is to issue Q K^T
  kForeignV = 7,       // every consumer: a packed tile's V rows of another sequence are cleared
  kProducer = 8,       // FP8: the producer warpgroup, around a dynamic scheduler's next unit
  kOInVt = 9           // every consumer: P V has read the last V tile before O takes its ring's bytes
};

// Policy: a band (mask.h Band) or a mask in memory
// (FromMemory), whose hidden key tiles both roles skip alike.
template <class Traits, class Policy>
struct FwdMainloop {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename cutlass::PipelineState<Traits::kStages>;
  using SharedStorage = typename Traits::SharedStorage;
  using Mask = mask::TileWalk<Traits::kBlockM, Traits::kBlockN, Policy>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  struct Params {
    typename Traits::TmaQ tma_q;
    typename Traits::TmaKV tma_k;
    typename Traits::TmaKV tma_v;
    typename Traits::GmemShape shape_q;  // (L, E, Hq, B)
    typename Traits::GmemShape shape_k;  // (S, E, Hkv, B)
    int group;                           // q heads per kv head
    float scale_log2;
    int heads_q;
    DropoutArgs dropout;
  };

  // Query tile m_block's key tiles, visited from the last it may see down to
  // the first, each with whether it needs the per-element pass. A mask in
  // memory's kinds come through a KindCursor (mask_walk.h; kWarp as there),
  // whose step i is key tile top - i.
  template <bool kWarp>
  struct KeyWalk {
    static constexpr bool kReadsMemory = mask::kReadsMemory<Policy>;
    struct KindAt {
      Mask const& mask;
      int m_block, top;
      CUTE_DEVICE mask::TileKind operator()(int i) const { return mask.policy.kind(m_block, top - i); }
    };
    Mask const& mask;
    int m_block;
    typename Mask::Steps steps;  // a band's range and clear tiles (mask.h TileWalk::steps)
    int top;
    KindCursor<kWarp, KindAt> kinds;

    CUTE_DEVICE KeyWalk(Mask const& mask_, int m_block_)
        : mask(mask_),
          m_block(m_block_),
          steps(mask_.steps(m_block_)),
          top(steps.end - 1),
          kinds(KindAt{mask_, m_block_, top}, top + 1) {}

    // The first key tile: the last visited, or tile 0 where none is (whose
    // scores the mask then hides, so that every query tile runs at least one
    // step and its rows come out empty).
    CUTE_DEVICE int first(bool& predicate) {
      if constexpr (kReadsMemory) {
        const int i = kinds.next(0);
        if (i > top) {
          predicate = true;
          return 0;
        }
        // Keys past len_k: the top tile alone holds them.
        predicate = kinds.partial_at(i) || (i == 0 && mask.past_len_k(top));
        return top - i;
      } else {
        const int n = mask.visited_at_or_below(steps, m_block, top);
        predicate = n < 0 || mask.needs_predicate(steps, m_block, n);
        return n < 0 ? 0 : n;
      }
    }
    // The next visited key tile below n (negative: none), n the last one given.
    CUTE_DEVICE int below(int n, bool& predicate) {
      if constexpr (kReadsMemory) {
        const int i = kinds.next(top - n + 1);
        predicate = i > top || kinds.partial_at(i);
        return top - i;
      } else {
        const int next = mask.visited_at_or_below(steps, m_block, n - 1);
        predicate = next >= 0 && mask.needs_predicate(steps, m_block, next);
        return next;
      }
    }
  };

  // Producer: one thread of the producer warpgroup issues every TMA load
  // (the leader); with FP8 inputs the whole warpgroup runs this walk and
  // transposes each V tile (transpose_v.h) one tile behind the loads, and a
  // dynamic scheduler's next unit reaches it through shared memory.
  // masks: anything with mask(batch, head) -> Mask (the kernel's params).
  template <class Scheduler, class Masks>
  CUTE_DEVICE static void load(Params const& p, SharedStorage& shared, Pipeline& pipeline_k,
                               Pipeline& pipeline_v, typename Traits::PipelineVt& pipeline_vt,
                               Scheduler const& scheduler, Masks const& masks, int thread_idx) {
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_k);
    const bool leader = thread_idx == 0;

    // FP8: V tile `stage` landed -> its transposed copy, keys past `keys` zero.
    // OPlace::kVt: the ring's bytes hold the previous tile's O until its stores
    // have read them (the first transpose of a tile waits for them).
    int o_wait = -1;  // the phase of o_free to wait for, or none
    auto transpose_v = [&](PipelineState const& stage, int keys) {
      if constexpr (Traits::kFp8) {
        if constexpr (Traits::kOPlace == Traits::OPlace::kVt) {
          if (o_wait >= 0) shared.o_free.wait(o_wait);
          o_wait = -1;
        }
        const PipelineState landed{stage.index(), stage.phase() ^ 1, stage.count()};
        pipeline_v.consumer_wait(landed);
        pipeline_vt.producer_acquire(stage);
        // Stages kBlockN * (kHeadDim or kPVCols) bytes apart (test/cpp/transpose_layout_check.cu).
        auto const* landed_v = reinterpret_cast<uint8_t const*>(shared.v.data()) + stage.index() * kBlockN * kHeadDim;
        auto* vt = reinterpret_cast<uint8_t*>(shared.vt.data()) + stage.index() * kBlockN * Traits::kPVCols;
        transpose_v_tile<kBlockN, kHeadDim, Traits::kPVCols>(landed_v, vt, keys, thread_idx);
        cutlass::arch::fence_view_async_shared();  // the wgmma reads through the async proxy
        pipeline_vt.producer_commit(stage);
        pipeline_v.consumer_release(landed);
      }
    };

    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    int local_tile_count = 0;
    int pos = scheduler.first();
    for (; scheduler.valid(pos); ++local_tile_count) {
      // Taken first: a dynamic scheduler's next unit comes back while this one loads.
      int next_pos = 0;
      if (!Scheduler::kDynamic || leader) next_pos = scheduler.next(pos);
      const auto tile = scheduler.tile(pos);
      const int kv_head = tile.head / p.group;
      Tensor gQ = local_tile(tile.q_rows(mQ, tile.head), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(tile.m_block, 0));
      Tensor gK = local_tile(tile.k_rows(mK, kv_head), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
      Tensor gV = local_tile(tile.k_rows(mV, kv_head), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
      auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

      if (local_tile_count > 0) o_wait = (local_tile_count - 1) & 1;
      const Mask& mask = masks.mask(tile);
      KeyWalk<false> walk(mask, tile.m_block);
      bool predicate;  // the consumers' concern: every visited tile loads alike
      const int n_first = walk.first(predicate);
      if (leader) {
        // The first K tile goes first: it waits for nothing, while Q waits
        // until the previous tile is done with Q's buffer.
        pipeline_k.producer_acquire(write);
        copy(p.tma_k.with(*pipeline_k.producer_get_barrier(write)), tKgK(_, n_first), tKsK(_, write.index()));
        if (local_tile_count > 0) shared.q_free.wait((local_tile_count - 1) & 1);
        if constexpr (Scheduler::kDynamic) shared.handoff.publish(Unit<decltype(tile)>{pos, tile}, local_tile_count);
        shared.q_full.arrive_and_expect_tx(Traits::kQBytes);
        copy(p.tma_q.with(reinterpret_cast<uint64_t&>(shared.q_full)), tQgQ, tQsQ);
        pipeline_v.producer_acquire(write);
        copy(p.tma_v.with(*pipeline_v.producer_get_barrier(write)), tVgV(_, n_first), tVsV(_, write.index()));
      }
      // The first tile alone may reach past the sequence's keys; past a
      // dense batch's, TMA already filled zeros.
      int keys = kBlockN;
      if constexpr (kPackedTile<std::decay_t<decltype(tile)>>) keys = mask.policy.len_k - n_first * kBlockN;
      PipelineState previous = write;
      ++write;
      for (int n_block = walk.below(n_first, predicate); n_block >= 0; n_block = walk.below(n_block, predicate)) {
        if (leader) {
          pipeline_k.producer_acquire(write);
          copy(p.tma_k.with(*pipeline_k.producer_get_barrier(write)), tKgK(_, n_block), tKsK(_, write.index()));
          pipeline_v.producer_acquire(write);
          copy(p.tma_v.with(*pipeline_v.producer_get_barrier(write)), tVgV(_, n_block), tVsV(_, write.index()));
        }
        transpose_v(previous, keys);
        keys = kBlockN;
        previous = write;
        ++write;
      }
      transpose_v(previous, keys);
      if constexpr (Traits::kFp8 && Scheduler::kDynamic) {
        if (leader) shared.next_pos[local_tile_count & 1] = next_pos;
        named_barrier_sync(int(Barrier::kProducer), 128);
        next_pos = shared.next_pos[local_tile_count & 1];
      }
      pos = next_pos;
    }
    if constexpr (Scheduler::kDynamic) {  // the end, once the consumers have taken the last unit
      if (leader) {
        if (local_tile_count > 0) shared.q_free.wait((local_tile_count - 1) & 1);
        shared.handoff.publish(Unit<typename Scheduler::Tile>{pos, {}}, local_tile_count);
      }
    }
  }

  // Consumer: one warpgroup's share (64 rows) of one query tile. Leaves the
  // row statistics in `softmax` and the unnormalised output in acc_o.
  // kPacked: the tile's sequence ends where the next one's rows begin, in the
  // same tensors; see clear_foreign_v. pipeline_v: V's (the transposed V's
  // with FP8 inputs); scale_log2: the scores' factor (FP8: with the
  // descales), negative to flip the scores' order.
  template <bool kPacked, bool kDropout, class PipelineV, class AccO, class Softmax>
  CUTE_DEVICE static void compute(Params const& p, SharedStorage& shared, Pipeline& pipeline_k,
                                  PipelineV& pipeline_v, PipelineState& read, Mask const& mask, int m_block,
                                  int batch, int head, int local_tile_count, int thread_idx,
                                  float scale_log2_signed, AccO& acc_o, Softmax& softmax) {
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(Traits::vt_buffer(shared)), typename Traits::SmemLayoutVt{});

    typename Traits::MmaQK mma_qk;
    typename Traits::MmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread_idx);
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

    const int warpgroup = thread_idx / 128;
    const int next_warpgroup = (warpgroup + 1) % Traits::kConsumerWarpgroups;
    constexpr int kTurnThreads = 2 * 128;

    // A negative scale flips which score is largest; the softmax wants
    // scale >= 0, so the scores are negated instead.
    const bool flip = scale_log2_signed < 0.f;
    const float scale_log2 = fabsf(scale_log2_signed);

    auto turn_begin = [&] {
      if constexpr (Traits::kConsumerWarpgroups > 1) {
        named_barrier_sync(int(Barrier::kWarpgroupTurn) + warpgroup, kTurnThreads);
      }
    };
    auto turn_end = [&] {
      if constexpr (Traits::kConsumerWarpgroups > 1) {
        named_barrier_arrive(int(Barrier::kWarpgroupTurn) + next_warpgroup, kTurnThreads);
      }
    };
    // With a separate O buffer, Q's buffer is free after this warpgroup's
    // last Q K^T: the producer may load the next tile's Q.
    auto release_q = [&](bool last) {
      if constexpr (Traits::kSeparateO) {
        if (last && thread_idx % 128 == 0) shared.q_free.arrive();
      }
    };
    // Dropout on P's 16-bit pairs once converted (after the row sums, which
    // count every pair, and after P V's wait, whose operand the pairs are);
    // O's 1 / (1 - p) comes with its normalisation. As a bit per float before
    // that wait it took 16% more of a step's instructions; drawn while
    // S = Q K^T runs, the draws' registers spill (benchmarks/history/
    // 2026-11-28-dropout.md, 2026-11-29-dropout-drawers.md).
    const auto dropout = [&] {
      if constexpr (kDropout) {
        return Dropout::of(p.dropout, batch, head, p.heads_q);  // once: it may read the seed from memory
      } else {
        return 0;
      }
    }();
    auto drop = [&](auto& p_regs, int n_block) {
      if constexpr (kDropout) {
        Tensor words = recast<uint32_t>(p_regs);
        dropout.template drop_pairs<kBlockN % 32 == 0>(words, m_block * kBlockM + get<0>(tScS(0)),
                                                       n_block * kBlockN + get<1>(tScS(0)));
      }
    };
    // predicate: the walk's (KeyWalk::first, below).
    auto mask_scores = [&](auto& acc_s, int n_block, bool predicate) {
      if (flip) negate_scores(acc_s);
      if (predicate) {
        Tensor s = acc_rowcol(acc_s);
        mask::mask_scores<true>(mask, acc_s, tScS, s, acc_rowcol(tScS), m_block, n_block);
      }
    };

    clear(acc_o);
    KeyWalk<true> walk(mask, m_block);
    bool predicate_next;
    const int n_first = walk.first(predicate_next);
    bool predicate = predicate_next;
    shared.q_full.wait(local_tile_count & 1);
    if constexpr (Traits::kQInRegisters) {  // once per query tile
      auto load_q = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_qk);
      auto thr_load_q = load_q.get_thread_slice(thread_idx);
      copy(load_q, thr_load_q.partition_S(sQ), thr_load_q.retile_D(tSrQ));
    }

    // The last key tile alone: its P seeds the loop.
    Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    pipeline_k.consumer_wait(read);
    turn_begin();
    wgmma<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), acc_s);
    turn_end();
    if constexpr (kPacked && !Traits::kFp8) {  // FP8: the transpose wrote zeros there
      clear_foreign_v(shared, pipeline_v, read, mask.policy.len_k - n_first * kBlockN, thread_idx);
    }
    // The walk moves on while the tensor cores work (walked before the
    // GEMMs' issue, it cost a mask that keeps everything ~1%).
    int n_next = walk.below(n_first, predicate_next);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    pipeline_k.consumer_release(read);
    release_q(n_next < 0);
    mask_scores(acc_s, n_first, predicate);
    {
      Tensor s = acc_rowcol(acc_s);
      softmax.update_stats(s, scale_log2);  // O is still zero: nothing to rescale
    }
    // P in registers, and its view as P V's A operand.
    Tensor p_regs = [&] {
      if constexpr (Traits::kFp8) {
        Tensor regs = make_fp8_p_fragment<Element, kBlockN>();
        convert_fp8_p_into(acc_s, regs);
        return regs;
      } else {
        return convert_fragment<Element>(acc_s);
      }
    }();
    drop(p_regs, n_first);
    Tensor tOrP = make_tensor(p_regs.data(), [&] {
      if constexpr (Traits::kFp8) {
        return p_regs.layout();
      } else {
        return acc_as_a_operand_layout(p_regs.layout());
      }
    }());
    PipelineState read_v = read;
    ++read;

    // Each step issues S = Q K^T for the next key tile and O += P V for the
    // previous one back to back, then runs the softmax of the new S while
    // P V is still on the tensor cores; only the O rescale waits for it.
    for (int n_block = n_next; n_block >= 0; n_block = n_next) {
      predicate = predicate_next;
      pipeline_k.consumer_wait(read);
      turn_begin();
      wgmma<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), acc_s);
      pipeline_v.consumer_wait(read_v);
      wgmma<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
      turn_end();
      n_next = walk.below(n_block, predicate_next);
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_s);
      pipeline_k.consumer_release(read);
      release_q(n_next < 0);
      mask_scores(acc_s, n_block, predicate);
      Tensor s = acc_rowcol(acc_s);
      Tensor old_max = make_tensor_like(softmax.row_max);
      copy(softmax.row_max, old_max);
      softmax.update_stats(s, scale_log2);
      bool max_moved = true;
      if constexpr (Traits::kSkipUnitRescale) {
        max_moved = false;
        CUTE_UNROLL
        for (int r = 0; r < size(old_max); ++r) max_moved |= softmax.row_max(r) != old_max(r);
        max_moved = __any_sync(0xffffffff, max_moved);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      pipeline_v.consumer_release(read_v);
      Tensor o = acc_rowcol(acc_o);
      if (max_moved) scale_rows(o, softmax.correction);
      if constexpr (Traits::kFp8) {
        convert_fp8_p_into(acc_s, p_regs);
      } else {
        convert_fragment_into(acc_s, p_regs);
        drop(p_regs, n_block);
      }
      read_v = read;
      ++read;
    }

    pipeline_v.consumer_wait(read_v);
    wgmma<false, 0>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
    pipeline_v.consumer_release(read_v);
  }

  // A packed tile's first key tile (the top: the only one that reaches past
  // the sequence's keys) holds the next sequence's rows past `keys` (or keys
  // past seqused_k). Their scores are masked, but P's zeros times a V of inf
  // or NaN there would still reach O, so every consumer clears those V rows
  // once they land, before any P V reads them (the whole tile when the
  // sequence has no keys). Called after the first Q K^T's turn, which every
  // warpgroup has passed on before it waits here.
  CUTE_DEVICE static void clear_foreign_v(SharedStorage& shared, Pipeline& pipeline_v, PipelineState const& stage,
                                          int keys, int thread_idx) {
    if (keys >= kBlockN) return;
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
    pipeline_v.consumer_wait(stage);
    clear_rows_from<Traits::kConsumerThreads>(sV(_, _, stage.index()), keys, thread_idx);
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(int(Barrier::kForeignV), Traits::kConsumerThreads);
  }
};

}  // namespace sm90
}  // namespace tfb
