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
  // From sm_90 on both grids may start before the previous one in the stream
  // ends: each waits for it in the kernel before touching memory (every
  // binary that runs there is sm_90 code or compute_90 PTX, which has the wait).
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  auto config = [&](dim3 blocks, size_t smem, int threads) {
    cudaLaunchConfig_t c{};
    c.gridDim = blocks;
    c.blockDim = dim3(threads);
    c.dynamicSmemBytes = smem;
    c.stream = stream;
    c.attrs = &overlap;
    c.numAttrs = major >= 9 ? 1 : 0;
    return c;
  };
  auto launch = [&](auto kernel, size_t smem) {
    // Per device: set on every launch (the current device may differ from the last's).
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
    const cudaLaunchConfig_t c = config(grid, smem, kThreads);
    return cudaLaunchKernelEx(&c, kernel, p, rows, splits);
  };
  err = masked(p) ? launch(split_kernel<Element, kHeadDim, true>, smem_bytes(kHeadDim, true))
                  : launch(split_kernel<Element, kHeadDim, false>, smem_bytes(kHeadDim, false));
  if (err != cudaSuccess) return err;
  if (splits.count > 1) {
    const int64_t all_rows = int64_t(p.batch) * p.heads_q * p.len_q;  // a CTA each
    const cudaLaunchConfig_t c = config(dim3(unsigned(all_rows)), 0, kCombineThreads);
    err = cudaLaunchKernelEx(&c, combine_kernel<Element, kHeadDim>, p, splits.count);
    if (err != cudaSuccess) return err;
  }
  return cudaGetLastError();
}

}  // namespace tfb::decode
