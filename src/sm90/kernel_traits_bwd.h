// Compile-time configuration of the sm90 backward: tile sizes per head dim,
// thread roles, shared-memory layouts, the four wgmma tilings and the TMA types.
//
// A CTA owns kBlockN keys of one kv head and walks the query tiles (kBlockM
// rows) of every query head of the GQA group. One producer warpgroup (one
// thread issues every load) and kBlockN / 64 consumer warpgroups, each owning
// 64 of the keys. Scores are computed transposed, keys as the wgmma's M:
//   S^T  = K Q^T, dP^T = V dO^T   (64 keys x kBlockM, both operands in smem)
//   dV  += P^T dO, dK += dS^T Q   (64 keys x E, P^T and dS^T from registers)
//   dQ   = dS K                   (through smem; split over the warpgroups)
// so P and dS never go through shared memory for dK and dV; dS alone does, for dQ.
#pragma once

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "sm90/kernel_traits_fwd.h"

namespace tfb {
namespace sm90 {

using namespace cute;

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;

  static constexpr int kConsumerWarpgroups = kBlockN / 64;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  static_assert(kBlockN % 64 == 0 && kConsumerWarpgroups >= 1 && kConsumerWarpgroups <= 2);
  static_assert(kBlockM % 64 == 0 && kBlockM <= 128);
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * kConsumerThreads <=
                    65536 / kThreads / 8 * 8 * kThreads,
                "register split exceeds the launch allocation");

  using SmemAtom = decltype(k_major_smem_atom<Element, kHeadDim>());
  static constexpr int kAtomCols = decltype(size<1>(SmemAtom{}))::value;  // head-dim columns of one swizzle atom

  // dQ's tile (kBlockM x E) is split between the two consumer warpgroups:
  // along the query rows when there are 64 per warpgroup, else along the head
  // dim in slices of whole swizzle atoms (wgmma reads an MN-major B in whole
  // atoms), the first warpgroup taking the larger slice (E = 96: 64 + 32).
  static constexpr bool kDqSplitRows = kBlockM == 64 * kConsumerWarpgroups;
  static constexpr int kDqCols0 =
      kDqSplitRows ? kHeadDim : (kHeadDim / 2 + kAtomCols - 1) / kAtomCols * kAtomCols;
  static_assert(kConsumerWarpgroups == 2 && (kDqSplitRows || kBlockM == 64), "no split of dQ over the warpgroups");
  // Warpgroup w's share: 64 rows from kRow0, kCols columns from kCol0, staged
  // (and kept in the accumulator) in its own fragment order from kOffset.
  template <int w>
  struct DqSlice {
    static constexpr int kRow0 = kDqSplitRows ? 64 * w : 0;
    static constexpr int kCol0 = kDqSplitRows ? 0 : w * kDqCols0;
    static constexpr int kCols = kDqSplitRows || w == 0 ? kDqCols0 : kHeadDim - kDqCols0;
    static constexpr int kOffset = w * 64 * kDqCols0;
    static_assert(kCol0 % kCols == 0, "a slice starts at a multiple of its width");
    using Mma = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kCols>, Int<kBlockN>>, GMMA::Major::MN,
                             GMMA::Major::MN>()));
  };
  // Q and dO stages, (query, dim, stage); K and V, (key, dim).
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQStage = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // The same bytes with the first two modes swapped: Q and dO as the B operand
  // of dK and dV, (dim, query, stage); K as dQ's B operand, (dim, key).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // dS, (query, key), queries contiguous: the consumers write dS^T pairs of
  // neighbouring queries as one 32-bit store; dQ reads it as an MN-major A.
  using SmemLayoutdS =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));

  // Each warpgroup runs its own single-warpgroup tilings on its slabs.
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>()));
  using MmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>()));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kStatBytes = kBlockM * sizeof(float);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kDqElems = kBlockM * kHeadDim;  // floats of one query tile's dQ

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> ds;
    alignas(128) cute::array_aligned<float, kDqElems> dq;
    alignas(16) float lse[kStages][kBlockM];   // lse * log2(e) of the stage's rows (lands with Q)
    alignas(16) float dsum[kStages][kBlockM];  // rowsum(dO * O) (lands with dO)
    typename Pipeline::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_do;
    cutlass::arch::ClusterTransactionBarrier kv_full;  // K and V landed
    cutlass::arch::ClusterBarrier kv_free;             // no consumer reads K or V any more
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in an H100's shared memory");

  using GmemShape = Shape<int, int, int, int>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{},
                                          GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQStage{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKV{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
};

// Tile sizes per head dim. dK and dV of a warpgroup's 64 keys stay in
// registers (E / 2 floats each per thread), with S^T and dP^T (kBlockM / 2).
template <typename Element, int kHeadDim>
struct BwdConfig;
template <typename Element>
struct BwdConfig<Element, 64> {
  using Traits = BwdTraits<Element, 64, 128, 128, 2>;
};
template <typename Element>
struct BwdConfig<Element, 96> {
  using Traits = BwdTraits<Element, 96, 64, 128, 2>;
};
template <typename Element>
struct BwdConfig<Element, 128> {
  using Traits = BwdTraits<Element, 128, 64, 128, 2>;
};

}  // namespace sm90
}  // namespace tfb
