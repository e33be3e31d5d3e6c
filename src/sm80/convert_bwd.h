// Last backward kernel: the float32 dQ accumulator, summed over all key blocks,
// times the softmax scale, written to dq in the input dtype with its strides.
// dK and dV need no such pass: a CTA owns its keys for every query head of its
// GQA group and writes them itself.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"
#include "sm80/workspace_bwd.h"

namespace tfb::sm80::bwd {

constexpr int kConvertThreads = 256;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kConvertThreads) bwd_convert_dq_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  constexpr int kChunks = kHeadDim / 8;  // one thread per 8 elements (16 bytes out)
  const int64_t idx = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
  if (idx >= int64_t(p.len_q) * kChunks) return;
  const int row = static_cast<int>(idx / kChunks), chunk = static_cast<int>(idx % kChunks);
  const int head = blockIdx.y, batch = blockIdx.z;
  const int64_t bh = int64_t(batch) * p.heads_q + head;

  const float4* src = reinterpret_cast<const float4*>(ws.dq_accum + (bh * ws.len_q_pad + row) * kHeadDim + chunk * 8);
  const float4 a = src[0], b = src[1];
  const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  uint4 packed;
  Element* out = reinterpret_cast<Element*>(&packed);
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = static_cast<Element>(v[j] * p.scale);
  Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
  *reinterpret_cast<uint4*>(dq + row * p.dq_row_stride + chunk * 8) = packed;
}

template <typename Element, int kHeadDim>
cudaError_t launch_convert_dq(const AttnBwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  const int64_t work = int64_t(p.len_q) * (kHeadDim / 8);
  const dim3 grid(static_cast<unsigned>((work + kConvertThreads - 1) / kConvertThreads), p.heads_q, p.batch);
  bwd_convert_dq_kernel<Element, kHeadDim><<<grid, kConvertThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace tfb::sm80::bwd
