// Host side of the sm80 forward: picks the tile configuration for the head
// dim and launches one CTA per (query tile, q head, batch).
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "sm80/kernel_fwd.h"
#include "sm80/kernel_traits_fwd.h"
#include "sm80/launch.h"

namespace tfb {
namespace sm80 {

template <class Traits>
cudaError_t launch_fwd_with(const AttnFwdParams& params, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kMaxGridYZ = 65535;
  if (params.head_dim != Traits::kHeadDim || params.heads_q > kMaxGridYZ || params.heads_kv <= 0 ||
      params.heads_q % params.heads_kv != 0 || params.len_q <= 0 || params.len_k <= 0) {
    return cudaErrorInvalidValue;
  }
  auto kernel = &fwd_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  if (kSmem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const unsigned m_blocks = (params.len_q + Traits::kBlockM - 1) / Traits::kBlockM;
  // gridDim.z caps the batch: larger batches go in slices.
  for (int b0 = 0; b0 < params.batch; b0 += kMaxGridYZ) {
    AttnFwdParams p = params;
    p.batch = std::min(params.batch - b0, kMaxGridYZ);
    p.q = static_cast<const Element*>(params.q) + b0 * params.q_batch_stride;
    p.k = static_cast<const Element*>(params.k) + b0 * params.k_batch_stride;
    p.v = static_cast<const Element*>(params.v) + b0 * params.v_batch_stride;
    p.o = static_cast<Element*>(params.o) + b0 * params.o_batch_stride;
    p.lse = params.lse + int64_t(b0) * params.heads_q * params.len_q;
    kernel<<<dim3(m_blocks, p.heads_q, p.batch), Traits::kThreads, kSmem, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream) {
  using Traits = typename FwdConfig<Element, kHeadDim>::Traits;
  static_assert(Traits::kSmemBytes <= 99 * 1024, "the sm80 family includes sm86/sm89 (99 KB per block)");
  return launch_fwd_with<Traits>(params, stream);
}

}  // namespace sm80
}  // namespace tfb
