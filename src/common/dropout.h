// Dropout's decisions, one rule for every kernel and for the mask the ops
// return (dropout_mask.cu).
//
// Pair (query i, key j) of batch b, q head h is kept when the low
// DropoutArgs::kDrawBits (params.h) bits of its 16-bit draw are at least
// DropoutArgs::threshold (read as float16 patterns, all finite and ordered as
// integers up to 14 bits, one packed compare decides two pairs). The draws
// come from Philox4x32-10 keyed by the generator's seed; the counter's low 64
// bits are offset / 4 + b * heads_q + h (PyTorch's generator hands out offsets
// in 32-bit draws, four to a counter; the ops take 4 * batch * heads_q of them
// per call), its high words name a cell of 8 pairs:
//   cell_row(i) = (i / 16) * 8 + i % 8, cell_col(j) = ((j / 16) * 8 + j % 8) / 2,
// the pairs {i, i + 8} x {j, j + 1, j + 8, j + 9} of a 16 x 16 block; draw
// `slot(i, j)` of the cell's eight decides the pair. A cell is exactly what one
// lane holds of a 16 x 16 block of an mma.sync or wgmma accumulator (rows
// lane / 4 and + 8, columns 2 (lane % 4), + 1, + 8, + 9), so a forward's lane
// makes one draw per eight of its values; a backward holding S^T (keys as rows)
// needs two cells per block and shares them with the lane holding key j ^ 1.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "params.h"

namespace tfb {

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
// The products as __umulhi and a 32-bit multiply: written as 64-bit products,
// nvcc adds a zero high word into every round (a third more instructions, in
// the chain's critical path).
CUTE_HOST_DEVICE uint32_t mul_hi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * b) >> 32);
#endif
}

CUTE_HOST_DEVICE uint4 philox4x32_10(uint4 c, uint2 key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    c = make_uint4(mul_hi(kM1, c.z) ^ c.y ^ key.x, kM1 * c.z, mul_hi(kM0, c.x) ^ c.w ^ key.y, kM0 * c.x);
    key.x += kW0;
    key.y += kW1;
  }
  return c;
}

// A thread's keep decisions, a bit each, four cells (32 decisions) to a word:
// bit 16 h + 4 (g % 4) + s of word g / 4 is half h of kept-halves word s of
// the thread's cell g (Dropout::kept_halves). Packed with one LOP3 a word
// half, read with one bit test.
template <int kCells>
struct KeepBits {
  uint32_t word[(kCells + 3) / 4] = {};

  CUTE_HOST_DEVICE void put(int g, uint32_t const (&halves)[4]) {
    CUTE_UNROLL
    for (int s = 0; s < 4; ++s) word[g / 4] |= halves[s] & (0x00010001u << (4 * (g % 4) + s));
  }
  CUTE_HOST_DEVICE bool get(int g, int s, int h) const { return ((word[g / 4] >> (16 * h + 4 * (g % 4) + s)) & 1u) != 0u; }
};

struct Dropout {
  // The bits a draw decides with, in both halves; from 15 bits on some would
  // read as float16 infinities and NaNs.
  static_assert(DropoutArgs::kDrawBits <= 14, "draws compare as finite float16 patterns");
  static constexpr uint32_t kDrawMask2 = (DropoutArgs::kDraws - 1) * 0x00010001u;
  uint2 key;
  uint2 counter;        // the low 64 bits of every draw's counter for this (batch, head)
  uint32_t threshold2;  // the threshold in both halves

  CUTE_HOST_DEVICE static int cell_row(int i) { return (i >> 4) * 8 + (i & 7); }
  CUTE_HOST_DEVICE static int cell_col(int j) { return ((j >> 4) * 8 + (j & 7)) >> 1; }
  CUTE_HOST_DEVICE static int slot(int i, int j) { return (j & 1) * 4 + ((i >> 3) & 1) * 2 + ((j >> 3) & 1); }

  // The seed and offset this call draws with (while capturing a CUDA graph, or
  // in a backward: read through the pointers).
  CUTE_HOST_DEVICE static uint64_t seed_of(DropoutArgs const& a) { return a.seed_ptr ? uint64_t(*a.seed_ptr) : a.seed; }
  CUTE_HOST_DEVICE static uint64_t offset_of(DropoutArgs const& a) {
    return a.offset_ptr ? uint64_t(*a.offset_ptr) + a.offset_extra : a.offset;
  }

