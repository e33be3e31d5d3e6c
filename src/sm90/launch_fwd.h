// Host side of the sm90 forward: builds the TMA descriptors for this call's
// pointers and strides and launches one persistent CTA per SM (or per work
// unit, when there are fewer units).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/mask_summary.h"
#include "common/tile_list.h"
#include "sm90/kernel_fwd.h"
#include "sm90/kernel_traits_fwd.h"
#include "api.h"
#include "sm90/launch.h"

namespace tfb {
namespace sm90 {

namespace detail {

// A dim of size 1 is never stepped along, but TMA still wants its stride to be
// a multiple of 16 bytes: give it one (in elements of `bytes`).
inline int64_t usable_stride(int64_t stride, int size, int bytes) { return size <= 1 ? 16 / bytes : stride; }

// cols: the tensor's head dim (params.h qk_dim / v_dim), at most the tiles'
// Traits::kHeadDim. TMA fills a box's columns past it with zeros on loads and
// leaves them out on stores: a smaller head dim costs no copy and no code.
template <class Traits, typename Pointer>
auto gmem_tensor(Pointer ptr, int rows, int cols, int heads, int batch, int64_t row_stride, int64_t head_stride,
                 int64_t batch_stride) {
  constexpr int kBytes = int(sizeof(*ptr));
  return make_tensor(make_gmem_ptr(static_cast<Pointer>(ptr)),
                     make_shape(rows, cols, heads, batch),
                     make_stride(usable_stride(row_stride, rows, kBytes), _1{}, usable_stride(head_stride, heads, kBytes),
                                 usable_stride(batch_stride, batch, kBytes)));
}

}  // namespace detail

// Policy: mask.h Band, FromMemory or FromMemoryAdditive (mask_summary.h
// with_policy: for a mask in memory `a` points at its summary, and next_unit
// at the dynamic scheduler's counter, which the pre-pass zeroes).
// kPacked: a packed batch, its tiles listed in `list` (launch_fwd_packed).
template <class Traits, class Policy, bool kPacked = false>
cudaError_t launch_fwd_with(const AttnFwdParams& a, cudaStream_t stream, int* next_unit = nullptr,
                            const TileList& list = {}) {
  using Element = typename Traits::Element;
  if (a.head_dim != Traits::kHeadDim || a.qk_dim > a.head_dim || a.v_dim > a.head_dim ||
      a.element_bytes != int(sizeof(Element)) || a.heads_kv <= 0 ||
      a.heads_q % a.heads_kv != 0 || a.len_q <= 0 || a.len_k <= 0 || a.batch <= 0 || !can_run_fwd(a)) {
    return cudaErrorInvalidValue;
  }
  const int64_t m_blocks = (a.len_q + Traits::kBlockM - 1) / Traits::kBlockM;
  // The scheduler's positions count two per unit, plus a grid stride.
  const int64_t units = kPacked ? list.capacity : m_blocks * a.heads_q * a.batch;
  if (units > INT_MAX / 2 - 4096) return cudaErrorInvalidValue;
  // A packed batch's tensors: every sequence's rows, one batch.
  const int rows_q = kPacked ? int(a.seqlens.total_q) : a.len_q;
  const int rows_k = kPacked ? int(a.seqlens.total_k) : a.len_k;
  const int batch = kPacked ? 1 : a.batch;

  // TMA descriptors are encoded through the driver API, which needs a context
  // current in this thread. The runtime binds the device's primary context
  // lazily, at a thread's first runtime call; when this launch is that call
  // (an op's first CUDA work in a new thread), the encoder fails with
  // CUDA_ERROR_INVALID_CONTEXT, CuTe leaves the descriptor zero, and the kernel
  // dies on an illegal instruction. A runtime call first binds the context.
  auto kernel = &fwd_kernel<Traits, Policy, kPacked>;
  if constexpr (!Traits::kFp8 && !kPacked && !mask::kReadsMemory<Policy>) {
    if (a.dropout.on()) kernel = &fwd_dropout_kernel<Traits, Policy, kPacked>;
  }
  constexpr int kSmem = Traits::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;

  auto mQ = detail::gmem_tensor<Traits>(static_cast<Element const*>(a.q), rows_q, a.qk_dim, a.heads_q, batch,
                                        a.q_row_stride, a.q_head_stride, a.q_batch_stride);
  auto mK = detail::gmem_tensor<Traits>(static_cast<Element const*>(a.k), rows_k, a.qk_dim, a.heads_kv, batch,
                                        a.k_row_stride, a.k_head_stride, a.k_batch_stride);
  auto mV = detail::gmem_tensor<Traits>(static_cast<Element const*>(a.v), rows_k, a.v_dim, a.heads_kv, batch,
                                        a.v_row_stride, a.v_head_stride, a.v_batch_stride);
  using ElementOut = typename Traits::ElementOut;
  auto mO = detail::gmem_tensor<Traits>(static_cast<ElementOut*>(a.o), rows_q, a.v_dim, a.heads_q, batch,
                                        a.o_row_stride, a.o_head_stride, a.o_batch_stride);
  using TileQ = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  using TileKV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;

  using KernelParams = FwdKernelParams<Traits, Policy, kPacked>;
  typename KernelParams::Scheduler scheduler;
  if constexpr (kPacked) {
    scheduler = {list.entries, list.count, list.next_unit, a.seqlens, a.len_q, a.len_k};
  } else {
    scheduler = {int(m_blocks), a.heads_q, a.batch, a.mask.right_bounded(), next_unit};
  }
  KernelParams p{
      {make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Traits::SmemLayoutQ{}, TileQ{}, _1{}),
       make_tma_copy(SM90_TMA_LOAD{}, mK, typename Traits::SmemLayoutKVStage{}, TileKV{}, _1{}),
       make_tma_copy(SM90_TMA_LOAD{}, mV, typename Traits::SmemLayoutKVStage{}, TileKV{}, _1{}),
       mQ.shape(), mK.shape(), a.heads_q / a.heads_kv, a.scale_log2, a.heads_q, a.dropout},
      {make_tma_copy(SM90_TMA_STORE{}, mO, typename Traits::SmemLayoutOSlab{}, Shape<_64, Int<Traits::kHeadDim>>{},
                     _1{}),
       mO.shape(), a.lse, kPacked ? a.seqlens.total_q : a.len_q, a.heads_q, static_cast<ElementOut*>(a.o),
       a.o_row_stride, a.o_head_stride, a.v_dim},
      scheduler,
      a.len_q,
      uniform_walk<typename KernelParams::Mask>(a),
      a.mask,
      a.scale,
      a.descales};

