// Assembly point of the sm80 backward: preprocess (row statistics, cleared dQ
// accumulator) -> main kernel (dK, dV; dQ into the accumulator) -> dQ convert.
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "sm80/convert_bwd.h"
#include "common/grid.h"
#include "common/mask_summary.h"
#include "sm80/kernel_bwd.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/launch.h"
#include "common/preprocess_bwd.h"
#include "common/workspace_bwd.h"

namespace tfb::sm80 {
namespace bwd {

template <class Traits, class Policy>
cudaError_t launch_main_with(const AttnBwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  auto kernel = bwd_dkdv_kernel<Traits, Policy>;
  if constexpr (!mask::kReadsMemory<Policy>) {
    if (params.dropout.on()) kernel = bwd_dkdv_dropout_kernel<Traits, Policy>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  const unsigned n_blocks = (params.len_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // Deterministic: one CTA per split walks its key blocks, even with one split
  // (batch x kv heads already filling the SMs); otherwise one CTA per key block.
  const dim3 grid = HeadBatchGrid::make(params.deterministic ? ws.splits : n_blocks, params.heads_kv, params.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_convert_dq<Traits>(params, ws, stream);
}

// The kernel for the params' mask mode (mask_summary.h with_policy; a mask
// in memory is summarised into the workspace past the accumulators, bwd_workspace_bytes).
template <class Traits>
cudaError_t launch_main(const AttnBwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  void* scratch = static_cast<char*>(params.workspace) + bwd_workspace_size(params);
  return mask::with_policy(params, Traits::kBlockM, Traits::kBlockN, scratch, stream,
                           [&](auto policy, const AttnBwdParams& p) {
                             return launch_main_with<Traits, decltype(policy)>(p, ws, stream);
                           });
}

}  // namespace bwd

// GQA: one CTA owns a key block of one kv head and walks the query heads of
// its group itself, so dK and dV are summed in registers in a fixed order
// (deterministic, no float32 dK/dV workspace or extra pass). The price is a
// grid heads_q / heads_kv times smaller, which only matters when
// batch * heads_kv * key blocks is below a few waves of CTAs.
template <typename Element, int kHeadDim>
TileShape bwd_tile() {
  using Traits = typename bwd::BwdConfig<Element, kHeadDim>::Traits;
  return {Traits::kBlockM, Traits::kBlockN};
}

template <typename Element, int kHeadDim>
cudaError_t launch_bwd(const AttnBwdParams& params, cudaStream_t stream) {
  using Config = bwd::BwdConfig<Element, kHeadDim>;
  int device = 0, smem_optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  // Parts with about 100 KB of shared memory a block (sm86, sm89) get no backward.
  if (smem_optin < Config::SmallSmem::kSmemBytes) return cudaErrorNotSupported;
  if (!HeadBatchGrid::fits(params.heads_q, params.batch) || params.head_dim != kHeadDim ||
      params.qk_dim > kHeadDim || params.v_dim > kHeadDim) {
    return cudaErrorInvalidValue;
  }

  const BwdWorkspace ws = carve_bwd_workspace(params);
  err = launch_bwd_preprocess<Element, kHeadDim>(params, ws, stream);
  if (err != cudaSuccess) return err;
  if (smem_optin < Config::Traits::kSmemBytes) return bwd::launch_main<typename Config::SmallSmem>(params, ws, stream);
  return bwd::launch_main<typename Config::Traits>(params, ws, stream);
}

}  // namespace tfb::sm80
