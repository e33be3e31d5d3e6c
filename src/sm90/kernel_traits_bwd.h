// Compile-time configuration of the sm90 backward: tile sizes per head dim,
// thread roles, shared-memory layouts, the wgmma tilings and the TMA types.
//
// A CTA owns kBlockN keys of one kv head and walks the query tiles (kBlockM
// rows) of every query head of the GQA group. One producer warpgroup (one
// thread issues every load) and two consumer warpgroups. Scores are computed
// transposed, keys as the wgmma's M: S^T = K Q^T, dP^T = V dO^T. Two ways to
// share the work between the consumers:
// - by keys (head dims up to 128): each warpgroup owns 64 of the 128 keys, and
//   dV += P^T dO, dK += dS^T Q take P^T and dS^T straight from its registers;
//   dS goes through shared memory once, for dQ = dS K, which the warpgroups
//   split by rows or head-dim columns.
// - by head dim (kSplitDim; 192 and 256, whose dK and dV of 64 keys would not
//   fit one warpgroup's registers): both own the tile's 64 keys, each computes
//   the scores of half the queries and writes P^T and dS^T to shared memory,
//   then dK, dV and dQ for its half of the head dim from there; dQ is added
//   into the float32 accumulator with 16-byte atomics (no staging buffer fits
//   beside two stages of Q and dO at E = 256).
#pragma once

#include <type_traits>

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

// The step a stage carries, written by the producer when the kernel reads a
// mask (it alone walks the tile kinds); m_block < 0: the key tile's end.
struct StepNote {
  int m_block, head_q, predicate;
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kSplitDim_ = false>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;

