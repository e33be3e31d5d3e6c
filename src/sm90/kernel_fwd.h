// The sm90 forward kernel: a persistent, warp-specialised CTA. Warpgroup 0
// produces (TMA loads of Q, K, V), warpgroups 1.. consume (wgmma, softmax,
// epilogue); registers move from the producer to the consumers at start.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/mask.h"
#include "common/mask_summary.h"
#include "common/softmax.h"
#include "params.h"
#include "sm90/epilogue_fwd.h"
#include "sm90/mainloop_fwd.h"
#include "sm90/mask_walk.h"
#include "sm90/tile_scheduler.h"

namespace tfb {
namespace sm90 {

template <bool kFirst, class A, class B>
CUTE_DEVICE auto& pick(A& a, B& b) {
  if constexpr (kFirst) {
    return a;
  } else {
    return b;
  }
}

// kPacked: a packed batch (params.h SeqLens), its tiles from a list
// (PackedTileScheduler) and each sequence's band built from its lengths.
template <class Traits, class Policy, bool kPacked>
struct FwdKernelParams {
  using Mask = typename FwdMainloop<Traits, Policy>::Mask;
  // Dynamic under a mask in memory or a packed batch.
  using Scheduler = std::conditional_t<kPacked, PackedTileScheduler, TileScheduler<mask::kReadsMemory<Policy>>>;
  using Tile = typename Scheduler::Tile;
  static_assert(!kPacked || !mask::kReadsMemory<Policy>, "a packed batch has no mask in memory");
  typename FwdMainloop<Traits, Policy>::Params mainloop;
  typename FwdEpilogue<Traits>::Params epilogue;
  Scheduler scheduler;
  // Every batch's lengths and mask, read through the accessors below
  // (mask_walk.h); a packed tile carries its sequence's lengths.
  int len_q;
  Mask uniform_mask;   // uniform_walk
  MaskArgs mask_args;  // FromMemory: attn_mask and its summary (common/mask_summary.h); a packed batch's band
  float scale;
  Descales descales;  // FP8 inputs

