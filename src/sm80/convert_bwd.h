// Last backward kernel: the float32 dQ accumulators (their splits summed in
// order), times the softmax scale, written to dq in the input dtype with its strides.
// dK and dV need no such pass: a CTA owns its keys for every query head of its
// GQA group and writes them itself.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>

#include "params.h"
#include "common/grid.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/utils_bwd.h"
#include "common/workspace_bwd.h"

namespace tfb::sm80::bwd {

// One CTA per query block of a q head (workspace_bwd.h row_blocks_grid). The accumulator slice is in dQ
// MMA-fragment order (see BwdTraits), so each thread reads back exactly the
// fragment the main kernel added, and writes it through shared memory as rows.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) bwd_convert_dq_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  using Element = typename Traits::Element;
  constexpr int kM = Traits::kBlockM, kE = Traits::kHeadDim;
  __shared__ __align__(128) Element smem[kM * kE];
  const int tid = threadIdx.x;
  int head, batch, m0;
  if (!locate_row_block<kM>(p, head, batch, m0)) return;
  const int len_q = p.seqlen_q(batch);
  if (m0 >= len_q) return;  // a block of padded rows alone
  const float* mine = ws.dq_accum + (ws.row0(batch, head, p.heads_q) + m0) * kE + tid;

  Tensor acc = partition_fragment_C(typename Traits::TiledMmadQ{}, Shape<Int<kM>, Int<kE>>{});
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) acc(i) = mine[i * Traits::kThreads];
  for (int split = 1; split < ws.splits; ++split) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) acc(i) += mine[split * ws.split_elems + i * Traits::kThreads];
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) acc(i) *= p.scale;
  Tensor r = convert_fragment<Element>(acc);

  Tensor sdQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  auto r2s = make_tiled_copy_C(typename Traits::StoreFrag{}, typename Traits::TiledMmadQ{});
  auto thr = r2s.get_thread_slice(tid);
  copy(r2s, thr.retile_S(r), thr.partition_D(sdQ));
  __syncthreads();

  Element* dq = static_cast<Element*>(p.dq) + p.dq_offset(batch) + head * p.dq_head_stride + m0 * p.dq_row_stride;
  Tensor g = make_tensor(make_gmem_ptr(dq), Shape<Int<kM>, Int<kE>>{}, make_stride(p.dq_row_stride, _1{}));
  store_tile<typename Traits::GmemStore>(sdQ, g, len_q - m0, p.qk_dim, tid);
}

template <class Traits>
cudaError_t launch_convert_dq(const AttnBwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  const dim3 grid = row_blocks_grid(p, Traits::kBlockM, (p.len_q + Traits::kBlockM - 1) / Traits::kBlockM);
  bwd_convert_dq_kernel<Traits><<<grid, Traits::kThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace tfb::sm80::bwd
