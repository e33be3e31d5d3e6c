// Compile-time configuration of the sm90 forward: tile sizes per head dim,
// thread roles, shared-memory layouts, the two wgmma tilings and the TMA types.
//
// A CTA is one producer warpgroup (one thread issues every TMA load) and
// kBlockM / 64 consumer warpgroups, each owning 64 query rows of the tile.
#pragma once

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "sm90/tile_scheduler.h"

namespace tfb {
namespace sm90 {

using namespace cute;

// The widest swizzle whose atom divides a row of kWidth elements: 128-byte
// rows when the row is a multiple of 128 bytes, else 64-byte (head dim 96).
template <typename Element, int kWidth>
constexpr auto k_major_smem_atom() {
  constexpr int kBytes = kWidth * int(sizeof(Element));
  if constexpr (kBytes % 128 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kBytes % 64 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}

// Element: the inputs' type. With e4m3 inputs (kFp8) O is bfloat16, and V
// goes through a second buffer: FP8 wgmma reads both operands K-major, so
// the producer warpgroup transposes each V tile on chip (transpose_v.h).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kQInRegisters_ = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr bool kFp8 = sizeof(Element) == 1;
  using ElementOut = std::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // Q K^T reads Q from registers (loaded once per query tile) instead of
  // shared memory: a fifth fewer shared-memory operand bytes per key tile.
  static constexpr bool kQInRegisters = kQInRegisters_;
  // Past the first few key tiles a row's max rarely moves: where no row of a
  // warp's moved, every factor is 1 (to an ulp) and O's rescale is skipped.
  // Worth its vote and branch only for head dim 256's 128 registers of O
  // (+3-4% sustained at 16K); at 64-192 it loses 1-3%. FP8 from head dim
  // 128, where the rescale weighs more beside GEMMs at twice the rate.
  static constexpr bool kSkipUnitRescale = kHeadDim >= (kFp8 ? 128 : 256);

  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  static_assert(kBlockM % 64 == 0 && kConsumerWarpgroups <= 3);
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256);
  // The producer needs few registers; the consumers hold S, P and O. Below 40
  // the producer spills its tile walk, which cost up to 8% at head dim 256.
  // FP8's producer warpgroup also transposes V, in few registers (transpose_v.h).
  static constexpr int kProducerRegisters = kConsumerWarpgroups == 2 ? 40 : 32;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? 232 : 160;
  // setmaxnreg only moves registers within what the CTA was launched with (the
  // per-thread count ptxas gives every thread of a one-CTA-per-SM kernel): a
  // larger sum leaves the consumers waiting forever for registers.
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * kConsumerThreads <=
                    65536 / kThreads / 8 * 8 * kThreads,
                "register split exceeds the launch allocation");

