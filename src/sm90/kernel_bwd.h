// The sm90 backward's main kernel: one CTA per (key tile, kv head, batch); in
// the deterministic mode one per (dQ split, kv head, batch), walking its key
// tiles. Warpgroup 0 produces (TMA loads), warpgroups 1.. consume (wgmma, the
// softmax gradient, dQ reductions, the dK/dV epilogue).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/grid.h"
#include "common/mask.h"
#include "common/mask_summary.h"
#include "common/tile_list.h"
#include "params.h"
#include "sm90/epilogue_bwd.h"
#include "sm90/mainloop_bwd.h"
#include "sm90/mask_walk.h"
#include "sm90/tile_scheduler.h"

namespace tfb {
namespace sm90 {

// kPacked: a packed batch (params.h SeqLens); each CTA reads its sequence's
// offsets and lengths once (a PackedTile) and builds its band from them, and,
// but in the deterministic mode, takes its key tile from a list
// (common/tile_list.h) instead of a grid over the longest sequence.
template <class Traits, class Policy, bool kPacked>
struct BwdKernelParams {
  using Element = typename Traits::Element;
  using Mask = typename BwdMainloop<Traits, Policy>::Mask;
  using Tile = std::conditional_t<kPacked, PackedTile, WorkTile>;
  static_assert(!kPacked || !mask::kReadsMemory<Policy>, "a packed batch has no mask in memory");
  typename BwdMainloop<Traits, Policy>::Params mainloop;
  int heads_kv, batch, n_blocks;  // n_blocks: of the longest sequence
  int group_pairs;  // (kv head, batch) pairs per group of CTAs (HeadBatchGrid::locate_grouped)
  int len_q, len_k;  // the longest; uniform lengths: everyone's (mask_walk.h)
  Mask uniform_mask;   // uniform_walk
  MaskArgs mask_args;  // FromMemory: attn_mask and its summary (common/mask_summary.h); a packed batch's band
  float scale;
  Element* dk;
  Element* dv;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;
  int qk_dim, v_dim;  // dk's and dv's columns (params.h): the rest of the tiles' are padding
  const TileEntry* entries;  // a packed batch's key tiles, count of them
  const int* count;

