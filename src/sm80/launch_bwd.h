// Assembly point of the sm80 backward: preprocess (row statistics, cleared dQ
// accumulator) -> main kernel (dK, dV; dQ into the accumulator) -> dQ convert.
#pragma once

#include <type_traits>

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "sm80/convert_bwd.h"
#include "sm80/kernel_bwd.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/launch.h"
#include "sm80/preprocess_bwd.h"
#include "sm80/workspace_bwd.h"

namespace tfb::sm80 {
namespace bwd {

template <class Traits>
cudaError_t launch_main(const AttnBwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  auto kernel = bwd_dkdv_kernel<Traits>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((params.len_k + Traits::kBlockN - 1) / Traits::kBlockN, params.heads_kv, params.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_convert_dq<Traits>(params, ws, stream);
}

}  // namespace bwd

template <typename Element, int kHeadDim>
cudaError_t launch_bwd(const AttnBwdParams& params, cudaStream_t stream) {
  using Config = bwd::BwdConfig<Element, kHeadDim>;
  const bwd::BwdWorkspace ws = bwd::carve_workspace(params);

  cudaError_t err = bwd::launch_preprocess<Element, kHeadDim>(params, ws, stream);
  if (err != cudaSuccess) return err;

  if constexpr (!std::is_same_v<typename Config::Traits, typename Config::SmallSmem>) {
    int device = 0, smem_optin = 0;
    err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    if (smem_optin < Config::Traits::kSmemBytes) return bwd::launch_main<typename Config::SmallSmem>(params, ws, stream);
  }
  return bwd::launch_main<typename Config::Traits>(params, ws, stream);
}

}  // namespace tfb::sm80
