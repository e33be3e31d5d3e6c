// The main backward kernel: one CTA per (key block, kv head, batch); in the
// deterministic mode one per (split, kv head, batch), walking its key blocks.
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "sm80/epilogue_bwd.h"
#include "common/grid.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/mainloop_bwd.h"
#include "common/workspace_bwd.h"

namespace tfb::sm80::bwd {

// One CTA's work; kDropout: with dropout's draws (bwd_dkdv_dropout_kernel; the
// plain kernel keeps the code it had before, sm90/kernel_fwd.h fwd_cta's reason).
template <class Traits, class Policy, bool kDropout>
CUTE_DEVICE void bwd_dkdv_cta(const AttnBwdParams& p, const BwdWorkspace& ws) {
  using Element = typename Traits::Element;
  extern __shared__ __align__(128) char smem_raw[];
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  const int tid = threadIdx.x;

  int head_kv, batch;
  if (!HeadBatchGrid::locate(p.heads_kv, p.batch, head_kv, batch)) return;
  // Default: gridDim.x = key blocks and one shared accumulator. Deterministic:
  // gridDim.x = ws.splits, and this CTA alone adds into split blockIdx.x.
  float* dq_accum = ws.dq_accum + (ws.splits > 1 ? blockIdx.x * ws.split_elems : 0);
  // Head 0's: the walk over key blocks is the same for every head.
  const typename BwdMainloop<Traits, Policy>::Mask mask{
      mask::policy_of<Policy>(p, batch, 0, p.seqlen_q(batch), p.seqlen_k(batch))};
  const int n_blocks = mask.num_n_blocks();
  using TileKV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
  Tensor acc_dk = partition_fragment_C(typename Traits::TiledMmadKV{}, TileKV{});
  Tensor acc_dv = partition_fragment_C(typename Traits::TiledMmadKV{}, TileKV{});
  for (int n_block = blockIdx.x; n_block < n_blocks; n_block += gridDim.x) {
    const BwdBlock blk(p, ws, mask, n_block, head_kv, batch);
    clear(acc_dk);
    clear(acc_dv);
    BwdMainloop<Traits, Policy>{smem, tid}.template run<kDropout>(p, ws, dq_accum, blk, acc_dk, acc_dv);
    BwdEpilogue<Traits>{smem, tid}.store(p, blk, acc_dk, acc_dv);
    __syncthreads();  // the epilogue's reads of shared memory end before the next block's loads
  }
}

// Policy: mask.h Band, FromMemory or FromMemoryAdditive (mask_summary.h with_policy).
template <class Traits, class Policy>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_dkdv_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  bwd_dkdv_cta<Traits, Policy, false>(p, ws);
}

// The same with dropout (params.h DropoutArgs); a Band alone.
template <class Traits, class Policy>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_dkdv_dropout_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  static_assert(!mask::kReadsMemory<Policy>);
  bwd_dkdv_cta<Traits, Policy, true>(p, ws);
}

}  // namespace tfb::sm80::bwd
