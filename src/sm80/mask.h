// Which (query row, key column) pairs of a score tile are visible: key columns
// past the sequence end never are, and with is_causal (top-left aligned, as in
// PyTorch SDPA, also when L != S) row i sees only columns j <= i.
//
// The trip counts tell a kernel which tiles to visit at all, so tiles wholly
// above the diagonal are skipped; needs_mask tells it which of the visited
// tiles hold an invisible pair, so the per-element pass runs only there.
#pragma once

#include "sm80/utils.h"

namespace tfb {
namespace sm80 {

template <int kBlockM, int kBlockN>
struct AttnMask {
  int len_q;
  int len_k;
  bool causal;

  CUTE_HOST_DEVICE int num_m_blocks() const { return (len_q + kBlockM - 1) / kBlockM; }
  CUTE_HOST_DEVICE int num_n_blocks() const { return (len_k + kBlockN - 1) / kBlockN; }

  // Key tiles [0, n_block_end) hold every column query tile m_block sees.
  CUTE_HOST_DEVICE int n_block_end(int m_block) const {
    if (!causal) return num_n_blocks();
    const int last_row = min((m_block + 1) * kBlockM, len_q) - 1;
    return min(num_n_blocks(), last_row / kBlockN + 1);
  }

  // Query tiles [m_block_begin, num_m_blocks) hold every row that sees key tile n_block.
  CUTE_HOST_DEVICE int m_block_begin(int n_block) const { return causal ? n_block * kBlockN / kBlockM : 0; }

  // Whether tile (m_block, n_block) holds a pair that must be masked.
  CUTE_HOST_DEVICE bool needs_mask(int m_block, int n_block) const {
    const int col_end = (n_block + 1) * kBlockN;  // one past the tile's last column
    return col_end > len_k || (causal && col_end - 1 > m_block * kBlockM);
  }

  // Sets masked scores of a tile to -inf. acc is an accumulator fragment of
  // the tile, coord the same partition of an identity tensor over the tile
  // (its (row, col) within the tile); m0 / n0 are the tile's first row / column.
  template <class Acc, class Coord>
  CUTE_DEVICE void apply(Acc& acc, Coord const& coord, int m0, int n0) const {
    static_assert(decltype(size(acc))::value == decltype(size(coord))::value);
    const int col_limit = len_k - n0;
#pragma unroll
    for (int i = 0; i < size(acc); ++i) {
      const int row = m0 + get<0>(coord(i));
      const int col = get<1>(coord(i));
      const bool hidden = col >= col_limit || (causal && n0 + col > row);
      // A select: written as `if (hidden) acc(i) = -inf`, the sm90 forward
      // got a branch per score, which cost more than the tile's softmax.
      acc(i) = hidden ? -INFINITY : acc(i);
    }
  }

  // The same scores, by each row's visible-column limit. Two spellings because
  // the compiler treats them differently, measured: the sm80 forward runs the
  // one above 1-3% faster (this one 3-10% slower, unmasked tiles included);
  // in the sm90 forward the one above makes the head dim 256 kernel spill 200
  // bytes (36 with this one; the benchmark's head dim 256 rows fell 10-20%).
  template <class Acc, class Coord>
  CUTE_DEVICE void apply_by_row_limit(Acc& acc, Coord const& coord, int m0, int n0) const {
    static_assert(decltype(size(acc))::value == decltype(size(coord))::value);
    const int col_limit = len_k - n0;
#pragma unroll
    for (int i = 0; i < size(acc); ++i) {
      const int row = m0 + get<0>(coord(i));
      const int col = get<1>(coord(i));
      const int limit = causal ? min(col_limit, row - n0 + 1) : col_limit;
      acc(i) = col < limit ? acc(i) : -INFINITY;
    }
  }
};

}  // namespace sm80
}  // namespace tfb