  CUTE_HOST_DEVICE static Dropout of(DropoutArgs const& a, int batch, int head, int heads_q) {
    const uint64_t seed = seed_of(a);
    const uint64_t low = offset_of(a) / 4 + uint64_t(batch) * uint64_t(heads_q) + uint64_t(head);
    return {make_uint2(uint32_t(seed), uint32_t(seed >> 32)), make_uint2(uint32_t(low), uint32_t(low >> 32)),
            a.threshold | (a.threshold << 16)};
  }

  // A cell's eight draws, two to a word: slot s is half s % 2 of word s / 2.
  CUTE_HOST_DEVICE uint4 draw(int cell_i, int cell_j) const {
    return philox4x32_10(make_uint4(counter.x, counter.y, uint32_t(cell_i), uint32_t(cell_j)), key);
  }

#if defined(__CUDACC__)
  // Per half: 0xffff where the draw keeps its pair: an unsigned compare of
  // the 14-bit halves as float16 (one HSET2; __vcmpgeu2 is emulated in several).
  CUTE_DEVICE uint32_t kept_halves(uint32_t word) const {
    uint32_t kept;
    asm("set.ge.u32.f16x2 %0, %1, %2;" : "=r"(kept) : "r"(word & kDrawMask2), "r"(threshold2));
    return kept;
  }

  // The keep bits of each value (r, c) of a (row, col) view of an accumulator
  // in the mma layout: rows (+8, row blocks), columns (+1, 8-column blocks,
  // ...), queries as rows. coord: that view of each value's (row, col) in the
  // tile; row0 / col0: the tile's first query and key in the sequence. They
  // depend on no score (the sm90 backward draws them while dP^T is computed).
  template <class Coord>
  CUTE_DEVICE auto keep_bits(Coord const& coord, int row0, int col0) const {
    constexpr int kRows = decltype(cute::size<0>(coord))::value;
    constexpr int kCols = decltype(cute::size<1>(coord))::value;
    static_assert(kRows % 2 == 0 && kCols % 4 == 0, "an mma accumulator's 16 x 16 blocks");
    KeepBits<kRows / 2 * (kCols / 4)> bits;
    CUTE_UNROLL
    for (int m = 0; m < kRows / 2; ++m) {
      CUTE_UNROLL
      for (int k = 0; k < kCols / 4; ++k) {
        const int i = row0 + cute::get<0>(coord(2 * m, 4 * k));
        const int j = col0 + cute::get<1>(coord(2 * m, 4 * k));
        const uint4 d = draw(cell_row(i), cell_col(j));
        // Word s = slot / 2 = 2 (col & 1) + (row / 8), half = (col / 8) & 1.
        const uint32_t halves[4] = {kept_halves(d.x), kept_halves(d.y), kept_halves(d.z), kept_halves(d.w)};
        bits.put(m * (kCols / 4) + k, halves);
      }
    }
    return bits;
  }
  // Value (r, c) of that view in keep_bits' result.
  template <int kCols, int kCells>
  CUTE_DEVICE static bool kept(KeepBits<kCells> const& bits, int r, int c) {
    return bits.get((r / 2) * (kCols / 4) + c / 4, 2 * (c & 1) + (r & 1), (c >> 1) & 1);
  }

