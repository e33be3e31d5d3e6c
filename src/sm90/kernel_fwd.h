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

template <class Traits, class Policy>
struct FwdKernelParams {
  using Mask = typename FwdMainloop<Traits, Policy>::Mask;
  typename FwdMainloop<Traits, Policy>::Params mainloop;
  typename FwdEpilogue<Traits>::Params epilogue;
  TileScheduler<mask::kReadsMemory<Policy>> scheduler;  // dynamic under a mask in memory
  // Every batch's lengths and mask, read through the accessors below
  // (mask_walk.h; can_run_fwd refuses params.h's SeqLens, per-batch lengths
  // would change these accessors).
  int len_q;
  Mask uniform_mask;   // uniform_walk
  MaskArgs mask_args;  // FromMemory: attn_mask and its summary (common/mask_summary.h)
  float scale;

  CUTE_DEVICE int seqlen_q(int /*batch*/) const { return len_q; }
  CUTE_DEVICE decltype(auto) mask(int batch, int head) const { return walk_of(uniform_mask, mask_args, batch, head); }
};

// Policy: mask.h Band, FromMemory or FromMemoryAdditive (mask_summary.h with_policy).
template <class Traits, class Policy>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(CUTE_GRID_CONSTANT FwdKernelParams<Traits, Policy> const p) {
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
    shared.handoff.init();
  }

  typename Pipeline::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kKVBytes;
  pipeline_params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = Traits::kConsumerThreads;
  Pipeline pipeline_k(shared.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_v(shared.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  // Barrier initialisation is visible to every thread (and to TMA) before use.
  __syncthreads();

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x == 0) Mainloop::load(p.mainloop, shared, pipeline_k, pipeline_v, p.scheduler, p);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    const int thread_idx = threadIdx.x - 128;
    const int consumer = warpgroup - 1;
    // The first turn to issue Q K^T goes to consumer 0.
    if constexpr (Traits::kConsumerWarpgroups > 1) {
      if (consumer == Traits::kConsumerWarpgroups - 1) named_barrier_arrive(int(Barrier::kWarpgroupTurn), 2 * 128);
    }

    typename Traits::MmaPV mma_pv;
    typename cutlass::PipelineState<Traits::kStages> read;
    int local_tile_count = 0;
    constexpr bool kDynamic = decltype(p.scheduler)::kDynamic;
    for (int pos = p.scheduler.first();; ++local_tile_count) {
      if constexpr (kDynamic) pos = shared.handoff.take(local_tile_count);
      if (!p.scheduler.valid(pos)) break;
      const auto tile = p.scheduler.tile(pos);
      Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{});
      OnlineSoftmax<2> softmax;
      Mainloop::compute(p.mainloop, shared, pipeline_k, pipeline_v, read, p.mask(tile.batch, tile.head), tile.m_block,
                        local_tile_count, thread_idx, acc_o, softmax);
      Tensor o = acc_rowcol(acc_o);
      // The softmax ran on negated scores when the scale is negative.
      auto lse = softmax.finalize_rows(o, fabsf(p.scale));
      Epilogue::store(p.epilogue, shared, acc_o, lse, tile, p.seqlen_q(tile.batch), thread_idx);
      if constexpr (!kDynamic) pos = p.scheduler.next(pos);
    }
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

}  // namespace sm90
}  // namespace tfb
