// The element predicate of a mask policy (common/mask.h) on a tile of scores
// held in MMA accumulator registers: hidden scores become -inf.
//
// acc is an accumulator fragment of the tile, coord the same partition of an
// identity tensor over the tile (each element's (row, col) within it); m0 / n0
// are the tile's first row / key.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/mask.h"

namespace tfb {
namespace mask {

// Two spellings of one rule, because the compiler treats them differently,
// measured: the sm80 forward runs this one 1-3% faster (by_row_limit 3-10%
// slower, unmasked tiles included); in the sm90 forward this one makes the
// head dim 256 kernel spill 200 bytes (36 with by_row_limit; the benchmark's
// head dim 256 rows fell 10-20%).
template <class Policy, class Acc, class Coord>
CUTE_DEVICE void apply(Policy const& band, Acc& acc, Coord const& coord, int m0, int n0) {
  static_assert(decltype(cute::size(acc))::value == decltype(cute::size(coord))::value);
  const int col_limit = band.len_k - n0;
#pragma unroll
  for (int i = 0; i < cute::size(acc); ++i) {
    const int row = m0 + cute::get<0>(coord(i));
    const int col = cute::get<1>(coord(i));
    // The band's edges are read here, in the loop, on purpose: read once
    // above it, they let ptxas predicate this whole pass into every tile of
    // the sm80 forward (its head dim 64 rows 18% slower).
    bool hidden = col >= col_limit || (band.right_bounded() && n0 + col >= row + band.hi);
    if constexpr (Policy::kHasLeft) hidden = hidden || n0 + col < row + band.lo;
    // A select: written as `if (hidden) acc(i) = -inf`, the sm90 forward got
    // a branch per score, which cost more than the tile's softmax.
    acc(i) = hidden ? -INFINITY : acc(i);
  }
}

template <class Policy, class Acc, class Coord>
CUTE_DEVICE void apply_by_row_limit(Policy const& band, Acc& acc, Coord const& coord, int m0, int n0) {
  static_assert(decltype(cute::size(acc))::value == decltype(cute::size(coord))::value);
  const int col_limit = band.len_k - n0;
  const bool right = band.right_bounded();
  const int hi = band.hi - n0;
  const int lo = band.lo - n0;
#pragma unroll
  for (int i = 0; i < cute::size(acc); ++i) {
    const int row = m0 + cute::get<0>(coord(i));
    const int col = cute::get<1>(coord(i));
    const int limit = right ? min(col_limit, row + hi) : col_limit;
    bool keep = col < limit;
    if constexpr (Policy::kHasLeft) keep = keep && col >= row + lo;
    acc(i) = keep ? acc(i) : -INFINITY;
  }
}

// A mask in memory: each score of the tile reads its byte. Rows past len_q
// and keys past len_k are hidden without a read.
template <class Acc, class Coord>
CUTE_DEVICE void apply(FromMemory const& m, Acc& acc, Coord const& coord, int m0, int n0) {
  static_assert(decltype(cute::size(acc))::value == decltype(cute::size(coord))::value);
  const int row_limit = m.len_q - m0, col_limit = m.len_k - n0;
  const uint8_t* tile = m.values + m0 * m.row_stride + n0 * m.col_stride;
#pragma unroll
  for (int i = 0; i < cute::size(acc); ++i) {
    const int row = cute::get<0>(coord(i));
    const int col = cute::get<1>(coord(i));
    const bool keep = row < row_limit && col < col_limit && tile[row * m.row_stride + col * m.col_stride] != 0;
    acc(i) = keep ? acc(i) : -INFINITY;
  }
}

}  // namespace mask
}  // namespace tfb