  CUTE_DEVICE int seqlen_q(Tile const& tile) const {
    if constexpr (kPacked) {
      return tile.len_q;
    } else {
      return len_q;
    }
  }
  // The scores' scale (log2 and natural) and O's factor for a tile: FP8
  // inputs fold their descales in, clamped so that a descale of 0 keeps the
  // masked scores -inf (params.h scale_log2) and a huge one keeps the
  // largest product of two e4m3 rows finite in float32.
  struct Scales {
    float log2, natural, out;
  };
  CUTE_DEVICE Scales scales(Tile const& tile) const {
    if constexpr (Traits::kFp8) {
      const int kv_head = tile.head / mainloop.group;
      const float qk = descales.q.at(tile.batch, kv_head) * descales.k.at(tile.batch, kv_head);
      const float log2 = copysignf(fminf(fmaxf(fabsf(mainloop.scale_log2 * qk), 1.17549435e-38f), 1e30f),
                                   mainloop.scale_log2 * qk);
      return {log2, log2 * (scale / mainloop.scale_log2), descales.v.at(tile.batch, kv_head)};
    } else {
      return {mainloop.scale_log2, scale, 1.f};
    }
  }
  CUTE_DEVICE decltype(auto) mask(Tile const& tile) const {
    if constexpr (kPacked) {
      return Mask{mask::band_of(mask_args, tile.len_q, tile.len_k)};
    } else {
      return walk_of(uniform_mask, mask_args, tile.batch, tile.head);
    }
  }
};

// One CTA's work. kDropout: with dropout's draws (fwd_dropout_kernel), so
// that the plain kernel's code is the one it had before dropout existed (a
// copy of the loop beside it in one kernel, or a runtime branch in it, cost
// 1-38%: benchmarks/history/2026-11-28-dropout.md).
template <class Traits, class Policy, bool kPacked, bool kDropout>
CUTE_DEVICE void fwd_cta(FwdKernelParams<Traits, Policy, kPacked> const& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mainloop = FwdMainloop<Traits, Policy>;
  using Epilogue = FwdEpilogue<Traits>;
  using Pipeline = typename Traits::Pipeline;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem[];
  SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);

  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const bool producer = warpgroup == 0;

  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.mainloop.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.mainloop.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.mainloop.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.epilogue.tma_o.get_tma_descriptor());
    shared.q_full.init(1);
    // Each consumer warpgroup frees Q: after its last Q K^T (separate O), else
    // once its O store has read the buffer.
    shared.q_free.init(Traits::kConsumerWarpgroups);
    if constexpr (Traits::kOPlace == Traits::OPlace::kVt) {
      shared.o_free.init(Traits::kConsumerWarpgroups);  // each consumer warpgroup's O store has read its slab
    }
    shared.handoff.init();
  }

  typename Pipeline::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kKVBytes;
  pipeline_params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = Traits::kConsumerThreads;
  Pipeline pipeline_k(shared.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  // FP8: V lands for the producer warpgroup, which transposes it into the
  // ring the consumers read (pipeline_vt).
  if constexpr (Traits::kFp8) pipeline_params.num_consumers = 128;
  Pipeline pipeline_v(shared.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  typename Traits::PipelineVt::Params vt_params;
  vt_params.role = producer ? Traits::PipelineVt::ThreadCategory::Producer : Traits::PipelineVt::ThreadCategory::Consumer;
  vt_params.producer_arv_count = 128;
  vt_params.consumer_arv_count = Traits::kConsumerThreads;
  typename Traits::PipelineVt pipeline_vt = [&] {
    if constexpr (Traits::kFp8) {
      return typename Traits::PipelineVt(shared.pipeline_vt, vt_params);
    } else {
      return typename Traits::PipelineVt(shared.pipeline_vt, vt_params, cute::false_type{});  // unused: no barriers
    }
  }();
  // kSumsInO: the rows of e4m3 ones below each transposed V stage, which the
  // transposes never write.
  if constexpr (Traits::kSumsInO) {
    fill_rows_below<Traits::kBlockN, Traits::kHeadDim, Traits::kPVCols>(
        reinterpret_cast<uint8_t*>(shared.vt.data()), Traits::kStages, 0x38, threadIdx.x, Traits::kThreads);
    cutlass::arch::fence_view_async_shared();  // the wgmma reads them through the async proxy
  }
  // Barrier initialisation is visible to every thread (and to TMA) before use.
  __syncthreads();

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (Traits::kFp8 || threadIdx.x == 0) {
      Mainloop::load(p.mainloop, shared, pipeline_k, pipeline_v, pipeline_vt, p.scheduler, p, threadIdx.x);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    const int thread_idx = threadIdx.x - 128;
    const int consumer = warpgroup - 1;
    // The first turn to issue Q K^T goes to consumer 0.
    if constexpr (Traits::kConsumerWarpgroups > 1) {
      if (consumer == Traits::kConsumerWarpgroups - 1) named_barrier_arrive(int(Barrier::kWarpgroupTurn), 2 * 128);
    }

    auto consume = [&] {
      typename Traits::MmaPV mma_pv;
      typename cutlass::PipelineState<Traits::kStages> read;
      int local_tile_count = 0;
      using Tile = typename decltype(p.scheduler)::Tile;
      constexpr bool kDynamic = decltype(p.scheduler)::kDynamic;
      for (int pos = p.scheduler.first();; ++local_tile_count) {
        Tile tile;
        if constexpr (kDynamic) {
          const Unit<Tile> unit = shared.handoff.template take<Tile>(local_tile_count);
          pos = unit.pos;
          tile = unit.tile;
        }
        if (!p.scheduler.valid(pos)) break;
        if constexpr (!kDynamic) tile = p.scheduler.tile(pos);
        Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<Traits::kBlockM>, Int<Traits::kPVCols>>{});
        OnlineSoftmax<2, Traits::kFp8 ? kFp8Log2PScale : 0, Traits::kSumsInO> softmax;
        const auto scales = p.scales(tile);
        auto& pipeline_pv = pick<Traits::kFp8>(pipeline_vt, pipeline_v);
        Mainloop::template compute<kPacked, kDropout>(p.mainloop, shared, pipeline_k, pipeline_pv, read,
                                                      p.mask(tile), tile.m_block, tile.batch, tile.head,
                                                      local_tile_count, thread_idx, scales.log2, acc_o, softmax);
        Tensor o = acc_rowcol(acc_o);
        // The softmax ran on negated scores when the scale is negative.
        const float out_scale = kDropout ? scales.out * p.mainloop.dropout.keep_scale : scales.out;
        auto lse = softmax.finalize_rows(o, fabsf(scales.natural), out_scale);
        // O's head-dim columns: the first registers of acc_o (kSumsInO's sums come last).
        using OLayout = decltype(partition_fragment_C(typename Traits::MmaO{},
                                                      Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{})
                                     .layout());
        Tensor acc_out = make_tensor(acc_o.data(), OLayout{});
        Epilogue::store(p.epilogue, shared, acc_out, lse, tile, p.seqlen_q(tile), thread_idx);
        if constexpr (!kDynamic) pos = p.scheduler.next(pos);
      }
    };
    if constexpr (kDropout) {
      if (blockIdx.x == 0 && thread_idx == 0) record_rng_state(p.mainloop.dropout);
    }
    consume();
    // The last O store reads shared memory until it completes.
    if (thread_idx % 128 == 0) tma_store_wait<0>();
    // Consume the turn the last consumer handed out at start, so no arrival is left
    // pending on the barrier when the CTA exits.
    if constexpr (Traits::kConsumerWarpgroups > 1) {
      if (consumer == 0) named_barrier_sync(int(Barrier::kWarpgroupTurn), 2 * 128);
    }
  }
#endif
}

// Policy: mask.h Band, FromMemory or FromMemoryAdditive (mask_summary.h with_policy);
// a packed batch: Band.
template <class Traits, class Policy, bool kPacked>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(CUTE_GRID_CONSTANT FwdKernelParams<Traits, Policy, kPacked> const p) {
  fwd_cta<Traits, Policy, kPacked, false>(p);
}

// The same with dropout (params.h DropoutArgs): bf16/fp16, a Band, not packed.
template <class Traits, class Policy, bool kPacked>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_dropout_kernel(CUTE_GRID_CONSTANT FwdKernelParams<Traits, Policy, kPacked> const p) {
  static_assert(!Traits::kFp8 && !kPacked && !mask::kReadsMemory<Policy>);
  fwd_cta<Traits, Policy, kPacked, true>(p);
}

}  // namespace sm90
}  // namespace tfb
