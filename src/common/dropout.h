// Dropout's decisions, one rule for every kernel and for the mask the ops
// return (dropout_mask.cu).
//
// Pair (query i, key j) of batch b, q head h is kept when its 8-bit draw is at
// least DropoutArgs::threshold (p in steps of 1/256, as PyTorch's flash kernel
// draws). The draws come from Philox4x32-10 keyed by the generator's seed; the
// counter's low 64 bits are offset / 4 + b * heads_q + h (PyTorch's generator
// hands out offsets in 32-bit draws, four to a counter; the ops take
// 4 * batch * heads_q of them per call), its high words name a cell of 16 pairs:
// rows {i, i + 8} and columns 16 b + {4 u .. 4 u + 3, 4 u + 8 .. 4 u + 11} of a
// 16 x 16 block, what lanes 2 u and 2 u + 1 (of each four) hold of a block of an
// mma.sync or wgmma accumulator (lane l: rows l / 4, + 8; columns 2 (l % 4),
// + 1, + 8, + 9):
//   cell_row(i) = (i / 16) * 8 + i % 8, cell_col(j) = (j / 16) * 2 + (j % 8) / 4.
// Byte 2 ((j / 8) % 2) + j % 2 of word 2 (s ^ b % 2) + (i / 8) % 2 decides the
// pair, s = (j / 2) % 2 the lane of the two: so of blocks 2 b' and 2 b' + 1,
// lane s draws block 2 b' + s's cell, keeps words x, y and hands z, w to lane
// s ^ 1, one Philox call per 16 of a forward lane's values. In S^T (keys as
// rows, the sm90 backward) a cell's keys sit in four lanes, which share the
// four cells of two query blocks the same way.
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

// A thread's keep decisions, a bit each, four 16 x 16 blocks (32 decisions) to
// a word: bit 16 h + 4 (g % 4) + s of word g / 4 is half h of mask s of the
// thread's block g (Dropout::keep_bits, keep_bits_transposed). Packed with
// one LOP3 a mask, read with one bit test.
template <int kBlocks>
struct KeepBits {
  uint32_t word[(kBlocks + 3) / 4] = {};

  CUTE_HOST_DEVICE void put(int g, uint32_t const (&halves)[4]) {
    CUTE_UNROLL
    for (int s = 0; s < 4; ++s) word[g / 4] |= halves[s] & (0x00010001u << (4 * (g % 4) + s));
  }
  CUTE_HOST_DEVICE bool get(int g, int s, int h) const { return ((word[g / 4] >> (16 * h + 4 * (g % 4) + s)) & 1u) != 0u; }
};

struct Dropout {
  static_assert(DropoutArgs::kDraws == 256, "a draw is a byte of Philox's output");
  uint2 key;
  uint2 counter;        // the low 64 bits of every draw's counter for this (batch, head)
  uint32_t threshold2;  // the threshold in both halves

  CUTE_HOST_DEVICE static int cell_row(int i) { return (i >> 4) * 8 + (i & 7); }
  CUTE_HOST_DEVICE static int cell_col(int j) { return (j >> 4) * 2 + ((j >> 2) & 1); }
  // The word of the cell's draw that decides (i, j), and its byte.
  CUTE_HOST_DEVICE static int word_of(int i, int j) { return 2 * (((j >> 1) ^ (j >> 4)) & 1) + ((i >> 3) & 1); }
  CUTE_HOST_DEVICE static int byte_of(int j) { return 2 * ((j >> 3) & 1) + (j & 1); }

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

  // A cell's sixteen draws, four bytes to a word.
  CUTE_HOST_DEVICE uint4 draw(int cell_i, int cell_j) const {
    return philox4x32_10(make_uint4(counter.x, counter.y, uint32_t(cell_i), uint32_t(cell_j)), key);
  }

#if defined(__CUDACC__)
  // Byte selectors: bytes {0, 1} or {2, 3} of a word into the low bytes of
  // two 16-bit halves (zero above), and bytes {0, 2} or {1, 3} of two words.
  static constexpr uint32_t kLowPair = 0x4140u, kHighPair = 0x4342u, kEvenBytes = 0x6420u, kOddBytes = 0x7531u;

