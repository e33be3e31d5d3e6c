// Device primitives of the sm80 backward: a shared-memory GEMM that builds its
// own register fragments, and a staged tile store. Views, conversions and
// predicated copies are the forward's (sm80/utils.h, common/fragment.h).
#pragma once

#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include "sm80/utils.h"

namespace tfb::sm80::bwd {

using namespace cute;

// acc += A * B^T, A (M, K) and B (N, K) both in shared memory (unlike the
// forward's gemm_ss, which is handed register fragments). The ldmatrix
// loads of k-slice k+1 are issued before the MMAs of slice k so that they
// overlap; the register fragments are built from shapes, never from the
// (swizzled, possibly transposed) shared layouts.
template <class CopyA, class CopyB, class TiledMma, class Acc, class SA, class SB>
CUTE_DEVICE void gemm_ss_tile(Acc& acc, TiledMma const& mma, SA const& sA, SB const& sB, int tid) {
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

// Shared (rows, cols) tile -> global tile, rows below rows_valid and columns
// below cols (the tensor's head dim) only, through registers in 16-byte
// vectors per thread.
template <class TiledCopy, class Smem, class Gmem>
CUTE_DEVICE void store_tile(Smem const& s, Gmem&& g, int rows_valid, int cols, int tid) {
  TiledCopy tc;
  auto thr = tc.get_thread_slice(tid);
  Tensor src = thr.partition_S(s);
  Tensor reg = make_tensor<typename Smem::value_type>(shape(src));
  copy(tc, src, reg);
  Tensor coord = thr.partition_D(make_identity_tensor(shape(g)));
  copy_rows_guarded(tc, reg, thr.partition_D(g), coord, rows_valid, cols);
}

}  // namespace tfb::sm80::bwd
