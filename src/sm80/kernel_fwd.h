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

  FwdMainloop<Traits>::run(p, smem, mask, m_block, head, batch, acc_o, softmax);
  Tensor lse = softmax.finalize(acc_o, fabsf(p.scale));
  FwdEpilogue<Traits>::store(p, smem, m_block, head, batch, acc_o, lse);
}

}  // namespace sm80
}  // namespace tfb