  // S = Q K^T: K from shared memory, Q from shared memory or registers; both
  // K-major (head dim contiguous).
  using MmaQKAtom = std::conditional_t<
      kQInRegisters,
      decltype(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>()),
      decltype(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>())>;
  using MmaQK = decltype(make_tiled_mma(MmaQKAtom{}, Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
  // One wgmma must span the whole key tile: split into narrower ones it runs at a
  // fraction of the rate. CuTe names widths such as 80 or 176 only under
  // CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, which the instantiation files of
  // registry.py's wide_mma define.
  static_assert(size<1>(typename MmaQK::AtomShape_MNK{}) == kBlockN,
                "no single wgmma spans kBlockN keys: list this (pass, head dim) in src/registry.py's wide_mma");
  // O += P V: P from registers, V from shared memory read along the key
  // (MN-major: V's rows are contiguous in the head dim); FP8 reads the
  // transposed copy, K-major.
  static constexpr GMMA::Major kMajorV = kFp8 ? GMMA::Major::K : GMMA::Major::MN;
  //
  // FP8 at head dim 64 (kSumsInO): P V also runs over 8 rows of ones below
  // the transposed V, so O's last 8 columns hold each row's sum of P and the
  // softmax adds no score (its consumers are bound by issue slots): +4-9%
  // with 128-key tiles. At head dim 128 it moved nothing beyond noise, and
  // 256 has no wgmma width left (benchmarks/history/2026-11-28-fp8.md, try L).
  static constexpr bool kSumsInO = kFp8 && kHeadDim == 64;
  static constexpr int kPVCols = kHeadDim + (kSumsInO ? 8 : 0);
  template <int kCols>
  using PVAtom = decltype(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kCols>, Int<kBlockN>>,
                                               GMMA::Major::K, kMajorV>());
  using MmaPVAtom = PVAtom<kPVCols>;
  using MmaPV = decltype(make_tiled_mma(MmaPVAtom{}, Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
  // O's first kHeadDim columns as an accumulator of their own (the epilogue's
  // view; the same registers, which come first in the wider one).
  using MmaO = decltype(make_tiled_mma(PVAtom<kHeadDim>{}, Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
  static_assert(!kFp8 || (kBlockN % 32 == 0 && kHeadDim % 32 == 0), "FP8 wgmma steps 32 keys");

  using SmemAtom = decltype(k_major_smem_atom<Element, kHeadDim>());
  // The O tile of the epilogue reuses Q's buffer (same shape).
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKVStage = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V as P.V's B operand, (head dim, key, stage): the same bytes with the
  // first two modes swapped; FP8: its own buffer, keys contiguous, with
  // kSumsInO's rows of ones below the head dim.
  using SmemLayoutVt = std::conditional_t<
      kFp8,
      decltype(tile_to_shape(k_major_smem_atom<Element, kBlockN>(), Shape<Int<kPVCols>, Int<kBlockN>, Int<kStages>>{})),
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                                       Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})))>;
  using SmemLayoutO = decltype(tile_to_shape(k_major_smem_atom<ElementOut, kHeadDim>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  // FP8: transposed V tiles, from the producer warpgroup to the consumers.
  using PipelineVt = cutlass::PipelineAsync<kStages>;

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  // Where O waits for its TMA store. Its own buffer when it fits: then the
  // next tile's Q can land as soon as the last Q K^T of this one is done,
  // while P V and the epilogue still run. Otherwise, 16-bit inputs: Q's
  // buffer, and the next Q waits for the store. FP8 (a bfloat16 O is twice
  // Q's bytes): the transposed V ring's bytes, once every consumer has read
  // the tile's last V, and the producer transposes the next tile's first V
  // once the stores have read them (o_free).
  enum class OPlace { kOwn, kQ, kVt };
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kTileBytes =
      int(sizeof(Element)) * (kBlockM + 2 * kStages * kBlockN) * kHeadDim + (kFp8 ? kStages * kBlockN * kPVCols : 0);
  static constexpr int kOBytes = kBlockM * kHeadDim * int(sizeof(ElementOut));
  static constexpr OPlace kOPlace = kTileBytes + kOBytes + 1024 <= kSmemLimit ? OPlace::kOwn
                                    : kFp8                                    ? OPlace::kVt
                                                                              : OPlace::kQ;
  static constexpr bool kSeparateO = kOPlace != OPlace::kQ;  // Q's buffer is free after the last Q K^T
  static constexpr int kVtElements =
      !kFp8 ? 16 : cute::max(int(cosize_v<SmemLayoutVt>), kOPlace == OPlace::kVt ? kOBytes : 0);

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    alignas(kFp8 ? 1024 : 16) cute::array_aligned<Element, kVtElements> vt;
    alignas(1024) cute::array_aligned<ElementOut, kOPlace == OPlace::kOwn ? cosize_v<SmemLayoutO> : 8> o;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    typename PipelineVt::SharedStorage pipeline_vt;
    int next_pos[2];  // FP8: a dynamic scheduler's next unit, for the whole producer warpgroup
    cutlass::arch::ClusterTransactionBarrier q_full;  // Q landed
    cutlass::arch::ClusterBarrier q_free;             // no one reads Q's buffer any more
    UnitHandoff handoff;                              // a dynamic scheduler's units (tile_scheduler.h)
    cutlass::arch::ClusterBarrier o_free;             // OPlace::kVt: O's stores have read the V ring's bytes
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemLimit, "tile does not fit in an H100's shared memory");

  CUTE_DEVICE static ElementOut* o_buffer(SharedStorage& shared) {
    if constexpr (kOPlace == OPlace::kOwn) {
      return shared.o.data();
    } else if constexpr (kOPlace == OPlace::kVt) {
      return reinterpret_cast<ElementOut*>(shared.vt.data());
    } else {
      return shared.q.data();
    }
  }
  // P V's B operand.
  CUTE_DEVICE static Element* vt_buffer(SharedStorage& shared) { return kFp8 ? shared.vt.data() : shared.v.data(); }

  // Global tensors as the TMA descriptors see them: (row, dim, head, batch).
  using GmemShape = Shape<int, int, int, int>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{},
                                          GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKVStage{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  // Each consumer warpgroup stores its own 64 rows of O from their slab of a
  // Q-shaped buffer: in Q's buffer, the slab holds exactly the Q rows that
  // warpgroup alone reads, so no warpgroup waits for another at a tile's end.
  using SmemLayoutOSlab =
      decltype(composition(SmemLayoutO{}, Layout<Shape<_64, Int<kHeadDim>>, Stride<_1, Int<kBlockM>>>{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{},
                                      make_tensor(make_gmem_ptr(static_cast<ElementOut*>(nullptr)), GmemShape{},
                                                  GmemStride{}),
                                      SmemLayoutOSlab{}, Shape<_64, Int<kHeadDim>>{}, _1{}));
  // P V's tiling for one warpgroup: the stmatrix partition of its slab.
  using MmaPVWarpgroup = decltype(make_tiled_mma(PVAtom<kHeadDim>{}));
};

// Tile sizes per head dim, measured on an H100 and an H200 (benchmarks/history/2026-11-journal.md,
// "sm90"). The two-stage K/V ring plus Q (and O, where it fits) must fit in
// 227 KB. Wider key tiles (176 at head dim 128, 112 at 192) gain a few % at
// 16K keys and lose more at 1-2K, where the last tile is mostly padding. Head
// dim 256 takes 80-key tiles (+1-6% without a mask at every length, +2-3%
// causal from 2K) but 64-key ones for causal calls up to 1K queries (+2-7%).
// Head dim 64 takes three consumer warpgroups (192 query rows): its
// tiles are light in registers and heavy in softmax work per FLOP; but under a
// causal mask 192-row tiles cut the diagonal coarsely (at 1K queries a third
// of the work they do is masked out), and up to 2K queries 128-row tiles win.
//
// Traits serves every call, except causal calls of at most kShortCausalMaxLen
// queries, which ShortCausalTraits serves when it is not void.
template <class Traits_, class ShortCausalTraits_ = void, int kShortCausalMaxLen_ = 0>
struct TileChoice {
  using Traits = Traits_;
  using ShortCausalTraits = ShortCausalTraits_;
  static constexpr int kShortCausalMaxLen = kShortCausalMaxLen_;
};

template <typename Element, int kHeadDim>
struct FwdConfig;

template <typename Element>
struct FwdConfig<Element, 64>
    : TileChoice<FwdTraits<Element, 64, 192, 128, 2>, FwdTraits<Element, 64, 128, 128, 2>, 2048> {};
template <typename Element>
struct FwdConfig<Element, 80> : TileChoice<FwdTraits<Element, 80, 128, 128, 2>> {};
template <typename Element>
struct FwdConfig<Element, 96> : TileChoice<FwdTraits<Element, 96, 128, 128, 2>> {};
// Head dim 128 reads Q from registers (+2% sustained at 16K keys, +1-2% from
// 2K; its 32 registers fit beside S, P and O). Head dim 96 gains nothing, 64
// loses 1-4% (at 192 rows it spills), and 192/256 have no registers for it.
template <typename Element>
struct FwdConfig<Element, 128> : TileChoice<FwdTraits<Element, 128, 128, 128, 2, true>> {};
template <typename Element>
struct FwdConfig<Element, 192> : TileChoice<FwdTraits<Element, 192, 128, 96, 2>> {};
template <typename Element>
struct FwdConfig<Element, 256>
    : TileChoice<FwdTraits<Element, 256, 128, 80, 2>, FwdTraits<Element, 256, 128, 64, 2>, 1024> {};

// e4m3 inputs: key tiles a multiple of FP8 wgmma's 32-key step, and room for
// the transposed V ring and a bfloat16 O (head dim 256: O in the transposed V
// ring's bytes, OPlace::kVt, so that 96-key tiles fit: +6-7% over 64 keys,
// where 128 keys lose 2-4%). Wide
// tiles: at twice the 16-bit wgmma rate, each key tile's fixed work (row max
// and sum, barriers, O's rescale) weighs twice as much. Against 128 x 128 x 3
// (benchmarks/history/2026-11-28-fp8.md, try H): head dim 64 with three
// consumer warpgroups, 192 x 160, +14-35%, then with its row sums in O 192 x
// 128 (no spill; try L); head dim 128, 128 x 224 with Q from shared memory
// (S's 112 registers leave none for Q), +1-9%.
template <>
struct FwdConfig<cutlass::float_e4m3_t, 64> : TileChoice<FwdTraits<cutlass::float_e4m3_t, 64, 192, 128, 2>> {};
template <>
struct FwdConfig<cutlass::float_e4m3_t, 128> : TileChoice<FwdTraits<cutlass::float_e4m3_t, 128, 128, 224, 2>> {};
template <>
struct FwdConfig<cutlass::float_e4m3_t, 256> : TileChoice<FwdTraits<cutlass::float_e4m3_t, 256, 128, 96, 2>> {};

}  // namespace sm90
}  // namespace tfb
