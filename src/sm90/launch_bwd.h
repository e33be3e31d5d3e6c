// Host side of the sm90 backward: preprocess (row statistics, cleared dQ
// accumulator; the same kernel and workspace layout as sm80's) -> for a
// boolean attn_mask, its tile summary -> main kernel (dK, dV; dQ reduced into
// the accumulator) -> dQ convert.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "api.h"
#include "common/grid.h"
#include "common/mask_summary.h"
#include "common/preprocess_bwd.h"
#include "common/tile_list.h"
#include "common/workspace_bwd.h"
#include "sm90/convert_bwd.h"
#include "sm90/kernel_bwd.h"
#include "sm90/kernel_traits_bwd.h"
#include "sm90/launch.h"
#include "sm90/launch_fwd.h"

namespace tfb {
namespace sm90 {

// The tile of masked calls: the mask's summary is made for it.
template <typename Element, int kHeadDim>
TileShape bwd_tile() {
  using Traits = typename BwdConfig<Element, kHeadDim>::Traits;
  return {Traits::kBlockM, Traits::kBlockN};
}

// Policy: mask.h Band, or FromMemory for a boolean attn_mask (whose summary
// `a` then points at: launch_bwd runs the pre-pass). kPacked: a packed batch
// (Band), its tensors every sequence's rows in one batch.
template <class Traits, class Policy, bool kPacked>
cudaError_t launch_bwd_with(const AttnBwdParams& a, const BwdWorkspace& ws, cudaStream_t stream,
                            const TileList& list = {}) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  // A runtime call before the TMA descriptors are encoded: it binds the
  // thread's context, which the encoder needs (launch_fwd.h).
  auto kernel = &bwd_kernel<Traits, Policy, kPacked>;
  if constexpr (!kPacked && !mask::kReadsMemory<Policy>) {
    if (a.dropout.on()) kernel = &bwd_dropout_kernel<Traits, Policy, kPacked>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;

  const int rows_q = kPacked ? int(a.seqlens.total_q) : a.len_q;
  const int rows_k = kPacked ? int(a.seqlens.total_k) : a.len_k;
  const int batch = kPacked ? 1 : a.batch;
  auto mQ = detail::gmem_tensor<Traits>(static_cast<Element const*>(a.q), rows_q, a.qk_dim, a.heads_q, batch,
                                        a.q_row_stride, a.q_head_stride, a.q_batch_stride);
  auto mdO = detail::gmem_tensor<Traits>(static_cast<Element const*>(a.dout), rows_q, a.v_dim, a.heads_q, batch,
                                         a.do_row_stride, a.do_head_stride, a.do_batch_stride);
  auto mK = detail::gmem_tensor<Traits>(static_cast<Element const*>(a.k), rows_k, a.qk_dim, a.heads_kv, batch,
                                        a.k_row_stride, a.k_head_stride, a.k_batch_stride);
  auto mV = detail::gmem_tensor<Traits>(static_cast<Element const*>(a.v), rows_k, a.v_dim, a.heads_kv, batch,
                                        a.v_row_stride, a.v_head_stride, a.v_batch_stride);
  using TileQ = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>;
  const int n_blocks = (a.len_k + Traits::kBlockN - 1) / Traits::kBlockN;

  using KernelParams = BwdKernelParams<Traits, Policy, kPacked>;
  KernelParams p{
      {make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Traits::SmemLayoutQStage{}, TileQ{}, _1{}),
       make_tma_copy(SM90_TMA_LOAD{}, mdO, typename Traits::SmemLayoutQStage{}, TileQ{}, _1{}),
       make_tma_copy(SM90_TMA_LOAD{}, mK, typename Traits::SmemLayoutKV{}, TileKV{}, _1{}),
       make_tma_copy(SM90_TMA_LOAD{}, mV, typename Traits::SmemLayoutKV{}, TileKV{}, _1{}),
       mQ.shape(), mK.shape(), a.heads_q / a.heads_kv, a.heads_q, a.scale_log2, ws.len_q_pad, ws.lse_log2, ws.dsum,
       ws.dq_accum, ws.split_elems, a.deterministic, a.seqlens, ws.head_rows, a.dropout},
      a.heads_kv,
      a.batch,
      n_blocks,
      std::max(1, a.num_sms / n_blocks),  // a group's CTAs fill the SMs about once
      a.len_q,
      a.len_k,
      uniform_walk<typename KernelParams::Mask>(a),
      a.mask,
      a.scale,
      static_cast<Element*>(a.dk),
      static_cast<Element*>(a.dv),
      a.dk_batch_stride,
      a.dk_head_stride,
      a.dk_row_stride,
      a.dv_batch_stride,
      a.dv_head_stride,
      a.dv_row_stride,
      a.qk_dim,
      a.v_dim,
      list.entries,
      list.count};

  // Deterministic: one CTA per split walks its key tiles (the splits fill the
  // SMs over batch x kv heads); otherwise one CTA per key tile, a packed
  // batch's from its list (the entries listed; the rest return at once).
  const dim3 grid = kPacked && !a.deterministic
                        ? dim3(unsigned(list.capacity))
                        : HeadBatchGrid::make(a.deterministic ? ws.splits : n_blocks, a.heads_kv, a.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_convert_dq<Traits>(a, ws, stream);
}

template <typename Element, int kHeadDim>
cudaError_t launch_bwd(const AttnBwdParams& a, cudaStream_t stream) {
  using Traits = typename BwdConfig<Element, kHeadDim>::Traits;
  if (a.head_dim != kHeadDim || a.qk_dim > kHeadDim || a.v_dim > kHeadDim || a.heads_kv <= 0 ||
      a.heads_q % a.heads_kv != 0 || a.len_q <= 0 || a.len_k <= 0 || a.batch <= 0 || !can_run_bwd(a) ||
      !HeadBatchGrid::fits(a.heads_q, a.batch)) {
    return cudaErrorInvalidValue;
  }
  const BwdWorkspace ws = carve_bwd_workspace(a);
  const cudaError_t err = launch_bwd_preprocess<Element, kHeadDim>(a, ws, stream);
  if (err != cudaSuccess) return err;
  if (a.seqlens.cu_q) {  // its key tiles listed past the accumulators (bwd_workspace_bytes)
    if (a.mask.in_memory()) return cudaErrorInvalidValue;
    TileList list;
    if (!a.deterministic) {
      list = tile_list_at(static_cast<char*>(a.workspace) + bwd_list_offset(a), a, Traits::kBlockN, TileAxis::kKeys);
      const cudaError_t built = build_tile_list(a, Traits::kBlockN, TileAxis::kKeys, list, stream);
      if (built != cudaSuccess) return built;
    }
    return launch_bwd_with<Traits, mask::Band, true>(a, ws, stream, list);
  }
  // A mask in memory's summary goes past the accumulators (bwd_workspace_bytes).
  void* scratch = static_cast<char*>(a.workspace) + bwd_workspace_size(a);
  return mask::with_policy(a, Traits::kBlockM, Traits::kBlockN, scratch, stream,
                           [&](auto policy, const AttnBwdParams& p) {
                             using Policy = decltype(policy);
                             if constexpr (mask::kAddsValues<Policy>) {
                               return cudaErrorInvalidValue;
                             } else {
                               return launch_bwd_with<Traits, Policy, false>(p, ws, stream);
                             }
                           });
}

}  // namespace sm90
}  // namespace tfb
