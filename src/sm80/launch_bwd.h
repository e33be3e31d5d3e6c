// Assembly point of the sm80 backward: preprocess (row statistics, cleared dQ
// accumulator) -> main kernel (dK, dV; dQ into the accumulator) -> dQ convert.
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "sm80/convert_bwd.h"
#include "sm80/kernel_bwd.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/launch.h"
#include "sm80/preprocess_bwd.h"
#include "sm80/workspace_bwd.h"

namespace tfb::sm80 {

template <typename Element, int kHeadDim>
cudaError_t launch_bwd(const AttnBwdParams& params, cudaStream_t stream) {
  using Traits = typename bwd::BwdConfig<Element, kHeadDim>::Traits;
  const bwd::BwdWorkspace ws = bwd::carve_workspace(params);

  cudaError_t err = bwd::launch_preprocess<Element, kHeadDim>(params, ws, stream);
  if (err != cudaSuccess) return err;

  auto kernel = bwd::bwd_dkdv_kernel<Traits>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((params.len_k + Traits::kBlockN - 1) / Traits::kBlockN, params.heads_kv, params.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  return bwd::launch_convert_dq<Element, kHeadDim>(params, ws, stream);
}

}  // namespace tfb::sm80
