// Which (query row, key column) pairs take part in attention: the mask
// policies every kernel family and the CPU reference share. Plain C++ (no CuTe,
// no CUDA headers), so host code includes it as well.
//
// A policy says, for rows i in [0, len_q) and keys j in [0, len_k):
//   key_begin(i), key_end(i): row i sees the keys [key_begin, key_end), an
//     empty range when key_end <= key_begin;
// and, for tiles of kBlockM rows by kBlockN keys (TileWalk below):
//   n_blocks(m_block): the key tiles a query tile visits, [begin, end);
//   m_blocks(n_block): the query tiles that see a key tile (backward walks);
//   needs_predicate(m_block, n_block): whether the tile holds a hidden pair,
//     so the per-element pass runs only there;
//   visible(i, j): the predicate itself.
// Keys past len_k are never visible; rows past len_q are never asked about.
// Lengths stay below 2^30 (kUnbounded).
#pragma once

#include <cstdint>

#include "params.h"

#if defined(__CUDACC__)
#define TFB_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TFB_HOST_DEVICE inline
#endif

namespace tfb {
namespace mask {

// Band edges far enough out never bind: rows and keys stay below 2^30, so
// i + an offset of at most 2^30 in size fits an int.
constexpr int kUnbounded = 1 << 30;

// diag + edge, held to +-kUnbounded.
TFB_HOST_DEVICE int band_offset(int64_t diag, int64_t edge) {
  const int64_t x = diag + edge;
  return x < -kUnbounded ? -kUnbounded : x > kUnbounded ? kUnbounded : static_cast<int>(x);
}

// Row i sees key j when i + diag - left <= j <= i + diag + right. Every
// policy SDPA and its extensions name is one of these bands:
//   no mask                     left = right = unbounded
//   causal, top-left aligned    right = 0, diag = 0           (SDPA's is_causal, also when L != S)
//   causal, bottom-right        right = 0, diag = len_k - len_q (causal_lower_right)
//   sliding window              finite left and/or right, either alignment
// It is stored as offsets from the row, computed once: row i sees keys
// [i + lo, i + hi) clipped to [0, len_k). An open left edge (lo at
// -kUnbounded) is one compare more per score in the tiles that need a
// predicate anyway (a separate kernel for windows would double the band's
// instantiations for that compare).
struct Band {
  int len_q;
  int len_k;
  int lo = -kUnbounded;
  int hi = kUnbounded;

  TFB_HOST_DEVICE bool right_bounded() const { return hi < kUnbounded; }
  TFB_HOST_DEVICE bool left_bounded() const { return lo > -kUnbounded; }
  TFB_HOST_DEVICE int key_begin(int i) const {
    const int j = i + lo;
    return j < 0 ? 0 : j > len_k ? len_k : j;
  }
  TFB_HOST_DEVICE int key_end(int i) const {
    const int j = i + hi;
    return j < 0 ? 0 : j > len_k ? len_k : j;
  }
  TFB_HOST_DEVICE bool visible(int i, int j) const { return j >= key_begin(i) && j < key_end(i); }

