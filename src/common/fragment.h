// Device primitives on register fragments that every family uses: row
// reductions across the lanes that share a row, exp2 with a fused scale, row
// scaling, and 16-bit conversion of accumulators. They take (row, col) views;
// each family makes those views of its own MMA layouts.
//
// Both mma.sync (m16n8k16) and wgmma accumulators give each row to the four
// lanes of a quad, so a full row reduction is a thread-local pass followed by
// lane_allreduce<4>.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace tfb {

struct MaxOp {
  CUTE_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  CUTE_DEVICE float operator()(float a, float b) const { return a + b; }
};

// Reduce over the kLanes consecutive lanes that share a row; every one of them
// gets the result.
template <int kLanes = 4, class Op>
CUTE_DEVICE float lane_allreduce(float x, Op op) {
  static_assert(kLanes == 1 || kLanes == 2 || kLanes == 4 || kLanes == 8 || kLanes == 16 || kLanes == 32);
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// out(r) = op(out(r), rowcol(r, c) over this thread's columns c). Thread-local:
// follow with lane_allreduce for the full row.
template <class Engine, class Layout, class Out, class Op>
CUTE_DEVICE void reduce_rows_local(cute::Tensor<Engine, Layout> const& rowcol, Out& out, Op op) {
  static_assert(decltype(cute::rank(rowcol))::value == 2);
#pragma unroll
  for (int r = 0; r < cute::size<0>(rowcol); ++r) {
#pragma unroll
    for (int c = 0; c < cute::size<1>(rowcol); ++c) out(r) = op(out(r), rowcol(r, c));
  }
}

// x -> 2^(x * scale(r) - bias(r)) per row, the argument one FFMA.
template <class Engine, class Layout, class Bias, class Scale>
CUTE_DEVICE void exp2_rows(cute::Tensor<Engine, Layout>& rowcol, Bias const& bias, Scale const& scale) {
#pragma unroll
  for (int r = 0; r < cute::size<0>(rowcol); ++r) {
#pragma unroll
    for (int c = 0; c < cute::size<1>(rowcol); ++c) rowcol(r, c) = exp2f(rowcol(r, c) * scale(r) - bias(r));
  }
}

template <class Engine, class Layout, class Factor>
CUTE_DEVICE void scale_rows(cute::Tensor<Engine, Layout>& rowcol, Factor const& factor) {
#pragma unroll
  for (int r = 0; r < cute::size<0>(rowcol); ++r) {
#pragma unroll
    for (int c = 0; c < cute::size<1>(rowcol); ++c) rowcol(r, c) *= factor(r);
  }
}

// Copy of a register fragment in another element type, with the converter
// that packs pairs (cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32).
template <typename To, class Engine, class Layout>
CUTE_DEVICE auto convert_fragment(cute::Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int kSize = decltype(cute::size(src))::value;
  cutlass::NumericArrayConverter<To, From, kSize> convert;
  cute::Tensor dst = cute::make_tensor<To>(src.layout());
  *reinterpret_cast<cutlass::Array<To, kSize>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, kSize> const*>(src.data()));
  return dst;
}

}  // namespace tfb
