// End of a backward key tile: each consumer warpgroup writes its share of dK
// (times the softmax scale) and dV, 64 keys by kDkvCols columns, from
// registers to global memory, a converted column pair per 32-bit store, rows
// past the end of the keys left out. Once per key tile, after a walk over every query tile: its cost is
// small beside the walk, so it takes no shared memory and no TMA.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "sm90/kernel_traits_bwd.h"
#include "sm90/utils.h"

namespace tfb {
namespace sm90 {

// out[row][col] = acc * factor in 16 bits for each accumulator value whose
// (row, col) in coord has row < rows and col < cols (the tensor's head dim:
// a smaller one's padded columns are not written); out has row_stride
// elements between rows. Values 2i and 2i + 1 of an accumulator are one row's
// neighbouring columns (cols is even), so each pair is one 32-bit store.
template <typename Element, class Acc, class Coord>
CUTE_DEVICE void store_pairs(Acc const& acc, Coord const& coord, float factor, Element* out, int64_t row_stride,
                             int rows, int cols) {
  static_assert(decltype(size(acc))::value % 2 == 0);
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int j = 0; j < size(acc); j += 2) {
    const int row = get<0>(coord(j)), col = get<1>(coord(j));
    if (row < rows && col < cols) {
      cutlass::Array<float, 2> pair;
      pair[0] = acc(j) * factor;
      pair[1] = acc(j + 1) * factor;
      const cutlass::Array<Element, 2> converted = convert(pair);
      *reinterpret_cast<uint32_t*>(out + row * row_stride + col) = reinterpret_cast<uint32_t const&>(converted);
    }
  }
}

template <class Traits>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  // rows: keys of this warpgroup's 64 that exist (may be <= 0); cols: the
  // tensor's columns from out's on; out points at its first key and first
  // head-dim column.
  template <class Acc>
  CUTE_DEVICE static void store(Acc const& acc, float factor, Element* out, int64_t row_stride, int rows, int cols,
                                int wg_thread) {
    typename Traits::MmadKV mma;
    Tensor coord = mma.get_thread_slice(wg_thread).partition_C(make_identity_tensor(Shape<_64, Int<Traits::kDkvCols>>{}));
    store_pairs(acc, coord, factor, out, row_stride, rows, cols);
  }
};

}  // namespace sm90
}  // namespace tfb
