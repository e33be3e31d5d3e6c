// Device primitives of the sm80 forward: register-layout views of mma.sync
// fragments, shared-memory staged GEMMs and predicated global<->shared copies.
// What every family uses (row reductions, exp2, conversions) is in
// common/fragment.h.
//
// Fragment conventions (SM80 m16n8k16 MMA): an accumulator fragment has shape
// (4, MMA_M, MMA_N). Lane l of a warp holds rows l/4 and l/4 + 8 and columns
// 2*(l%4) and 2*(l%4)+1 of each 16x8 atom, so the four lanes of a quad own the
// same rows and a row reduction needs two xor-shuffles.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/fragment.h"

namespace tfb {
namespace sm80 {

// The kernels are written in CuTe's vocabulary; pulling it in here keeps
// their bodies readable (Int<>, _, make_tensor, ...).
using namespace cute;

// ---------------------------------------------------------------------------
// Fragment layouts

// View an accumulator layout (4, MMA_M, MMA_N) as (rows, cols) =
// ((2, MMA_M), (2, MMA_N)), so that row statistics can be indexed by row.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout const& acc) {
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(size<0>(acc))::value == 4);
  auto split = logical_divide(acc, Shape<_2>{});  // ((col, row), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(split), get<1>(split)),
                     make_layout(get<0, 0>(split), get<2>(split)));
}

// A view: acc is a register fragment (an lvalue) or a coordinate tensor.
template <class Acc>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Acc&& acc) {
  return make_tensor(acc.data(), acc_rowcol_layout(acc.layout()));
}

// The accumulator of an m16n8 MMA holds exactly the values an m16n8k16 A
// operand wants from two neighbouring n-atoms, so P = softmax(S) can feed the
// next GEMM straight from registers: (4, MMA_M, MMA_N) -> ((4, 2), MMA_M, MMA_N / 2).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a_operand_layout(Layout const& acc) {
  static_assert(decltype(size<0>(acc))::value == 4);
  static_assert(decltype(size<2>(acc))::value % 2 == 0);
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, MMA_N / 2))
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
}

// ---------------------------------------------------------------------------
// GEMMs on one tile

// acc += A * B^T with both operands in shared memory. Each k-slice is loaded
// into registers (ldmatrix) one step ahead of the MMAs that use it.
// ra / rb are the MMA's register fragments, ra_view / rb_view the same
// registers retiled for the shared-memory copies, sa / sb those copies' sources.
template <class TiledMma, class Acc, class RA, class RB, class RAView, class RBView, class SA, class SB,
          class CopyA, class CopyB>
CUTE_DEVICE void gemm_ss(TiledMma const& mma, Acc& acc, RA& ra, RB& rb, RAView&& ra_view, RBView&& rb_view,
                         SA const& sa, SB const& sb, CopyA const& copy_a, CopyB const& copy_b) {
  constexpr int kSteps = decltype(size<2>(ra))::value;
  static_assert(decltype(size<2>(rb))::value == kSteps);
  copy(copy_a, sa(_, _, 0), ra_view(_, _, 0));
  copy(copy_b, sb(_, _, 0), rb_view(_, _, 0));
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    if (k + 1 < kSteps) {
      copy(copy_a, sa(_, _, k + 1), ra_view(_, _, k + 1));
      copy(copy_b, sb(_, _, k + 1), rb_view(_, _, k + 1));
    }
    gemm(mma, ra(_, _, k), rb(_, _, k), acc);
  }
}

// acc += A * B^T with A already in registers (e.g. P) and B in shared memory.
// Each B slice is loaded right before its MMAs: when B spans a whole head dim
// (P.V), holding the next slice as well spilled at head dim 256 and gained
// nothing measurable elsewhere; ptxas still overlaps the loads.
template <class TiledMma, class Acc, class RA, class RB, class RBView, class SB, class CopyB>
CUTE_DEVICE void gemm_rs(TiledMma const& mma, Acc& acc, RA const& ra, RB& rb, RBView&& rb_view, SB const& sb,
                         CopyB const& copy_b) {
  constexpr int kSteps = decltype(size<2>(ra))::value;
  static_assert(decltype(size<2>(rb))::value == kSteps);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    copy(copy_b, sb(_, _, k), rb_view(_, _, k));
    gemm(mma, ra(_, _, k), rb(_, _, k), acc);
  }
}

// ---------------------------------------------------------------------------
// Predicated copies between global and shared memory

// Global -> shared with a zero-filling cp.async atom: the thread's partition
// src/dst has shape (CPY, CPY_ROWS, CPY_COLS) and `coord` is the same partition
// of an identity tensor. Rows at or past row_limit and columns at or past
// col_limit (a tensor's head dim below the kernel's: a multiple of the atom's
// 8 columns) are not read; their shared copy becomes zeros, so MMAs over them
// add nothing and never see NaN.
template <class ZfillAtom, class Src, class Dst, class Coord>
CUTE_DEVICE void copy_rows_zfill(ZfillAtom const& atom, Src const& src, Dst&& dst, Coord const& coord,
                                 int row_limit, int col_limit) {
#pragma unroll
  for (int m = 0; m < size<1>(src); ++m) {
    const bool in_range = get<0>(coord(0, m, 0)) < row_limit;
#pragma unroll
    for (int k = 0; k < size<2>(src); ++k) {
      copy(atom.with(in_range && get<1>(coord(0, m, k)) < col_limit), src(_, m, k), dst(_, m, k));
    }
  }
}

// Registers/shared -> global, skipping rows at or past row_limit and columns
// at or past col_limit.
template <class TiledCopy, class Src, class Dst, class Coord>
CUTE_DEVICE void copy_rows_guarded(TiledCopy const& tiled_copy, Src const& src, Dst&& dst, Coord const& coord,
                                   int row_limit, int col_limit) {
#pragma unroll
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < row_limit) {
#pragma unroll
      for (int k = 0; k < size<2>(src); ++k) {
        if (get<1>(coord(0, m, k)) < col_limit) copy(tiled_copy, src(_, m, k), dst(_, m, k));
      }
    }
  }
}

}  // namespace sm80
}  // namespace tfb
