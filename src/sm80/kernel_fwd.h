// The sm80 forward kernel: a CTA per (query tile, q head, batch).
#pragma once

#include "params.h"
#include "sm80/epilogue_fwd.h"
#include "sm80/grid.h"
#include "sm80/kernel_traits_fwd.h"
#include "sm80/mainloop_fwd.h"
#include "sm80/mask.h"
#include "sm80/softmax.h"

namespace tfb {
namespace sm80 {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) fwd_kernel(__grid_constant__ const AttnFwdParams p) {
  extern __shared__ __align__(128) char smem[];
  using Mask = AttnMask<Traits::kBlockM, Traits::kBlockN>;
  const Mask mask{p.len_q, p.len_k, p.is_causal};
  // Causal tiles further down see more keys; launching them first shortens the tail.
  const int m_block = p.is_causal ? mask.num_m_blocks() - 1 - int(blockIdx.x) : int(blockIdx.x);
  int head, batch;
  if (!HeadBatchGrid::locate(p.heads_q, p.batch, head, batch)) return;

  typename Traits::TiledMma mma;
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{});
  clear(acc_o);
  OnlineSoftmax<Traits::kRowsPerThread> softmax;

  // The fast pass leaves rows whose scores reach 2^10 in exp2 units inexact
  // (softmax.h); if any did, the CTA starts over with the exact softmax. Such
  // scores need inputs near 1e5, so the second pass is there for correctness.
  using Mainloop = FwdMainloop<Traits>;
  if (__syncthreads_or(Mainloop::template run<false>(p, smem, mask, m_block, head, batch, acc_o, softmax))) {
    clear(acc_o);
    softmax = OnlineSoftmax<Traits::kRowsPerThread>();
    Mainloop::template run<true>(p, smem, mask, m_block, head, batch, acc_o, softmax);
  }
  Tensor lse = softmax.finalize(acc_o, fabsf(p.scale));
  FwdEpilogue<Traits>::store(p, smem, m_block, head, batch, acc_o, lse);
}

}  // namespace sm80
}  // namespace tfb