  static constexpr bool kSplitDim = kSplitDim_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  static_assert(kBlockN == (kSplitDim ? 64 : 128) && kBlockM % 64 == 0 && kBlockM <= 128);
  static_assert(!kSplitDim || kBlockM == 64, "P^T and dS^T layouts below assume 64 queries");
  // Per consumer warpgroup: the queries of its S^T and dP^T (the wgmma's N),
  // the first of its keys, and the head-dim columns of its dK and dV.
  static constexpr int kSdPQueries = kSplitDim ? kBlockM / 2 : kBlockM;
  static constexpr int kDkvCols = kSplitDim ? kHeadDim / 2 : kHeadDim;
  CUTE_HOST_DEVICE static constexpr int key0(int w) { return kSplitDim ? 0 : 64 * w; }
  CUTE_HOST_DEVICE static constexpr int dkv_col0(int w) { return kSplitDim ? w * kDkvCols : 0; }
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * kConsumerThreads <=
                    65536 / kThreads / 8 * 8 * kThreads,
                "register split exceeds the launch allocation");

  // Whole atoms per warpgroup slice of the head dim (E = 192: 64-byte atoms).
  using SmemAtom = decltype(k_major_smem_atom<Element, kDkvCols>());
  static constexpr int kAtomCols = decltype(size<1>(SmemAtom{}))::value;  // head-dim columns of one swizzle atom

  // dQ's tile (kBlockM x E) is split between the two consumer warpgroups:
  // along the query rows when there are 64 per warpgroup, else along the head
  // dim in slices of whole swizzle atoms (wgmma reads an MN-major B in whole
  // atoms), the first warpgroup taking the larger slice (E = 96: 64 + 32).
  static constexpr bool kDqSplitRows = !kSplitDim && kBlockM == 64 * kConsumerWarpgroups;
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
  // Where value j of thread t of a warpgroup's dQ slice lives in the query
  // tile's accumulator, from the slice's kOffset: threads interleaved, in runs
  // of kDqVec values (one 16-byte store, load or atomic add each).
  static constexpr int kDqVec = 4;
  CUTE_HOST_DEVICE static constexpr int dq_index(int j, int t) { return (j / kDqVec * 128 + t) * kDqVec + j % kDqVec; }

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
  // dS, (query, key), queries contiguous: the consumers write dS^T by
  // stmatrix, 8 neighbouring queries of a key at a time; dQ reads it as an
  // MN-major A.
  using SmemLayoutdS =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  // The same bytes as (key, query), for the consumers' writes.
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));
  // Split-dim: P^T and dS^T in two buffers (key, query, buffer), dS also as
  // (query, key, buffer): with 64 queries the K-major tiling of (key, query)
  // maps every pair to the same element as the MN-major tiling of (query,
  // key) does (64-element rows of 128-byte swizzle atoms, 8 keys per atom),
  // and wgmma wants each operand in a canonical layout. A step writes buffer
  // step % 2, which the products of two steps back read: both warpgroups have
  // waited for those before the barrier of the step between, so one barrier
  // per step suffices.
  static constexpr int kPdSBuffers = kSplitDim ? 2 : 1;
  using SmemLayoutPdStBuf = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                   Shape<Int<kBlockN>, Int<kBlockM>, Int<kPdSBuffers>>{}));
  using SmemLayoutdSBuf = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                                 Shape<Int<kBlockM>, Int<kBlockN>, Int<kPdSBuffers>>{}));

  // Each warpgroup runs its own single-warpgroup tilings on its slabs.
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kSdPQueries>, Int<kHeadDim>>>()));
  using MmadKVShape = Shape<_64, Int<kDkvCols>, Int<kBlockM>>;
  using MmadKV = decltype(make_tiled_mma(std::conditional_t<
      kSplitDim, decltype(GMMA::ss_op_selector<Element, Element, float, MmadKVShape, GMMA::Major::K, GMMA::Major::MN>()),
      decltype(GMMA::rs_op_selector<Element, Element, float, MmadKVShape, GMMA::Major::K, GMMA::Major::MN>())>{}));
  // Each product one wgmma wide (split into narrower ones it runs at a fraction of
  // the rate; CuTe names some widths only under registry.py's wide_mma).
  static_assert(size<1>(typename MmaSdP::AtomShape_MNK{}) == kSdPQueries &&
                    size<1>(typename MmadKV::AtomShape_MNK{}) == kDkvCols,
                "a product is split into narrower wgmmas: list this (pass, head dim) in src/registry.py's wide_mma");

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
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdSBuf>> ds;
    alignas(1024) cute::array_aligned<Element, kSplitDim ? cosize_v<SmemLayoutdSBuf> : 1> p;  // P^T, split-dim only
    alignas(128) cute::array_aligned<float, kSplitDim ? 1 : kDqElems> dq;                 // dQ staged for the reduction
    alignas(16) float lse[kStages][kBlockM];   // lse * log2(e) of the stage's rows (lands with Q)
    alignas(16) float dsum[kStages][kBlockM];  // rowsum(dO * O) (lands with dO)
    StepNote notes[kStages];                   // a mask in memory: the stage's step (mainloop_bwd.h)
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

// Tile sizes per head dim. dK and dV of a warpgroup stay in registers
// (kDkvCols / 2 floats each per thread), with S^T and dP^T (kSdPQueries / 2).
template <typename Element, int kHeadDim>
struct BwdConfig;
template <typename Element>
struct BwdConfig<Element, 64> {
  using Traits = BwdTraits<Element, 64, 128, 128, 2>;
};
// Head dim 80 takes 128 queries (dQ split by rows): at 64 its columns would
// split 48 + 32, and a slice must start at a multiple of its width.
template <typename Element>
struct BwdConfig<Element, 80> {
  using Traits = BwdTraits<Element, 80, 128, 128, 2>;
};
template <typename Element>
struct BwdConfig<Element, 96> {
  using Traits = BwdTraits<Element, 96, 64, 128, 2>;
};
template <typename Element>
struct BwdConfig<Element, 128> {
  using Traits = BwdTraits<Element, 128, 64, 128, 2>;
};
template <typename Element>
struct BwdConfig<Element, 192> {
  using Traits = BwdTraits<Element, 192, 64, 64, 2, true>;
};
template <typename Element>
struct BwdConfig<Element, 256> {
  using Traits = BwdTraits<Element, 256, 64, 64, 2, true>;
};

}  // namespace sm90
}  // namespace tfb
