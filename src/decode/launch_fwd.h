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
  auto launch = [&](auto kernel, size_t smem) {
    // Per device: set on every launch (the current device may differ from the last's).
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err == cudaSuccess) kernel<<<grid, kThreads, smem, stream>>>(p, rows, splits);
    return err;
  };
  const cudaError_t err = masked(p) ? launch(split_kernel<Element, kHeadDim, true>, smem_bytes(kHeadDim, true))
                                    : launch(split_kernel<Element, kHeadDim, false>, smem_bytes(kHeadDim, false));
  if (err != cudaSuccess) return err;
  if (splits.count > 1) {
    const int64_t all_rows = int64_t(p.batch) * p.heads_q * p.len_q;
    combine_kernel<Element, kHeadDim><<<unsigned((all_rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
        p, splits.count);
  }
  return cudaGetLastError();
}

}  // namespace tfb::decode