  // The rows that see key j, for walks over keys (the backward): from
  // row_begin(j) (len_q or more: none) to row_end(j), both nondecreasing in j.
  TFB_HOST_DEVICE int row_begin(int j) const {
    const int i = j - hi + 1;  // first i with i + hi > j
    return right_bounded() && i > 0 ? i : 0;
  }
  TFB_HOST_DEVICE int row_end(int j) const {
    if (lo <= -kUnbounded) return len_q;
    const int i = j - lo + 1;  // first i with i + lo > j
    return i < 0 ? 0 : i < len_q ? i : len_q;
  }
};

// The one reading of MaskArgs's band (params.h): a batch's band for its
// lengths; every pair for the other modes (a mask in memory's keys are all
// in range, its tiles say the rest).
TFB_HOST_DEVICE Band band_of(const MaskArgs& m, int len_q, int len_k) {
  if (m.mode != MaskMode::kBand) return {len_q, len_k};
  const int64_t diag = m.bottom_right ? int64_t(len_k) - len_q : 0;
  return {len_q, len_k, m.window_left < 0 ? -kUnbounded : band_offset(diag, -int64_t(m.window_left)),
          m.window_right < 0 ? kUnbounded : band_offset(diag, int64_t(m.window_right) + 1)};
}

// A mask read from memory, for masks no band describes (padding, block-sparse):
// a pre-pass (mask_summary.h) says, for one tile shape, which tiles are all
// visible, all hidden or mixed, and packs the mask a bit per (row, key), which
// mixed tiles read: a 64-bit word holds 64 keys of one row, counted from the
// start of their key tile (tile_words words per tile, whatever its width), so
// a thread loads a word per row of its fragment where a byte per score would
// cost a load each, and finds each score's bit at a compile-time place.
// Rows past len_q are never read.
// An additive mask's tiles are kinds of the same three where its values are
// 0 (visible) and -inf (hidden) alone. A tile of 0 and values beyond
// mask_values.h's negative limit alone (finfo.min padding) is kFloored: its
// bits say which pairs keep their score, the others take the limit as their
// logit, as add_additive gives them, without reading a value. A tile holding
// any other value (or both -inf and such values) is kAdditive, and reads the
// values themselves (mask_apply.h add_values).
enum class TileKind : uint8_t { kVisible = 0, kHidden = 1, kMixed = 2, kAdditive = 3, kFloored = 4 };

// kAdditive_: the mask may be additive (its kernels read kAdditive and
// kFloored tiles); a boolean mask's kernels are compiled without that code,
// which cost them 12-35% of their speed (benchmarks/history/2026-11-v9-v27.md, v22).
template <bool kAdditive_>
struct FromMemoryOf {
  static constexpr bool kAdditive = kAdditive_;
  int len_q;
  int len_k;
  const uint8_t* tile_kinds;  // (m_blocks, n_blocks) row-major for the walk's tile shape
  int n_blocks;               // row stride of tile_kinds
  const uint64_t* bits;       // (len_q, words): key tile n's keys in words [n * tile_words, (n + 1) * tile_words)
  int words;                  // row stride of bits; 0 for a mask the same for every row
  int tile_keys;              // the walk's key tile
  // The mask itself, which kAdditive tiles read: batch b, head h's plane, strides in bytes.
  const uint8_t* values;
  int64_t row_stride, col_stride;
  MaskValues type;
  float values_scale;  // MaskArgs::values_scale

  TFB_HOST_DEVICE int key_begin(int) const { return 0; }
  TFB_HOST_DEVICE int key_end(int) const { return len_k; }
  TFB_HOST_DEVICE TileKind kind(int m_block, int n_block) const {
    return static_cast<TileKind>(tile_kinds[int64_t(m_block) * n_blocks + n_block]);
  }
  static TFB_HOST_DEVICE constexpr int tile_words(int keys) { return (keys + 63) / 64; }
  // Word w of key tile n_block in row i.
  TFB_HOST_DEVICE uint64_t word(int i, int n_block, int w) const {
    return bits[int64_t(i) * words + n_block * tile_words(tile_keys) + w];
  }
  TFB_HOST_DEVICE bool visible(int i, int j) const {
    const int o = j % tile_keys;
    return j < len_k && (word(i, j / tile_keys, o / 64) >> (o % 64)) & 1;
  }
};

using FromMemory = FromMemoryOf<false>;          // a boolean attn_mask
using FromMemoryAdditive = FromMemoryOf<true>;   // an additive one

template <class Policy>
constexpr bool kReadsMemory = false;
template <bool kAdditive>
constexpr bool kReadsMemory<FromMemoryOf<kAdditive>> = true;

template <class Policy>
constexpr bool kAddsValues = false;
template <>
constexpr bool kAddsValues<FromMemoryAdditive> = true;

// A policy seen through tiles of kBlockM rows by kBlockN keys.
template <int kBlockM_, int kBlockN_, class Policy_>
struct TileWalk {
  using Policy = Policy_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  Policy policy;

  TFB_HOST_DEVICE int num_m_blocks() const { return (policy.len_q + kBlockM - 1) / kBlockM; }
  TFB_HOST_DEVICE int num_n_blocks() const { return (policy.len_k + kBlockN - 1) / kBlockN; }
  TFB_HOST_DEVICE int last_row(int m_block) const {
    const int end = (m_block + 1) * kBlockM;
    return (end < policy.len_q ? end : policy.len_q) - 1;
  }

  // Key tiles [begin, end) hold every key query tile m_block sees. Band edges
  // move right as rows go down, so the tile's first row bounds the start and
  // its last row the end.
  struct Range {
    int begin, end;
  };
  TFB_HOST_DEVICE Range n_blocks(int m_block) const {
    const int first_key = policy.key_begin(m_block * kBlockM);
    const int key_end = policy.key_end(last_row(m_block));
    const int begin = first_key / kBlockN;
    if (key_end <= first_key) return {begin, begin};  // e.g. a window past the last key
    return {begin, (key_end + kBlockN - 1) / kBlockN};
  }

