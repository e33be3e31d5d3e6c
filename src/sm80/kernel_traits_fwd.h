// Tile shapes, shared-memory layouts, the tiled MMA and the copy atoms of the
// sm80 forward kernel, and the tile choice per head dim.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "sm80/utils.h"

namespace tfb {
namespace sm80 {

template <typename Element>
using Sm80MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                       SM80_16x8x16_F32BF16BF16F32_TN>;

// A (rows x head dim) tile in shared memory is built from 8-row atoms that are
// 64 (or 32) elements wide. The XOR swizzle moves each 16-byte chunk of a row
// to a different bank group, so both an ldmatrix (8 rows, same column) and a
// transposing ldmatrix on V read 8 distinct bank groups.
template <typename Element, int kHeadDim>
struct SmemTile {
  static constexpr int kAtomCols = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kAtomCols == 64 ? 3 : 2;
  using Atom = decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                                    Layout<Shape<_8, Int<kAtomCols>>, Stride<Int<kAtomCols>, _1>>{}));
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per CTA
  static constexpr int kBlockN = kBlockN_;  // key rows per mainloop step
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  // K/V buffers: 2 lets the next tile's loads overlap a whole step; 1 loads V
  // during Q.K^T and the next K during softmax and P.V.
  static constexpr int kStages = kStages_;
  static_assert(kStages == 1 || kStages == 2);
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0);
  static_assert(kBlockM % (16 * kWarps) == 0, "each warp owns whole 16-row MMA atoms");

  // Warps split the rows; every warp sees the whole key tile, so row
  // statistics never leave a quad. The 16-wide N tile lets one ldmatrix.x4
  // feed two n-atoms of B.
  using TiledMma = TiledMMA<MMA_Atom<Sm80MmaAtom<Element>>, Layout<Shape<Int<kWarps>, _1, _1>>,
                            Tile<Int<16 * kWarps>, _16, _16>>;
  static constexpr int kRowsPerThread = 2 * kBlockM / (16 * kWarps);

  using SmemAtom = typename SmemTile<Element, kHeadDim>::Atom;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // One K (or V) tile; kStages of them lie back to back. Tiles are multiples of
  // the swizzle period, so a stage's buffer is its base pointer plus the same layout.
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V read as the B operand of P.V: (head dim, keys) over the same bytes.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  using SmemLayoutVtPlain = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;  // O is staged through Q's buffer

  static constexpr int kTileKV = cosize_v<SmemLayoutKV>;  // elements of one stage
  static constexpr int kSmemQ = cosize_v<SmemLayoutQ> * sizeof(Element);
  static constexpr int kSmemKV = kStages * kTileKV * sizeof(Element);
  static constexpr int kSmemBytes = kSmemQ + 2 * kSmemKV;

  using SmemCopyQK = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyVt = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global <-> shared: each thread moves 16-byte vectors along a row; a row of
  // a swizzle atom is covered by kThreadsPerRow threads.
  static constexpr int kVecElems = 16 / sizeof(Element);
  static constexpr int kThreadsPerRow = SmemTile<Element, kHeadDim>::kAtomCols / kVecElems;
  static_assert(kThreads % kThreadsPerRow == 0);
  using GmemThreads = Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using GmemVec = Layout<Shape<_1, Int<kVecElems>>>;
  using GmemLoad = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{},
                                            GmemThreads{}, GmemVec{}));
  using GmemStore = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreads{}, GmemVec{}));
  static_assert(kBlockN % (kThreads / kThreadsPerRow) == 0 && kBlockM % (kThreads / kThreadsPerRow) == 0);
};

// Tile choice per head dim (measured on H200, bf16, L = 1K and 4K, against
// PyTorch's flash backend). Each fits the 99 KB an sm86/sm89 block may use,
// so one choice serves the whole family.
// - 32, 64: 128 x 64, 2 stages; for 64 it beat 128 x 128 (which spills, with
//   1 or 2 stages) and 64 x 128 by 5-15%.
// - 96, 128: 128 x 64, 2 stages; 1 stage was ~10% slower, 64 x 64 up to 17%.
// - 192: 8 warps over 128 x 64, 1 stage (96 KB): two CTAs per A100/H100 SM.
// - 256: 64 x 64, 1 stage (96 KB), two CTAs per SM; 2 stages (one CTA),
//   8 warps over 128 x 64, and 64 x 32 with 2 stages were 3-15% slower.
template <typename Element, int kHeadDim>
struct FwdConfig;
template <typename Element>
struct FwdConfig<Element, 32> { using Traits = FwdTraits<Element, 32, 128, 64, 4, 2>; };
template <typename Element>
struct FwdConfig<Element, 64> { using Traits = FwdTraits<Element, 64, 128, 64, 4, 2>; };
template <typename Element>
struct FwdConfig<Element, 96> { using Traits = FwdTraits<Element, 96, 128, 64, 4, 2>; };
template <typename Element>
struct FwdConfig<Element, 128> { using Traits = FwdTraits<Element, 128, 128, 64, 4, 2>; };
template <typename Element>
struct FwdConfig<Element, 192> { using Traits = FwdTraits<Element, 192, 128, 64, 8, 1>; };
template <typename Element>
struct FwdConfig<Element, 256> { using Traits = FwdTraits<Element, 256, 64, 64, 4, 1>; };

}  // namespace sm80
}  // namespace tfb