  // Per half: 0xffff where the byte in its low 8 bits keeps its pair: the
  // bytes compare as float16 patterns (all finite, ordered as the integers),
  // one HSET2 for two (__vcmpgeu2 is emulated in several).
  CUTE_DEVICE uint32_t kept_halves(uint32_t word, uint32_t selector) const {
    uint32_t kept;
    asm("set.ge.u32.f16x2 %0, %1, %2;" : "=r"(kept) : "r"(__byte_perm(word, 0u, selector)), "r"(threshold2));
    return kept;
  }
  // A lane's two words of its own cell of the block holding key j.
  CUTE_DEVICE static void own_words(uint4 const& d, int j, uint32_t& w0, uint32_t& w1) {
    const bool swap = (((j >> 1) ^ (j >> 4)) & 1) != 0;
    w0 = swap ? d.z : d.x;
    w1 = swap ? d.w : d.y;
  }
  // Its four pair masks (halves: columns j, j + 1) from words w0 (row i) and
  // w1 (row i + 8): pair r + 2 g is row i + 8 r, columns j + 8 g.
  CUTE_DEVICE void pair_masks(uint32_t w0, uint32_t w1, uint32_t (&m)[4]) const {
    m[0] = kept_halves(w0, kLowPair);
    m[1] = kept_halves(w1, kLowPair);
    m[2] = kept_halves(w0, kHighPair);
    m[3] = kept_halves(w1, kHighPair);
  }
  // The same for the lane whose first value of a block is (i, j), drawing its cell alone.
  CUTE_DEVICE void block_masks(int i, int j, uint32_t (&m)[4]) const {
    uint32_t w0, w1;
    own_words(draw(cell_row(i), cell_col(j)), j, w0, w1);
    pair_masks(w0, w1, m);
  }

