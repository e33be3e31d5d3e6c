// Device primitives of the sm90 family: views of wgmma accumulator fragments,
// the wgmma issue sequence, and named barriers between warpgroups.
//
// Fragment convention (wgmma m64nNk16): a warpgroup's accumulator fragment is
// ((2, 2, N/8), MMA_M, MMA_N) per thread: a column pair, the row and the row
// eight below it, then N/8 column groups. As with mma.sync, the four lanes of a
// quad share rows, so row reductions need two xor-shuffles.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "common/fragment.h"

namespace tfb {
namespace sm90 {

using namespace cute;

// (rows, cols) = ((2, MMA_M), (2, N/8, MMA_N)) view of an accumulator layout.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout const& acc) {
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(rank<0>(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

template <class Engine, class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Tensor<Engine, Layout>& acc) {
  return make_tensor(acc.data(), acc_rowcol_layout(acc.layout()));
}

// Two neighbouring 8-column groups of an accumulator hold exactly the eight
// values a k16 A operand takes from registers, so P feeds the P.V wgmma
// without leaving registers: ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a_operand_layout(Layout const& acc) {
  static_assert(decltype(size<0, 2>(acc))::value % 2 == 0);
  auto split = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(split), get<2>(acc))));
}

// acc (=|+=) A * B on the tensor cores, issued by this warpgroup; waits until
// at most kPending wgmma batches of this warpgroup are still in flight. With
// kPending < 0 it returns at once: the caller waits (warpgroup_wait) and then
// fences acc before reading it.
template <bool kZeroInit, int kPending, class TiledMma, class FragA, class FragB, class Acc>
CUTE_DEVICE void wgmma(TiledMma& mma, FragA const& a, FragB const& b, Acc& acc) {
  constexpr bool kAInRegisters =
      !is_same_v<remove_cvref_t<typename FragA::engine_type::iterator>, GMMA::DescriptorIterator>;
  if constexpr (kAInRegisters) warpgroup_fence_operand(const_cast<FragA&>(a));
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kPending >= 0) {
    warpgroup_wait<kPending>();
    warpgroup_fence_operand(acc);
    if constexpr (kAInRegisters) warpgroup_fence_operand(const_cast<FragA&>(a));
  }
}

// dst = src converted to 16 bits, written 32 bits (one converted pair) at a
// time: assigning a converted fragment element by element makes the compiler
// unpack and repack every pair (~100 integer instructions per key tile).
template <class SrcEngine, class SrcLayout, class DstEngine, class DstLayout>
CUTE_DEVICE void convert_fragment_into(Tensor<SrcEngine, SrcLayout> const& src, Tensor<DstEngine, DstLayout>& dst) {
  using To = typename DstEngine::value_type;
  constexpr int kSize = decltype(size(src))::value;
  static_assert(sizeof(To) == 2 && kSize % 2 == 0 && kSize == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, float, 2> convert;
  auto const* in = reinterpret_cast<cutlass::Array<float, 2> const*>(src.data());
  auto* out = reinterpret_cast<uint32_t*>(dst.data());
  CUTE_UNROLL
  for (int i = 0; i < kSize / 2; ++i) {
    const cutlass::Array<To, 2> pair = convert(in[i]);
    out[i] = reinterpret_cast<uint32_t const&>(pair);
  }
}

// The registers of P for an 8-bit A operand: per 32 keys, ((4, 2, 2), 1, N/32)
// values as the wgmma takes them (4 keys, the row eight below, the next 16 keys).
template <class Element, int kBlockN>
CUTE_DEVICE auto make_fp8_p_fragment() {
  return make_tensor<Element>(Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>>{});
}

// An accumulator's probabilities -> P's e4m3 registers, keys
// in the order transpose_v.h writes V: register (k32, row half r, 16-key half
// h) takes the thread's two column pairs of 8-column groups 4 k32 + 2 h and
// + 1, row r. The softmax leaves them in [0, 256] (kFp8Log2PScale): P keeps
// e4m3's 3 mantissa bits down to 2^-14 instead of going subnormal below 2^-6.
constexpr int kFp8Log2PScale = 8;

template <class SrcEngine, class SrcLayout, class DstEngine, class DstLayout>
CUTE_DEVICE void convert_fp8_p_into(Tensor<SrcEngine, SrcLayout> const& acc, Tensor<DstEngine, DstLayout>& p) {
  using To = typename DstEngine::value_type;
  constexpr int kGroups = decltype(size<0, 2>(acc))::value;  // 8-column groups
  static_assert(sizeof(To) == 1 && kGroups % 4 == 0 && decltype(size(p))::value == 4 * kGroups);
  cutlass::NumericArrayConverter<To, float, 4> convert;
  float const* in = acc.data();
  auto* out = reinterpret_cast<uint32_t*>(p.data());
  CUTE_UNROLL
  for (int k = 0; k < kGroups / 4; ++k) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int g = 4 * k + 2 * h;  // accumulator value (c, r, g) is at c + 2 r + 4 g
        const cutlass::Array<float, 4> four = {in[2 * r + 4 * g], in[1 + 2 * r + 4 * g], in[2 * r + 4 * (g + 1)],
                                               in[1 + 2 * r + 4 * (g + 1)]};
        const cutlass::Array<To, 4> packed = convert(four);
        out[4 * k + r + 2 * h] = reinterpret_cast<uint32_t const&>(packed);
      }
    }
  }
}

// Named barriers (bar.sync / bar.arrive) among a subset of the CTA's warps.
// Id 0 is __syncthreads().
CUTE_DEVICE void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
CUTE_DEVICE void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Zeroes rows [rows, R) of an (R, head dim) tile in shared memory, shared by
// kThreads threads: 16-byte stores (8 elements of a row stay together in every
// swizzled layout). A packed batch's tiles past a sequence's end hold the next
// one's rows, whose inf or NaN a zero probability would still carry into the
// products. Generic-proxy stores: the caller fences (fence_view_async_shared)
// and syncs before a wgmma reads the tile.
template <int kThreads, class Smem>
CUTE_DEVICE void clear_rows_from(Smem&& tile, int rows, int thread_idx) {
  constexpr int kRows = decltype(size<0>(tile))::value;
  constexpr int kPieces = decltype(size<1>(tile))::value / 8;
  rows = rows < 0 ? 0 : rows;
  for (int i = thread_idx; i < (kRows - rows) * kPieces; i += kThreads) {
    *reinterpret_cast<uint4*>(&tile(rows + i / kPieces, (i % kPieces) * 8)) = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace sm90
}  // namespace tfb
