// First backward kernel: per query row, D = rowsum(dO * O) in float32 and lse
// in log2 units, both padded to whole query blocks, and a zeroed dQ
// accumulator. The main kernel then reads row statistics without bounds checks.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"
#include "common/constants.h"
#include "common/grid.h"
#include "common/workspace_bwd.h"

namespace tfb {

template <typename Element, int kHeadDim>
struct BwdPreprocess {
  // A row is kChunks 16-byte vectors, read by a group of kLanesPerRow lanes
  // (a power of two, so the group reduces with xor shuffles).
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kLanesPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockRows = 32;
  static_assert(kChunks <= 32 && kBwdRowPad % kBlockRows == 0 && kBlockRows % (kWarps * kRowsPerWarp) == 0);
};

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(BwdPreprocess<Element, kHeadDim>::kThreads)
    bwd_preprocess_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  using Cfg = BwdPreprocess<Element, kHeadDim>;
  int head, batch, row0;
  if (!locate_row_block<Cfg::kBlockRows>(p, head, batch, row0)) return;
  const int len_q = p.seqlen_q(batch);
  if (row0 >= padded_len_q(len_q)) return;  // uniform lengths: the grid covers every padded row
  const int64_t stat0 = ws.row0(batch, head, p.heads_q) + row0;
  const float* lse = p.lse + p.lse_offset(batch, head);

  for (int split = 0; split < ws.splits; ++split) {
    float4* acc = reinterpret_cast<float4*>(ws.dq_accum + split * ws.split_elems + stat0 * kHeadDim);
    for (int i = threadIdx.x; i < Cfg::kBlockRows * kHeadDim / 4; i += Cfg::kThreads) {
      acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = lane % Cfg::kLanesPerRow;
  const Element* o = static_cast<const Element*>(p.o) + p.o_offset(batch) + head * p.o_head_stride;
  const Element* dout = static_cast<const Element*>(p.dout) + p.do_offset(batch) + head * p.do_head_stride;
  for (int r = warp * Cfg::kRowsPerWarp + lane / Cfg::kLanesPerRow; r < Cfg::kBlockRows;
       r += Cfg::kWarps * Cfg::kRowsPerWarp) {
    const int row = row0 + r;
    float sum = 0.f;
    if (row < len_q && chunk * 8 < p.v_dim) {  // o and dout's columns (v_dim <= kHeadDim)
      const uint4 ov = *reinterpret_cast<const uint4*>(o + row * p.o_row_stride + chunk * 8);
      const uint4 dv = *reinterpret_cast<const uint4*>(dout + row * p.do_row_stride + chunk * 8);
      const Element* oe = reinterpret_cast<const Element*>(&ov);
      const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += static_cast<float>(oe[j]) * static_cast<float>(de[j]);
    }
#pragma unroll
    for (int off = Cfg::kLanesPerRow / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (chunk == 0) {
      const bool real = row < len_q;
      ws.dsum[stat0 + r] = real ? sum : 0.f;
      ws.lse_log2[stat0 + r] = real ? lse[row] * kLog2eFloat : INFINITY;
    }
  }
}

template <typename Element, int kHeadDim>
cudaError_t launch_bwd_preprocess(const AttnBwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  using Cfg = BwdPreprocess<Element, kHeadDim>;
  const dim3 grid = row_blocks_grid(p, Cfg::kBlockRows, ws.len_q_pad / Cfg::kBlockRows);
  bwd_preprocess_kernel<Element, kHeadDim><<<grid, Cfg::kThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace tfb