  // The keep bits of each value (r, c) of a (row, col) view of an accumulator
  // in the mma layout: rows (+8, row blocks), columns (+1, 8-column blocks,
  // ...), queries as rows. coord: that view of each value's (row, col) in the
  // tile; row0 / col0: the tile's first query and key in the sequence. They
  // depend on no score. A lane draws its cell of every block.
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
        uint32_t masks[4];
        block_masks(i, j, masks);
        bits.put(m * (kCols / 4) + k, masks);
      }
    }
    return bits;
  }
  // Value (r, c) of that view in keep_bits' result.
  template <int kCols, int kBlocks>
  CUTE_DEVICE static bool kept(KeepBits<kBlocks> const& bits, int r, int c) {
    return bits.get((r / 2) * (kCols / 4) + c / 4, (r & 1) + 2 * ((c >> 1) & 1), c & 1);
  }

  // The same over S^T's view (keys as rows, queries as columns): a lane
  // holds keys j, j + 8 and queries i, i + 1, i + 8, i + 9 of a block; the
  // four lanes of keys 4 u + {0, 1, 2, 3} (lanes l, l ^ 4, l ^ 8, l ^ 12;
  // s = (j / 2) % 2, c = j % 2) hold two cells (queries i, i + 1). Of query
  // blocks 2 a and 2 a + 1 (query0 a multiple of 32), lane (s, c) draws the
  // cell of query i + 16 s + c and hands each of the others its four bytes:
  // one call per 16 values. Every lane of the warp calls it.
  template <class Coord>
  CUTE_DEVICE auto keep_bits_transposed(Coord const& coord, int key0, int query0) const {
    constexpr int kRows = decltype(cute::size<0>(coord))::value;
    constexpr int kCols = decltype(cute::size<1>(coord))::value;
    static_assert(kRows % 2 == 0 && kCols % 8 == 0, "an mma accumulator's 16 x 16 blocks, in pairs of queries");
    constexpr int kBlocks = kCols / 4;
    KeepBits<kRows / 2 * kBlocks> bits;
    // Block g's masks from the bytes of queries i (+8) and i + 1 (+9), keys j (+8).
    auto put = [&](int g, uint32_t q0, uint32_t q1) {
      const uint32_t masks[4] = {kept_halves(q0, kLowPair), kept_halves(q1, kLowPair), kept_halves(q0, kHighPair),
                                 kept_halves(q1, kHighPair)};
      bits.put(g, masks);
    };
    CUTE_UNROLL
    for (int m = 0; m < kRows / 2; ++m) {
      CUTE_UNROLL
      for (int a = 0; a < kBlocks / 2; ++a) {
        const int j = key0 + cute::get<0>(coord(2 * m, 8 * a));
        const int i = query0 + cute::get<1>(coord(2 * m, 8 * a));
        const int s = (j >> 1) & 1, c = j & 1;
        const uint4 d = draw(cell_row(i + 16 * s + c), cell_col(j));
        uint32_t a0, a1, b0, b1;  // the words of keys with this lane's s, and with s ^ 1
        own_words(d, j, a0, a1);
        own_words(d, j ^ 2, b0, b1);
        const uint32_t same = c ? kOddBytes : kEvenBytes, flip = c ? kEvenBytes : kOddBytes;
        // r[x]: from lane (s, c) ^ x, the cell of query i + 16 (s ^ x / 2) + (c ^ x % 2).
        const uint32_t r0 = __byte_perm(a0, a1, same);
        const uint32_t r1 = __shfl_xor_sync(0xffffffffu, __byte_perm(a0, a1, flip), 4);
        const uint32_t r2 = __shfl_xor_sync(0xffffffffu, __byte_perm(b0, b1, same), 8);
        const uint32_t r3 = __shfl_xor_sync(0xffffffffu, __byte_perm(b0, b1, flip), 12);
        const uint32_t u0 = c ? r1 : r0, u1 = c ? r0 : r1;  // block 2 a + s: queries i, i + 1
        const uint32_t v0 = c ? r3 : r2, v1 = c ? r2 : r3;  // block 2 a + (s ^ 1)
        put(m * kBlocks + 2 * a, s ? v0 : u0, s ? v1 : u1);
        put(m * kBlocks + 2 * a + 1, s ? u0 : v0, s ? u1 : v1);
      }
    }
    return bits;
  }
  template <int kCols, int kBlocks>
  CUTE_DEVICE static bool kept_transposed(KeepBits<kBlocks> const& bits, int r, int c) {
    return bits.get((r / 2) * (kCols / 4) + c / 4, c & 3, r & 1);
  }

  // P converted to 16-bit pairs in registers (words: a recast of the
  // accumulator in the mma layout, pair w = r + 2 g of block k holding row
  // i + 8 r and columns j + 16 k + 8 g + {0, 1}; (i, j) the thread's first
  // value in the sequence; i % 16 < 8 and j % 16 < 8, j even, as a lane's
  // first value), its dropped values zeroed: a byte permute, a compare and an
  // AND per pair. Of blocks 2 b' and 2 b' + 1 (in the sequence) lanes s and
  // s ^ 1 draw block 2 b' + s's cell and trade half; kEven: j / 16 is even
  // (tiles of a multiple of 32 keys), else it is read. Every lane calls it.
  template <bool kEven, class Words>
  CUTE_DEVICE void drop_pairs(Words& words, int i, int j) const {
    if constexpr (kEven) {
      drop_pairs_from<0>(words, i, j);
    } else if (((j >> 4) & 1) == 0) {
      drop_pairs_from<0>(words, i, j);
    } else {
      drop_pairs_from<1>(words, i, j);
    }
  }
  // The same where the tile's block kFirst is the first of a pair.
  template <int kFirst, class Words>
  CUTE_DEVICE void drop_pairs_from(Words& words, int i, int j) const {
    constexpr int kBlocks = decltype(cute::size(words))::value / 4;
    static_assert(decltype(cute::size(words))::value % 4 == 0, "16 x 16 blocks: four pairs a lane");
    const int ci = cell_row(i);  // the paired draws'
    auto apply = [&](int k, uint32_t const (&masks)[4]) {
      CUTE_UNROLL
      for (int w = 0; w < 4; ++w) words(4 * k + w) &= masks[w];
    };
    auto paired = [&](int k, uint32_t w0, uint32_t w1) {
      uint32_t masks[4];
      pair_masks(w0, w1, masks);
      apply(k, masks);
    };
    auto alone = [&](int k) {
      uint32_t masks[4];
      block_masks(i, j + 16 * k, masks);
      apply(k, masks);
    };
    constexpr int kPairs = (kBlocks - kFirst) / 2;
    const int s = (j >> 1) & 1;
    if constexpr (kFirst == 1) alone(0);
    CUTE_UNROLL
    for (int a = 0; a < kPairs; ++a) {
      const int k = kFirst + 2 * a;
      const uint4 d = draw(ci, cell_col(j + 16 * (k + s)));  // words x, y: this lane's; z, w: lane s ^ 1's
      const uint32_t z = __shfl_xor_sync(0xffffffffu, d.z, 1), w = __shfl_xor_sync(0xffffffffu, d.w, 1);
      paired(k, s ? z : d.x, s ? w : d.y);
      paired(k + 1, s ? d.x : z, s ? d.y : w);
    }
    CUTE_UNROLL
    for (int k = kFirst + 2 * kPairs; k < kBlocks; ++k) alone(k);
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