  CUTE_DEVICE decltype(auto) mask(int batch, int head_q) const {
    return walk_of(uniform_mask, mask_args, batch, head_q);
  }
  // Where batch b's rows are, and its lengths.
  CUTE_DEVICE Tile tile(int b) const {
    if constexpr (kPacked) {
      const SeqLens& s = mainloop.seqlens;
      return {0, 0, b, int(s.q_begin(b)), s.q(b, len_q), int(s.k_begin(b)), s.k(b, len_k)};
    } else {
      return {0, 0, b};
    }
  }
  CUTE_DEVICE int seqlen_k(Tile const& tile) const {
    if constexpr (kPacked) {
      return tile.len_k;
    } else {
      return len_k;
    }
  }
  CUTE_DEVICE int64_t dk_offset(Tile const& tile) const {
    return kPackedTile<Tile> ? row0_of(tile) * dk_row_stride : tile.batch * dk_batch_stride;
  }
  CUTE_DEVICE int64_t dv_offset(Tile const& tile) const {
    return kPackedTile<Tile> ? row0_of(tile) * dv_row_stride : tile.batch * dv_batch_stride;
  }
  CUTE_DEVICE static int64_t row0_of(Tile const& tile) {
    if constexpr (kPacked) {
      return tile.k_row0;
    } else {
      return 0;
    }
  }
};

// A packed sequence's masks: its band, the same for every head.
template <class Mask>
struct SequenceMask {
  Mask walk;
  CUTE_DEVICE Mask const& mask(int, int) const { return walk; }
};

// The masks a CTA's roles read: the kernel params' (mask(batch, head)), or
// a packed sequence's band.
template <class Params>
CUTE_DEVICE decltype(auto) masks_of(Params const& p, typename Params::Tile const& tile) {
  if constexpr (kPackedTile<typename Params::Tile>) {
    return SequenceMask<typename Params::Mask>{{mask::band_of(p.mask_args, tile.len_q, tile.len_k)}};
  } else {
    return (p);
  }
}

// One CTA's work; kDropout: with dropout's draws (bwd_dropout_kernel; the
// plain kernel keeps the code it had before, kernel_fwd.h fwd_cta's reason).
template <class Traits, class Policy, bool kPacked, bool kDropout>
CUTE_DEVICE void bwd_cta(BwdKernelParams<Traits, Policy, kPacked> const& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mainloop = BwdMainloop<Traits, Policy>;
  using Pipeline = typename Traits::Pipeline;
  using SharedStorage = typename Traits::SharedStorage;
  using Element = typename Traits::Element;

  // Deterministic: blockIdx.x is the dQ split, whose CTA walks key tiles
  // blockIdx.x, + gridDim.x, ... Otherwise one key tile per CTA, in groups of
  // about one wave, the first key tiles (the longest walks under a causal
  // mask) of a group starting first.
  int head_kv, batch, first_block = blockIdx.x;
  if (kPacked && !p.mainloop.deterministic) {  // the list's entry blockIdx.x: one key tile
    if (int(blockIdx.x) >= *p.count) return;
    const TileEntry entry = p.entries[blockIdx.x];
    first_block = entry.block;
    head_kv = entry.head;
    batch = entry.batch;
  } else if (p.mainloop.deterministic
                 ? !HeadBatchGrid::locate(p.heads_kv, p.batch, head_kv, batch)
                 : !HeadBatchGrid::locate_grouped(p.heads_kv, p.batch, p.group_pairs, first_block, head_kv, batch)) {
    return;
  }
  const auto tile = p.tile(batch);
  const int n_blocks = kPacked ? (p.seqlen_k(tile) + Traits::kBlockN - 1) / Traits::kBlockN : p.n_blocks;
  // The deterministic mode's splits walk a packed sequence's key tiles; a list entry is one.
  const int block_stride = kPacked && !p.mainloop.deterministic ? n_blocks : int(gridDim.x);
  if (kPacked && first_block >= n_blocks) return;
  decltype(auto) masks = masks_of(p, tile);
  auto const& step_walk = masks.mask(batch, head_kv * p.mainloop.group);

  extern __shared__ __align__(1024) char smem[];
  SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const bool producer = warpgroup == 0;

  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.mainloop.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.mainloop.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.mainloop.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.mainloop.tma_v.get_tma_descriptor());
    shared.kv_full.init(1);
    shared.kv_free.init(Traits::kConsumerWarpgroups);
  }
  typename Pipeline::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kQBytes + Traits::kStatBytes;
  pipeline_params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = Traits::kConsumerThreads;
  Pipeline pipeline_q(shared.pipeline_q, pipeline_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_do(shared.pipeline_do, pipeline_params, Shape<_1, _1, _1>{});
  __syncthreads();

  const int group = p.mainloop.group;
  // Default: one key tile per CTA and one shared dQ accumulator. Deterministic:
  // gridDim.x = splits, and this CTA alone adds into split blockIdx.x.
  float* dq_split = p.mainloop.dq_accum + (p.mainloop.deterministic ? blockIdx.x * p.mainloop.split_elems : 0);

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (warp == 0) {  // the whole warp walks a mask's tile kinds; its lane 0 issues
      auto write = cutlass::make_producer_start_state<Pipeline>();
      int unit = 0;
      for (int n_block = first_block; n_block < n_blocks; n_block += block_stride, ++unit) {
        const BwdSteps steps(step_walk, n_block, head_kv, group);
        Mainloop::load(p.mainloop, shared, pipeline_q, pipeline_do, write, steps, masks, n_block, head_kv, tile,
                       unit);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    const int thread_idx = threadIdx.x - 128;
    const int wg_thread = thread_idx % 128;
    const int consumer = warpgroup - 1;
    auto consume = [&] {
      typename Traits::MmadKV mma_dkv;
      typename cutlass::PipelineState<Traits::kStages> read;
      int unit = 0;
      for (int n_block = first_block; n_block < n_blocks; n_block += block_stride, ++unit) {
        const BwdSteps steps(step_walk, n_block, head_kv, group);
        Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<_64, Int<Traits::kDkvCols>>{});
        Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<_64, Int<Traits::kDkvCols>>{});
        clear(acc_dk);
        clear(acc_dv);
        if constexpr (Traits::kSplitDim) {
          Mainloop::template compute_split_dim<kDropout>(p.mainloop, shared, pipeline_q, pipeline_do, read, steps,
                                                         masks, n_block, tile, unit, dq_split, thread_idx, acc_dk,
                                                         acc_dv);
        } else {
          Mainloop::template compute<kDropout>(p.mainloop, shared, pipeline_q, pipeline_do, read, steps, masks,
                                               n_block, tile, unit, dq_split, thread_idx, acc_dk, acc_dv);
        }
        // Every wgmma reading K and V has completed (compute's last wait).
        if (wg_thread == 0) shared.kv_free.arrive();
        const int n0 = n_block * Traits::kBlockN + Traits::key0(consumer);
        const int col0 = Traits::dkv_col0(consumer);
        Element* dk = p.dk + p.dk_offset(tile) + head_kv * p.dk_head_stride + n0 * p.dk_row_stride + col0;
        Element* dv = p.dv + p.dv_offset(tile) + head_kv * p.dv_head_stride + n0 * p.dv_row_stride + col0;
        const int keys = p.seqlen_k(tile) - n0;
        BwdEpilogue<Traits>::store(acc_dk, p.scale, dk, p.dk_row_stride, keys, p.qk_dim - col0, wg_thread);
        BwdEpilogue<Traits>::store(acc_dv, 1.f, dv, p.dv_row_stride, keys, p.v_dim - col0, wg_thread);
      }
    };
    consume();
    // The last reduction reads the dQ buffer until it completes.
    if (thread_idx == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
#endif
}

// Policy: mask.h Band or FromMemory (a boolean attn_mask; mask_summary.h
// with_policy); a packed batch: Band.
template <class Traits, class Policy, bool kPacked>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_kernel(CUTE_GRID_CONSTANT BwdKernelParams<Traits, Policy, kPacked> const p) {
  bwd_cta<Traits, Policy, kPacked, false>(p);
}

// The same with dropout (params.h DropoutArgs): a Band, not packed.
template <class Traits, class Policy, bool kPacked>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_dropout_kernel(CUTE_GRID_CONSTANT BwdKernelParams<Traits, Policy, kPacked> const p) {
  static_assert(!kPacked && !mask::kReadsMemory<Policy>);
  bwd_cta<Traits, Policy, kPacked, true>(p);
}

}  // namespace sm90
}  // namespace tfb
