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
#include "common/mask_values.h"

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
    // the sm80 forward (its head dim 64 rows 18% slower). (Both edges as one
    // unsigned compare, (k - i - lo) < hi - lo, spilled less but ran the
    // unmasked head dim 64 forward 13% slower: benchmarks/history/2026-11-27-mask-mode.md.)
    const bool hidden =
        col >= col_limit || (band.right_bounded() && n0 + col >= row + band.hi) || n0 + col < row + band.lo;
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
    const bool keep = col < limit && col >= row + lo;
    acc(i) = keep ? acc(i) : -INFINITY;
  }
}

// A mask in memory on key tile n0 / kTileKeys, held as (row, col) views:
// each score reads its bit. A row's bits come in words of 64 keys from the
// tile's start. The thread's columns are its first one, `base`, plus offsets
// the compiler knows; so each row's words are loaded once, shifted right by
// `base`, and every score's bit then sits at a compile-time place (indexed
// by the column itself, the words went to local memory: 500-900 bytes of
// spills in the sm90 forward). Rows past len_q and keys past len_k are hidden
// without a read. Hidden elements become `hidden` (scores: -inf;
// probabilities: 0). An additive mask's kernel (M::kAdditive) also reads
// kFloored tiles here: their pairs without a bit take `hidden` (the limit's
// logit), keys past len_k `past_end`.
template <int kTileKeys, class M, class RowCol, class Coord>
CUTE_DEVICE void apply_rows(M const& m, RowCol& s, Coord const& coord, int m0, int n0, float hidden = -INFINITY,
                            float past_end = -INFINITY) {
  constexpr int kRows = decltype(cute::size<0>(s))::value;
  constexpr int kCols = decltype(cute::size<1>(s))::value;
  constexpr int kWords = M::tile_words(kTileKeys);
  const int col_limit = m.len_k - n0;
  const int base = cute::get<1>(coord(0, 0));  // the thread's first column
  const int first_word = base / 64, shift = base % 64;
  const uint64_t* tile = m.bits + n0 / kTileKeys * kWords + first_word;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = m0 + cute::get<0>(coord(r, 0));
    uint64_t w[kWords + 1];
#pragma unroll
    for (int i = 0; i <= kWords; ++i) {
      w[i] = row < m.len_q && first_word + i < kWords ? tile[int64_t(row) * m.words + i] : 0;
    }
    uint64_t v[kWords];  // bit k: column base + 64 * i + k
#pragma unroll
    for (int i = 0; i < kWords; ++i) v[i] = shift == 0 ? w[i] : w[i] >> shift | w[i + 1] << (64 - shift);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = cute::get<1>(coord(r, c));
      const int off = col - base;  // a constant once unrolled
      if constexpr (M::kAdditive) {
        const bool bit = (v[off / 64] >> (off % 64)) & 1;
        s(r, c) = col >= col_limit ? past_end : bit ? s(r, c) : hidden;
      } else {
        const bool keep = col < col_limit && (v[off / 64] >> (off % 64)) & 1;
        s(r, c) = keep ? s(r, c) : hidden;
      }
    }
  }
}

// The same mask on a transposed slice (the backward's S^T), held as (key,
// query) views: st's element (k, q) is key key0 + k, query row m0 + q, where
// the slice's keys [key0, key0 + 64) lie in one 64-bit word of their key tile
// (key0 % 64 == 0) and its queries are kQueries rows from m0. In the wgmma
// accumulator layout a warp's keys are 16 of them, 16-aligned (a thread's are
// k and k + 8 with k % 16 < 8), and its threads share the slice's queries: so
// one 16-bit piece of each query's word holds all the warp's keys. Each lane
// loads the pieces of queries lane, lane + 32, ... (load_bit_pieces; early,
// so that their latency overlaps the MMA: loads per score, each waited for,
// cost 4x the unmasked backward), and apply_transposed hands each thread its
// queries' pieces by shuffles, shifted so that each key's bit sits at a
// compile-time place. Rows past len_q read nothing (their probabilities are
// 0 already); hidden elements and keys past len_k become `hidden`.
template <int kTileKeys, int kQueries, class M>
CUTE_DEVICE void load_bit_pieces(M const& m, int m0, int key0, int piece, int lane,
                                 uint32_t (&pieces)[(kQueries + 31) / 32]) {
  static_assert(!M::kAdditive, "an additive mask's tiles read values (the sm80 backward serves them)");
  const uint16_t* first = reinterpret_cast<const uint16_t*>(m.bits + key0 / kTileKeys * M::tile_words(kTileKeys) +
                                                            key0 % kTileKeys / 64) +
                          piece;
  const int64_t row_pieces = int64_t(m.words) * 4;
#pragma unroll
  for (int j = 0; j < (kQueries + 31) / 32; ++j) {
    const int q = lane + 32 * j;
    pieces[j] = q < kQueries && m0 + q < m.len_q ? uint32_t(first[(m0 + q) * row_pieces]) : 0u;
  }
}

