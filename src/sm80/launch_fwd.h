// Host side of the sm80 forward: picks the tile configuration for the head
// dim and launches one CTA per (query tile, q head, batch).
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "common/grid.h"
#include "common/mask_summary.h"
#include "sm80/kernel_fwd.h"
#include "sm80/kernel_traits_fwd.h"
#include "sm80/launch.h"

namespace tfb {
namespace sm80 {

template <class Traits, class Policy>
cudaError_t launch_kernel(const AttnFwdParams& params, cudaStream_t stream) {
  auto kernel = &fwd_kernel<Traits, Policy>;
  if constexpr (!mask::kReadsMemory<Policy>) {
    if (params.dropout.on()) kernel = &fwd_dropout_kernel<Traits, Policy>;
  }
  constexpr int kSmem = Traits::kSmemBytes;
  if (kSmem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const unsigned m_blocks = (params.len_q + Traits::kBlockM - 1) / Traits::kBlockM;
  kernel<<<HeadBatchGrid::make(m_blocks, params.heads_q, params.batch), Traits::kThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

// The kernel for the params' mask mode (mask_summary.h with_policy; a mask
// in memory is summarised for these tiles into the workspace, fwd_workspace_bytes).
template <class Traits>
cudaError_t launch_fwd_with(const AttnFwdParams& params, cudaStream_t stream) {
  if (params.head_dim != Traits::kHeadDim || params.qk_dim > params.head_dim || params.v_dim > params.head_dim ||
      params.heads_kv <= 0 || params.heads_q % params.heads_kv != 0 ||
      params.len_q <= 0 || params.len_k <= 0 || params.batch <= 0 ||
      !HeadBatchGrid::fits(params.heads_q, params.batch)) {
    return cudaErrorInvalidValue;
  }
  return mask::with_policy(params, Traits::kBlockM, Traits::kBlockN, params.workspace, stream,
                           [&](auto policy, const AttnFwdParams& p) {
                             return launch_kernel<Traits, decltype(policy)>(p, stream);
                           });
}

template <typename Element, int kHeadDim>
TileShape fwd_tile() {
  using Traits = typename FwdConfig<Element, kHeadDim>::Traits;
  return {Traits::kBlockM, Traits::kBlockN};
}

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream) {
  using Traits = typename FwdConfig<Element, kHeadDim>::Traits;
  static_assert(Traits::kSmemBytes <= 99 * 1024, "the sm80 family includes sm86/sm89 (99 KB per block)");
  return launch_fwd_with<Traits>(params, stream);
}

}  // namespace sm80
}  // namespace tfb
