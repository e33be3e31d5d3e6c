// Tile shapes, warp layouts and shared-memory layouts of the sm80 backward.
//
// One CTA owns kBlockN keys and walks over query blocks of kBlockM rows. Three
// GEMM shapes run per step, each with its own warp arrangement:
//   S, dP    (kBlockM x kBlockN): Q K^T and dO V^T
//   dK, dV   (kBlockN x kHeadDim): dS^T Q and P^T dO, accumulated over the walk
//   dQ       (kBlockM x kHeadDim): dS K, added into a float32 workspace
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>  // first: the atom headers below assume it
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>

namespace tfb::sm80::bwd {

using namespace cute;

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsMSdP, int kWarpsNdKV,
          int kWarpsMdQ, int kStagesQ_, int kStagesdO_>
struct BwdTraits {
  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>);

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  // Q and dO are double-buffered when shared memory allows: the next query
  // block then loads during the whole current step instead of part of it.
  static constexpr int kStagesQ = kStagesQ_;
  static constexpr int kStagesdO = kStagesdO_;
  static_assert(kStagesQ >= 1 && kStagesQ <= 2 && kStagesdO >= 1 && kStagesdO <= 2);
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;

  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                   SM80_16x8x16_F32BF16BF16F32_TN>;

  // kWarpsM warps along the GEMM's M, the rest along N. Each warp covers 16
  // columns of N (two 16x8 atoms), so B tiles load with one ldmatrix.x4.
  template <int kWarpsM>
  using TiledMmaOf = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kWarpsM>, Int<kWarps / kWarpsM>, _1>>,
                              Tile<Int<16 * kWarpsM>, Int<16 * (kWarps / kWarpsM)>, _16>>;
  // S and dP: a warp's two atoms along N are neighbours (columns 16 w to
  // 16 w + 15), as dropout's cells want them (common/dropout.h).
  static constexpr int kWarpsNSdP = kWarps / kWarpsMSdP;
  using TiledMmaSdP = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kWarpsMSdP>, Int<kWarpsNSdP>, _1>>,
                               Tile<Int<16 * kWarpsMSdP>, Layout<Shape<_8, Int<kWarpsNSdP>, _2>, Stride<_1, _16, _8>>,
                                    _16>>;
  using TiledMmadKV = TiledMmaOf<kWarpsNdKV>;
  using TiledMmadQ = TiledMmaOf<kWarpsMdQ>;
  static_assert(kBlockM % (16 * kWarpsMSdP) == 0 && kBlockN % (16 * (kWarps / kWarpsMSdP)) == 0);
  static_assert(kBlockN % (16 * kWarpsNdKV) == 0 && kHeadDim % (16 * (kWarps / kWarpsNdKV)) == 0);
  static_assert(kBlockM % (16 * kWarpsMdQ) == 0 && kHeadDim % (16 * (kWarps / kWarpsMdQ)) == 0);

  // Shared rows are swizzled in 16-byte chunks so that ldmatrix (8 rows of 16
  // bytes, plain or transposed) and the 16-byte cp.async stores hit distinct banks.
  static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
  using SmemAtom = decltype(composition(Swizzle<kSmemRowElems == 64 ? 3 : 2, 3, 3>{},
                                        Layout<Shape<_8, Int<kSmemRowElems>>, Stride<Int<kSmemRowElems>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Transposed views for the GEMMs that contract over rows (dV, dK, dQ).
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKVt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));

  static_assert(kBlockN % 64 == 0);
  using SmemAtomP = decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  using SmemLayoutP = decltype(tile_to_shape(SmemAtomP{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPt = decltype(composition(SmemLayoutP{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));

  using LoadN = Copy_Atom<SM75_U32x4_LDSM_N, Element>;  // operand rows contiguous in K
  using LoadT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;  // operand is a transposed view
  using StoreFrag = Copy_Atom<UniversalCopy<uint32_t>, Element>;  // accumulator pairs to smem

  // Global <-> shared: each thread moves 16 bytes; a row is read by
  // kSmemRowElems / 8 neighbouring threads.
  static constexpr int kGmemThreadsPerRow = kSmemRowElems / 8;
  using GmemThreads = Layout<Shape<Int<kThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                             Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemLoad = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{},
                                            GmemThreads{}, Layout<Shape<_1, _8>>{}));
  using GmemStore = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreads{},
                                             Layout<Shape<_1, _8>>{}));
  static_assert(kBlockM % (kThreads / kGmemThreadsPerRow) == 0 && kBlockN % (kThreads / kGmemThreadsPerRow) == 0);

  // Shared memory, in elements, in this order.
  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kKVElems = kBlockN * kHeadDim;
  static constexpr int kPElems = kBlockM * kBlockN;
  static constexpr int kOffQ = 0;
  static constexpr int kOffdO = kOffQ + kStagesQ * kQElems;
  static constexpr int kOffK = kOffdO + kStagesdO * kQElems;
  static constexpr int kOffV = kOffK + kKVElems;
  static constexpr int kOffP = kOffV + kKVElems;
  static constexpr int kOffdS = kOffP + kPElems;
  static constexpr int kSmemBytes = (kOffdS + kPElems) * int(sizeof(Element));

  // A query block's slice of the dQ accumulator is laid out in the order of
  // the dQ MMA fragments: value i of thread t sits at i * kThreads + t, so each
  // warp's atomics cover 128 contiguous bytes. The convert kernel reads it back
  // through the same fragments.
};

// Tile choice per head dim (8 warps each): dK and dV for kBlockN keys stay in
// registers, so the larger the head dim the fewer keys per CTA. Splitting the
// S/dP tile over more warps along M leaves each thread fewer rows, hence fewer
// registers for lse and D. Traits needs the shared memory of an H100 (up to
// 227 KB a block); SmallSmem fits an A100 (163 KB) and smaller parts.
template <typename Element, int kHeadDim>
struct BwdConfig;
template <typename E> struct BwdConfig<E, 32> {
  using Traits = BwdTraits<E, 32, 128, 128, 4, 4, 4, 2, 2>;  // 112 KB
  using SmallSmem = Traits;
};
template <typename E> struct BwdConfig<E, 64> {
  using Traits = BwdTraits<E, 64, 128, 128, 4, 4, 4, 2, 2>;  // 160 KB
  using SmallSmem = Traits;
};
template <typename E> struct BwdConfig<E, 96> {
  using Traits = BwdTraits<E, 96, 64, 128, 2, 4, 4, 2, 2>;  // 128 KB
  using SmallSmem = Traits;
};
template <typename E> struct BwdConfig<E, 128> {
  using Traits = BwdTraits<E, 128, 64, 128, 2, 4, 2, 2, 2>;  // 160 KB
  using SmallSmem = Traits;
};
template <typename E> struct BwdConfig<E, 192> {
  using Traits = BwdTraits<E, 192, 64, 64, 4, 2, 2, 2, 2>;  // 160 KB
  using SmallSmem = Traits;
};
template <typename E> struct BwdConfig<E, 256> {
  using Traits = BwdTraits<E, 256, 64, 64, 4, 2, 2, 2, 1>;  // 176 KB
  using SmallSmem = BwdTraits<E, 256, 64, 64, 4, 2, 2, 1, 1>;  // 144 KB
};

}  // namespace tfb::sm80::bwd