  int64_t work = units;  // at most: a packed batch's entries are counted on the device
  if constexpr (!kPacked) work = p.scheduler.num_units();
  const int grid = int(std::min<int64_t>(work, std::max(a.num_sms, 1)));
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// The tile of masked calls (Traits; ShortCausalTraits serves causal calls alone).
template <typename Element, int kHeadDim>
TileShape fwd_tile() {
  using Traits = typename FwdConfig<Element, kHeadDim>::Traits;
  return {Traits::kBlockM, Traits::kBlockN};
}

// A packed batch (params.h SeqLens): the tile list's pre-pass into the
// workspace (fwd_workspace_bytes), then the kernel over the list, its band
// built per sequence. Traits's tiles alone (one instantiation more).
template <class Traits>
cudaError_t launch_fwd_packed(const AttnFwdParams& params, cudaStream_t stream) {
  if (params.mask.in_memory()) return cudaErrorInvalidValue;
  const TileList list = tile_list_at(params.workspace, params, Traits::kBlockM, TileAxis::kQueries);
  const cudaError_t err = build_tile_list(params, Traits::kBlockM, TileAxis::kQueries, list, stream);
  if (err != cudaSuccess) return err;
  return launch_fwd_with<Traits, mask::Band, true>(params, stream, nullptr, list);
}

// The kernel for the params' mask mode (mask_summary.h with_policy; a mask
// in memory is summarised for Traits's tiles into the workspace, fwd_workspace_bytes).
template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream) {
  using Config = FwdConfig<Element, kHeadDim>;
  using Traits = typename Config::Traits;
  if (params.seqlens.cu_q) return launch_fwd_packed<Traits>(params, stream);
  if constexpr (Traits::kFp8) {  // no attn_mask: _scaled_dot_product_attention_quantized takes none
    if (params.mask.in_memory()) return cudaErrorInvalidValue;
    return launch_fwd_with<Traits, mask::Band>(params, stream);
  } else {
    int* next_unit = params.mask.in_memory()
                         ? reinterpret_cast<int*>(static_cast<char*>(params.workspace) +
                                                  mask::summary_bytes(params, Traits::kBlockM, Traits::kBlockN))
                         : nullptr;
    return mask::with_policy(
        params, Traits::kBlockM, Traits::kBlockN, params.workspace, stream,
        [&](auto policy, const AttnFwdParams& p) {
          using Policy = decltype(policy);
          if constexpr (!mask::kReadsMemory<Policy> && !std::is_void_v<typename Config::ShortCausalTraits>) {
            if (p.mask.right_bounded() && p.len_q <= Config::kShortCausalMaxLen) {
              return launch_fwd_with<typename Config::ShortCausalTraits, Policy>(p, stream);
            }
          }
          return launch_fwd_with<Traits, Policy>(p, stream, next_unit);
        },
        next_unit);
  }
}

}  // namespace sm90
}  // namespace tfb
