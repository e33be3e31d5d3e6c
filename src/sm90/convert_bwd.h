// Last backward kernel: the float32 dQ accumulators (their splits summed in
// order), times the softmax scale, written to dq in the input dtype with its
// strides. The accumulator holds each query tile in the main kernel's
// fragment order, so each thread reads back the values one consumer thread
// staged, in the same registers' layout.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>

#include "params.h"
#include "common/grid.h"
#include "common/workspace_bwd.h"
#include "sm90/epilogue_bwd.h"
#include "sm90/kernel_traits_bwd.h"

namespace tfb {
namespace sm90 {

// Thread t of consumer warpgroup w: its values of the query tile's dQ (the
// splits summed in order) back in the registers' layout, then stored.
template <class Traits, int w>
CUTE_DEVICE void convert_dq_slice(const AttnBwdParams& p, const BwdWorkspace& ws, float const* tile, int head,
                                  int batch, int m0, int wg_thread) {
  using Slice = typename Traits::template DqSlice<w>;
  typename Slice::Mma mma;
  Tensor coord = mma.get_thread_slice(wg_thread).partition_C(make_identity_tensor(Shape<_64, Int<Slice::kCols>>{}));
  Tensor acc = make_tensor<float>(shape(coord));
  float const* mine = tile + Slice::kOffset;
  CUTE_UNROLL
  for (int j = 0; j < size(acc); ++j) acc(j) = mine[Traits::dq_index(j, wg_thread)];
  for (int split = 1; split < ws.splits; ++split) {
    CUTE_UNROLL
    for (int j = 0; j < size(acc); ++j) acc(j) += mine[split * ws.split_elems + Traits::dq_index(j, wg_thread)];
  }
  const int row0 = m0 + Slice::kRow0;
  using Element = typename Traits::Element;
  Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride +
                int64_t(row0) * p.dq_row_stride + Slice::kCol0;
  store_pairs(acc, coord, p.scale, dq, p.dq_row_stride, p.seqlen_q(batch) - row0);
}

// One CTA per (query tile, q head, batch), a thread per consumer thread.
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads)
    bwd_convert_dq_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  int head, batch;
  if (!HeadBatchGrid::locate(p.heads_q, p.batch, head, batch)) return;
  const int m0 = blockIdx.x * Traits::kBlockM;
  float const* tile = ws.dq_accum + ((int64_t(batch) * p.heads_q + head) * ws.len_q_pad + m0) * Traits::kHeadDim;
  if (threadIdx.x < 128) {
    convert_dq_slice<Traits, 0>(p, ws, tile, head, batch, m0, threadIdx.x);
  } else {
    convert_dq_slice<Traits, 1>(p, ws, tile, head, batch, m0, threadIdx.x - 128);
  }
}

template <class Traits>
cudaError_t launch_convert_dq(const AttnBwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  const dim3 grid = HeadBatchGrid::make((p.len_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads_q, p.batch);
  bwd_convert_dq_kernel<Traits><<<grid, Traits::kConsumerThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace tfb