  // Query tiles [begin, end) hold every row that sees a key of tile n_block.
  TFB_HOST_DEVICE Range m_blocks(int n_block) const {
    if constexpr (kReadsMemory<Policy>) {
      return {0, num_m_blocks()};
    } else {
      const int first_key = n_block * kBlockN;
      const int last_key = (first_key + kBlockN < policy.len_k ? first_key + kBlockN : policy.len_k) - 1;
      const int begin = policy.row_begin(first_key) / kBlockM;
      const int end = (policy.row_end(last_key) + kBlockM - 1) / kBlockM;
      return {begin, end > begin ? end : begin};
    }
  }

  // Whether key tile n_block reaches past len_k: the keys there are hidden,
  // whatever a mask in memory's tile kind says (the pre-pass sees keys < len_k).
  TFB_HOST_DEVICE bool past_len_k(int n_block) const { return (n_block + 1) * kBlockN > policy.len_k; }

  // Whether tile (m_block, n_block) holds a hidden pair: keys past len_k, a
  // row whose band ends inside the tile, or one whose band starts inside it.
  TFB_HOST_DEVICE bool needs_predicate(int m_block, int n_block) const {
    const int col_begin = n_block * kBlockN;
    const int col_end = col_begin + kBlockN;
    if constexpr (kReadsMemory<Policy>) {
      return past_len_k(n_block) || policy.kind(m_block, n_block) != TileKind::kVisible;
    } else {
      return col_end > policy.key_end(m_block * kBlockM) || policy.key_begin(last_row(m_block)) > col_begin;
    }
  }

  TFB_HOST_DEVICE bool visible(int i, int j) const { return policy.visible(i, j); }

  // Whether the walk skips tile (m_block, n_block) inside its range: a mask
  // in memory skips the tiles it hides; a band's range is whole.
  TFB_HOST_DEVICE bool skipped(int m_block, int n_block) const {
    if constexpr (kReadsMemory<Policy>) {
      return policy.kind(m_block, n_block) == TileKind::kHidden;
    } else {
      return false;
    }
  }

  // What a forward walk reads at each step of query tile m_block, computed
  // once per tile, so that a band's edges stay out of the mainloop's every
  // step (the sm90 forward's KeyWalk). Its key
  // tiles [first, end), and of a band the tiles [clear_begin, clear_end) that
  // hold no hidden pair: every row of the tile sees all their keys.
  struct Steps {
    int first, end;
    int clear_begin, clear_end;
  };
  TFB_HOST_DEVICE Steps steps(int m_block) const {
    const Range r = n_blocks(m_block);
    if constexpr (kReadsMemory<Policy>) {
      return {r.begin, r.end, 0, 0};
    } else {
      // Band edges move right as rows go down: the last row starts latest,
      // the first ends earliest.
      const int lo = policy.key_begin(last_row(m_block)), hi = policy.key_end(m_block * kBlockM);
      return {r.begin, r.end, (lo + kBlockN - 1) / kBlockN, hi / kBlockN};
    }
  }
  // needs_predicate, from the tile's steps.
  TFB_HOST_DEVICE bool needs_predicate(Steps const& s, int m_block, int n_block) const {
    if constexpr (kReadsMemory<Policy>) {
      return needs_predicate(m_block, n_block);
    } else {
      return n_block < s.clear_begin || n_block >= s.clear_end;
    }
  }

  // The last key tile at or below n_block that query tile m_block visits
  // (-1: none): a mask's hidden tiles are skipped; below the range's first
  // (a band's left edge) there is none. Two forms of one walk, each where it
  // measured faster: per step (the sm80 forward: with steps() its unmasked
  // head dim 64 rows ran 13% slower) and from the tile's steps (the sm90
  // forward: per step cost its bands 2-4%); mask_policy_check.cpp checks
  // that they agree.
  TFB_HOST_DEVICE int visited_at_or_below(int m_block, int n_block) const {
    if constexpr (kReadsMemory<Policy>) {
      while (n_block >= 0 && skipped(m_block, n_block)) --n_block;
      return n_block;
    } else {
      return n_block >= n_blocks(m_block).begin ? n_block : -1;
    }
  }
  TFB_HOST_DEVICE int visited_at_or_below(Steps const& s, int m_block, int n_block) const {
    if constexpr (kReadsMemory<Policy>) {
      while (n_block >= 0 && skipped(m_block, n_block)) --n_block;
      return n_block;
    } else {
      return n_block >= s.first ? n_block : -1;
    }
  }
};

}  // namespace mask
}  // namespace tfb