  // The same over S^T's view (keys as rows, queries as columns): each lane
  // draws one of the two cells of a 16 x 16 block and trades half of it with
  // lane ^ 4 (key j ^ 1, the same queries). Every lane of the warp calls it.
  template <class Coord>
  CUTE_DEVICE auto keep_bits_transposed(Coord const& coord, int key0, int query0) const {
    constexpr int kRows = decltype(cute::size<0>(coord))::value;
    constexpr int kCols = decltype(cute::size<1>(coord))::value;
    static_assert(kRows % 2 == 0 && kCols % 4 == 0, "an mma accumulator's 16 x 16 blocks");
    KeepBits<kRows / 2 * (kCols / 4)> bits;
    CUTE_UNROLL
    for (int m = 0; m < kRows / 2; ++m) {
      CUTE_UNROLL
      for (int k = 0; k < kCols / 4; ++k) {
        const int j = key0 + cute::get<0>(coord(2 * m, 4 * k));
        const int i = query0 + cute::get<1>(coord(2 * m, 4 * k));
        const bool odd = (j & 1) != 0;
        // Cell cell_row(i) + odd; this lane's slots are those of key parity `odd`: words 2 odd, 2 odd + 1.
        const uint4 d = draw(cell_row(i) + int(odd), cell_col(j));
        const uint32_t own0 = odd ? d.z : d.x, own1 = odd ? d.w : d.y;
        const uint32_t other0 = __shfl_xor_sync(0xffffffffu, odd ? d.x : d.z, 4);
        const uint32_t other1 = __shfl_xor_sync(0xffffffffu, odd ? d.y : d.w, 4);
        // Queries i + 0 / 8 (columns 4 k, + 2) read cell_row(i), queries i + 1 / 9 the next;
        // half r & 1 of a word: keys j and j + 8.
        const uint32_t halves[4] = {kept_halves(odd ? other0 : own0), kept_halves(odd ? own0 : other0),
                                    kept_halves(odd ? other1 : own1), kept_halves(odd ? own1 : other1)};
        bits.put(m * (kCols / 4) + k, halves);
      }
    }
    return bits;
  }
  template <int kCols, int kCells>
  CUTE_DEVICE static bool kept_transposed(KeepBits<kCells> const& bits, int r, int c) {
    return bits.get((r / 2) * (kCols / 4) + c / 4, c & 3, r & 1);
  }

  // P converted to 16-bit pairs in registers (words: a recast of the
  // accumulator in the mma layout, pair w = r + 2 g holding row i + 8 r and
  // columns j + 8 g + {0, 1}; (i, j) the thread's first value in the
  // sequence; i % 16 < 8 and j % 16 < 8, j even, as a lane's first value),
  // its dropped values zeroed: per cell, a compare per draw word, a byte
  // permute and an AND per pair (a bit per value, tested and selected, cost
  // three times that).
  template <class Words>
  CUTE_DEVICE void drop_pairs(Words& words, int i, int j) const {
    constexpr int kPairs = decltype(cute::size(words))::value;
    static_assert(kPairs % 4 == 0, "16 x 16 blocks: four pairs a cell");
    const int ci = cell_row(i), cj = cell_col(j);
    CUTE_UNROLL
    for (int k = 0; k < kPairs / 4; ++k) {
      // Cell cj + 4 k: columns j + 16 k (+ 1, 8, 9). Words x, y, z, w: slots
      // (row, col) (i, j | j + 8), (i + 8, j | j + 8), (i, j + 1 | j + 9), (i + 8, j + 1 | j + 9).
      const uint4 d = draw(ci, cj + 4 * k);
      const uint32_t x = kept_halves(d.x), y = kept_halves(d.y), z = kept_halves(d.z), w = kept_halves(d.w);
      words(4 * k) &= __byte_perm(x, z, 0x5410);
      words(4 * k + 1) &= __byte_perm(y, w, 0x5410);
      words(4 * k + 2) &= __byte_perm(x, z, 0x7632);
      words(4 * k + 3) &= __byte_perm(y, w, 0x7632);
    }
  }

  // f(r, c, kept) for each value of keep_bits' view.
  template <class Coord, class F>
  CUTE_DEVICE void for_each(Coord const& coord, int row0, int col0, F&& f) const {
    constexpr int kRows = decltype(cute::size<0>(coord))::value;
    constexpr int kCols = decltype(cute::size<1>(coord))::value;
    const auto bits = keep_bits(coord, row0, col0);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) f(r, c, kept<kCols>(bits, r, c));
    }
  }
#endif
};

// The forward's first thread records the seed and offset its call drew with.
#if defined(__CUDACC__)
CUTE_DEVICE void record_rng_state(DropoutArgs const& a) {
  if (a.rng_state != nullptr) {
    a.rng_state[0] = int64_t(Dropout::seed_of(a));
    a.rng_state[1] = int64_t(Dropout::offset_of(a));
  }
}
#endif

}  // namespace tfb
