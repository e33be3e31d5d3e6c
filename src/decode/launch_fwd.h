// Host side of the decode forward: the split count, the launch of the split
// kernel and, with several splits, of the combine.
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "decode/kernel_fwd.h"
#include "decode/launch.h"

namespace tfb::decode {

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream) {
  if (params.head_dim != kHeadDim || !fits(params)) return cudaErrorInvalidValue;
  AttnFwdParams p = params;
  const Splits splits = splits_for(p);
  if (splits.count > 1) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    const size_t rows = size_t(splits.count) * p.batch * p.heads_q * p.len_q;
    p.split_kv = {splits.count, static_cast<float*>(p.workspace), static_cast<float*>(p.workspace) + rows * kHeadDim};
  }
  const Rows rows{rows_per_kv_head(p), p.heads_q / p.heads_kv};
  const dim3 grid(unsigned(splits.count * rows.tiles()), p.heads_kv, p.batch);
  constexpr size_t kSmem = smem_bytes(kHeadDim);
  // Per device: set on every launch (the current device may differ from the last's).
  cudaError_t err = cudaFuncSetAttribute(split_kernel<Element, kHeadDim>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
  if (err != cudaSuccess) return err;
  split_kernel<Element, kHeadDim><<<grid, kThreads, kSmem, stream>>>(p, rows, splits);
  if (splits.count > 1) {
    const int64_t all_rows = int64_t(p.batch) * p.heads_q * p.len_q;
    combine_kernel<Element, kHeadDim><<<unsigned((all_rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
        p, splits.count);
  }
  return cudaGetLastError();
}

}  // namespace tfb::decode
