// Device primitives of the sm80 backward: shared-memory GEMMs fed by
// ldmatrix, predicated row copies, and accumulator views and conversions.
#pragma once

#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace tfb::sm80::bwd {

using namespace cute;

// acc += A * B^T, A (M, K) and B (N, K) both in shared memory. The ldmatrix
// loads of k-slice k+1 are issued before the MMAs of slice k so that they
// overlap; the register fragments are built from shapes, never from the
// (swizzled, possibly transposed) shared layouts.
template <class CopyA, class CopyB, class TiledMma, class Acc, class SA, class SB>
CUTE_DEVICE void gemm_ss(Acc& acc, TiledMma const& mma, SA const& sA, SB const& sB, int tid) {
  using ElemA = typename SA::value_type;
  using ElemB = typename SB::value_type;
  Tensor fA = make_tensor<ElemA>(partition_shape_A(mma, shape(sA)));
  Tensor fB = make_tensor<ElemB>(partition_shape_B(mma, shape(sB)));

  auto copy_a = make_tiled_copy_A(CopyA{}, mma);
  auto copy_b = make_tiled_copy_B(CopyB{}, mma);
  auto thr_a = copy_a.get_thread_slice(tid);
  auto thr_b = copy_b.get_thread_slice(tid);
  Tensor src_a = thr_a.partition_S(sA);
  Tensor dst_a = thr_a.retile_D(fA);
  Tensor src_b = thr_b.partition_S(sB);
  Tensor dst_b = thr_b.retile_D(fB);
  CUTE_STATIC_ASSERT_V(size<1>(src_a) == size<1>(dst_a));
  CUTE_STATIC_ASSERT_V(size<1>(src_b) == size<1>(dst_b));

  constexpr int kSteps = decltype(size<2>(fA))::value;
  copy(copy_a, src_a(_, _, 0), dst_a(_, _, 0));
  copy(copy_b, src_b(_, _, 0), dst_b(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSteps; ++k) {
    if (k + 1 < kSteps) {
      copy(copy_a, src_a(_, _, k + 1), dst_a(_, _, k + 1));
      copy(copy_b, src_b(_, _, k + 1), dst_b(_, _, k + 1));
    }
    gemm(mma, fA(_, _, k), fB(_, _, k), acc);
  }
}

// The SM80 accumulator fragment is ((2 cols, 2 rows), MMA_M, MMA_N); this view
// regroups it as (rows, cols) so per-row statistics index it directly.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto rowcol(Layout const& l) {
  static_assert(decltype(rank(l))::value == 3);
  static_assert(decltype(size<0>(l))::value == 4);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

template <class T>
CUTE_HOST_DEVICE constexpr auto rowcol_view(T&& t) {
  return make_tensor(t.data(), rowcol(t.layout()));
}

// Register fragment of float accumulators -> same-shaped fragment of To, with
// paired conversions (cvt.rn.f16x2 / bf16x2).
template <class To, class Frag>
CUTE_DEVICE auto convert_frag(Frag const& f) {
  using From = typename Frag::value_type;
  constexpr int N = decltype(size(f))::value;
  static_assert(N % 2 == 0);
  Tensor out = make_tensor<To>(shape(f));
  cutlass::NumericArrayConverter<To, From, 2> conv;
  CUTE_UNROLL
  for (int i = 0; i < N; i += 2) {
    cutlass::Array<From, 2> in;
    in[0] = f(i);
    in[1] = f(i + 1);
    cutlass::Array<To, 2> res = conv(in);
    out(i) = res[0];
    out(i + 1) = res[1];
  }
  return out;
}

// Copies a thread's partition of a (rows, cols) tile, keeping only rows below
// rows_valid. With a zero-fill cp.async atom the other rows become zeros in
// shared memory without touching global memory.
template <class ZfillCopy, class Src, class Dst, class Coord>
CUTE_DEVICE void copy_rows_zfill(ZfillCopy const& tc, Src const& src, Dst&& dst, Coord const& coord, int rows_valid) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool ok = get<0>(coord(0, m, 0)) < rows_valid;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) copy(tc.with(ok), src(_, m, k), dst(_, m, k));
  }
}

template <class TiledCopy, class Src, class Dst, class Coord>
CUTE_DEVICE void copy_rows_if(TiledCopy const& tc, Src const& src, Dst&& dst, Coord const& coord, int rows_valid) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < rows_valid) copy(tc, src(_, m, _), dst(_, m, _));
  }
}

// Shared (rows, cols) tile -> global tile, rows below rows_valid only, through
// registers in 16-byte vectors per thread.
template <class TiledCopy, class Smem, class Gmem>
CUTE_DEVICE void store_tile(Smem const& s, Gmem&& g, int rows_valid, int tid) {
  TiledCopy tc;
  auto thr = tc.get_thread_slice(tid);
  Tensor src = thr.partition_S(s);
  Tensor reg = make_tensor<typename Smem::value_type>(shape(src));
  copy(tc, src, reg);
  Tensor coord = thr.partition_D(make_identity_tensor(shape(g)));
  copy_rows_if(tc, reg, thr.partition_D(g), coord, rows_valid);
}

}  // namespace tfb::sm80::bwd