// coord: (key, query) of st's elements within the slice; all 32 lanes call it.
template <class KeyQuery, class Coord, int kPieces>
CUTE_DEVICE void apply_transposed(KeyQuery& st, Coord const& coord, int key_limit, uint32_t const (&pieces)[kPieces],
                                  float hidden) {
  constexpr int kKeys = decltype(cute::size<0>(st))::value;
  constexpr int kQueries = decltype(cute::size<1>(st))::value;
  const int base = cute::get<0>(coord(0, 0));  // the thread's first key
#pragma unroll
  for (int q = 0; q < kQueries; ++q) {
    const int query = cute::get<1>(coord(0, q));
    uint32_t held = pieces[0];
#pragma unroll
    for (int j = 1; j < kPieces; ++j) held = query >= 32 * j ? pieces[j] : held;
    const uint32_t bits = __shfl_sync(0xffffffffu, held, query % 32) >> (base % 16);
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      const int key = cute::get<0>(coord(k, q));
      const int off = key - base;  // a constant once unrolled, below 16 - base % 16 (see above)
      const bool keep = key < key_limit && (bits >> off) & 1;
      st(k, q) = keep ? st(k, q) : hidden;
    }
  }
}

// An additive mask's tile (TileKind::kAdditive) on key tile n0, held as
// (row, col) views: each unscaled score gains its value times `inv_scale`
// (mask_values.h add_additive; the kernel's 1 / scale, so that the scaled
// score is scale * q.k + value). Keys past len_k become `past_end`; rows past
// len_q read nothing and gain 0. The values load per score, in their own
// type: such tiles cost a read of the mask's bytes, not of a bit each.
template <class RowCol, class Coord>
CUTE_DEVICE void add_values(FromMemoryAdditive const& m, RowCol& s, Coord const& coord, int m0, int n0,
                            float inv_scale, float past_end) {
  constexpr int kRows = decltype(cute::size<0>(s))::value;
  constexpr int kCols = decltype(cute::size<1>(s))::value;
  const int col_limit = m.len_k - n0;
  with_value_type(m.type, [&](auto type) {
    constexpr MaskValues kType = decltype(type)::value;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = m0 + cute::get<0>(coord(r, 0));
      const uint8_t* at = m.values + int64_t(row < m.len_q ? row : 0) * m.row_stride + int64_t(n0) * m.col_stride;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = cute::get<1>(coord(r, c));
        const bool in = col < col_limit;
        const float v = in && row < m.len_q ? load_value<kType>(at + col * m.col_stride) : 0.f;
        s(r, c) = in ? add_additive(s(r, c), v, inv_scale) : past_end;
      }
    }
  });
}

// An additive mask's tile of kind `kind` on key tile n0, held as (row, col)
// views: kAdditive tiles add their values, kFloored ones give the pairs
// without a bit the limit's logit (both times inv_scale, the kernel's
// 1 / scale); keys past len_k become -inf. Returns false, touching nothing,
// for the other kinds, whose bits alone decide.
template <int kTileKeys, class RowCol, class Coord>
CUTE_DEVICE bool apply_values(FromMemoryAdditive const& m, TileKind kind, RowCol& s, Coord const& coord, int m0,
                              int n0, float inv_scale) {
  if (kind == TileKind::kAdditive) {
    add_values(m, s, coord, m0, n0, inv_scale, -INFINITY);
    return true;
  }
  if (kind == TileKind::kFloored) {
    apply_rows<kTileKeys>(m, s, coord, m0, n0, -kAdditiveLimit * inv_scale);
    return true;
  }
  return false;
}

// The forward's mask on one tile that needs a predicate, its unscaled scores
// in acc (MMA layout; coord its identity partition) and the same as (row,
// col) views s / s_coord: a band's edges (kByRowLimit: apply_by_row_limit's
// spelling), else the tile's kind (an additive mask's values or floor, or
// the bits). Every forward mainloop calls this, after negating the scores
// for a negative scale; the backward reuses apply_values and apply_rows.
template <bool kByRowLimit, class Walk, class Acc, class Coord, class RowCol, class RowColCoord>
CUTE_DEVICE void mask_scores(Walk const& walk, Acc& acc, Coord const& coord, RowCol& s, RowColCoord const& s_coord,
                             int m_block, int n_block) {
  using Policy = typename Walk::Policy;
  const int m0 = m_block * Walk::kBlockM, n0 = n_block * Walk::kBlockN;
  if constexpr (kAddsValues<Policy>) {
    // The scores are negated for a negative scale: |scale| times the negated
    // score plus value / |scale| is scale q.k + value.
    const float inv_scale = fabsf(walk.policy.values_scale);
    if (apply_values<Walk::kBlockN>(walk.policy, walk.policy.kind(m_block, n_block), s, s_coord, m0, n0, inv_scale)) {
      return;
    }
  }
  if constexpr (kReadsMemory<Policy>) {
    apply_rows<Walk::kBlockN>(walk.policy, s, s_coord, m0, n0);
  } else if constexpr (kByRowLimit) {
    apply_by_row_limit(walk.policy, acc, coord, m0, n0);
  } else {
    apply(walk.policy, acc, coord, m0, n0);
  }
}

}  // namespace mask
}  // namespace tfb
