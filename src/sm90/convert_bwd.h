// Last backward kernel: the float32 dQ accumulators (their splits summed in
// order), times the softmax scale, written to dq in the input dtype with its
// strides. The accumulator holds each query tile in the main kernel's
// fragment order, so each thread reads back the values one consumer thread
// staged, in the same registers' layout; the tile then goes through shared
// memory, so that dq's rows are written 16 bytes a thread (straight from the
// fragments, 4-byte stores covering 16 bytes of 8 rows each, the kernel ran at
// half the memory bandwidth: benchmarks/history/2026-11-v9-v27.md, v26).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "params.h"
#include "common/grid.h"
#include "common/workspace_bwd.h"
#include "sm90/kernel_traits_bwd.h"

namespace tfb {
namespace sm90 {

// The CTA's query tile of dq in 16 bits. Rows are padded by 16 bytes: the
// fragments' pair stores (8 rows x 4 threads a warp) then fall in distinct banks
// for every head dim.
template <class Traits>
struct DqStage {
  using Element = typename Traits::Element;
  static constexpr int kPitch = Traits::kHeadDim + 8;  // elements
  alignas(16) Element data[Traits::kBlockM * kPitch];
};

// Thread t of consumer warpgroup w: its values of the query tile's dQ (the
// splits summed in order), scaled, into the stage.
template <class Traits, int w>
CUTE_DEVICE void stage_dq_slice(const AttnBwdParams& p, const BwdWorkspace& ws, float const* tile,
                                DqStage<Traits>& stage, int wg_thread) {
  using Slice = typename Traits::template DqSlice<w>;
  typename Slice::Mma mma;
  Tensor coord = mma.get_thread_slice(wg_thread).partition_C(make_identity_tensor(Shape<_64, Int<Slice::kCols>>{}));
  Tensor acc = make_tensor<float>(shape(coord));
  float const* mine = tile + Slice::kOffset;
  // Runs of four values (BwdTraits::kDqVec): one 16-byte load each.
  const auto add = [&](float const* from, bool first) {
    CUTE_UNROLL
    for (int j = 0; j < size(acc); j += 4) {
      const float4 x = *reinterpret_cast<const float4*>(from + Traits::dq_index(j, wg_thread));
      acc(j) = first ? x.x : acc(j) + x.x;
      acc(j + 1) = first ? x.y : acc(j + 1) + x.y;
      acc(j + 2) = first ? x.z : acc(j + 2) + x.z;
      acc(j + 3) = first ? x.w : acc(j + 3) + x.w;
    }
  };
  add(mine, true);
  for (int split = 1; split < ws.splits; ++split) add(mine + split * ws.split_elems, false);
  using Element = typename Traits::Element;
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int j = 0; j < size(acc); j += 2) {  // values 2i and 2i + 1: one row's neighbouring columns
    const int row = Slice::kRow0 + get<0>(coord(j)), col = Slice::kCol0 + get<1>(coord(j));
    cutlass::Array<float, 2> pair;
    pair[0] = acc(j) * p.scale;
    pair[1] = acc(j + 1) * p.scale;
    const cutlass::Array<Element, 2> converted = convert(pair);
    *reinterpret_cast<uint32_t*>(&stage.data[row * DqStage<Traits>::kPitch + col]) =
        reinterpret_cast<uint32_t const&>(converted);
  }
}

// One CTA per query tile of a q head (workspace_bwd.h row_blocks_grid), a thread per consumer thread.
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads)
    bwd_convert_dq_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  __shared__ DqStage<Traits> stage;
  int head, batch, m0;
  if (!locate_row_block<Traits::kBlockM>(p, head, batch, m0)) return;
  const int rows = min(Traits::kBlockM, p.seqlen_q(batch) - m0);
  if (rows <= 0) return;
  float const* tile = ws.dq_accum + (ws.row0(batch, head, p.heads_q) + m0) * kHeadDim;
  if (threadIdx.x < 128) {
    stage_dq_slice<Traits, 0>(p, ws, tile, stage, threadIdx.x);
  } else {
    stage_dq_slice<Traits, 1>(p, ws, tile, stage, threadIdx.x - 128);
  }
  __syncthreads();
  // The rows that exist, 8 values (16 bytes) a thread at a time, dq's own
  // columns alone (qk_dim, a multiple of 8); 4-byte pieces where dq's rows or
  // start are not 16-byte aligned.
  const int pieces = p.qk_dim / 8;
  Element* dq = static_cast<Element*>(p.dq) + p.dq_offset(batch) + head * p.dq_head_stride +
                int64_t(m0) * p.dq_row_stride;
  const bool vectors = (reinterpret_cast<uintptr_t>(p.dq) % 16 | (p.dq_batch_stride | p.dq_head_stride |
                                                                  p.dq_row_stride) % 8) == 0;
  for (int i = threadIdx.x; i < rows * pieces; i += Traits::kConsumerThreads) {
    const int r = i / pieces, c = i % pieces;
    const uint4 v = *reinterpret_cast<const uint4*>(&stage.data[r * DqStage<Traits>::kPitch + c * 8]);
    Element* out = dq + r * p.dq_row_stride + c * 8;
    if (vectors) {
      *reinterpret_cast<uint4*>(out) = v;
    } else {
      uint32_t* words = reinterpret_cast<uint32_t*>(out);
      words[0] = v.x;
      words[1] = v.y;
      words[2] = v.z;
      words[3] = v.w;
    }
  }
}

template <class Traits>
cudaError_t launch_convert_dq(const AttnBwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  const dim3 grid = row_blocks_grid(p, Traits::kBlockM, (p.len_q + Traits::kBlockM - 1) / Traits::kBlockM);
  bwd_convert_dq_kernel<Traits><<<grid, Traits::kConsumerThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace tfb
