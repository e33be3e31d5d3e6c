// FP8's V transpose: FP8 wgmma reads its B operand K-major, so P V wants V
// with the keys contiguous, while TMA lands V's tiles with the head dim
// contiguous. The producer warpgroup rewrites each landed tile into a second
// ring, 16 keys x 32 dims per warp step: one ldmatrix.trans of four 8x8
// 16-bit matrices (keys x dim pairs) gives each lane, per dim pair, two
// keys' bytes; four byte permutes make them words of one dim and four keys;
// one stmatrix writes those words as four 8x8 matrices (dims x key pairs).
//
// The keys go in the order P's registers hold them. An accumulator gives a
// thread, per row and 16 keys, columns {2t, 2t+1, 2t+8, 2t+9} (t its lane
// in the quad), and an 8-bit A operand wants 4 consecutive k from each lane:
// so P's registers are used as they are, and position 4t + i of each 16 keys
// of the transposed tile holds key key_of_position(i) + 2t (the sum over k
// does not care about its order). ldmatrix.trans hands lane 4c + t keys 2t
// and 2t + 1 of dim pair c, from the group's first 8 keys and from its last
// 8: exactly that order once permuted.
//
// Addresses are byte offsets worked out once per lane: the swizzle (an XOR
// of a row's bits into its 16-byte column) commutes with the steps' constant
// offsets, so a step costs an add and an XOR per matrix address.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

namespace tfb {
namespace sm90 {

// The key (of 16) at position 4t + i, less 2t: 0, 1, 8, 9.
CUTE_HOST_DEVICE constexpr int key_of_position(int i) { return (i & 1) + 8 * (i >> 1); }

// A K-major GMMA swizzle atom over rows of `width` bytes (128, 64 or 32; the
// sm90 traits' k_major_smem_atom for 8-bit elements): row r's 16-byte
// columns are XORed with r's low bits. `offset` = row * width + column.
template <int kWidth>
CUTE_HOST_DEVICE constexpr int swizzled(int offset) {
  return offset ^ ((offset >> 3) & ((kWidth / 16 - 1) << 4));
}

// The widest atom whose rows divide a row of `bytes` (k_major_smem_atom's rule).
CUTE_HOST_DEVICE constexpr int atom_width(int bytes) { return bytes % 128 == 0 ? 128 : bytes % 64 == 0 ? 64 : 32; }

// Byte offsets of 8-bit tiles laid out as tile_to_shape(k_major_smem_atom,
// (rows, cols)): atoms of 8 rows stacked down the rows, then across the columns.
template <int kRows, int kCols>
struct ByteTile {
  static constexpr int kWidth = atom_width(kCols);
  CUTE_HOST_DEVICE static constexpr int offset(int row, int col) {
    return (col / kWidth) * (kRows * kWidth) + swizzled<kWidth>(row * kWidth + col % kWidth);
  }
};

// Where each lane's ldmatrix and stmatrix row addresses point, per warp step
// (a 16-key group and a 32-dim block), as byte offsets into the landed tile
// (ByteTile<kKeys, kDim>) and its transposed copy (ByteTile<kDstRows, kKeys>:
// kDstRows - kDim rows below the dims are not the transpose's), and which dim
// each of a lane's four words holds. Host code reads the same functions
// (test/cpp/transpose_layout_check.cu replays a step lane by lane).
template <int kKeys, int kDim, int kDstRows = kDim>
struct TransposeSteps {
  using Src = ByteTile<kKeys, kDim>;
  using Dst = ByteTile<kDstRows, kKeys>;
  static constexpr int kBlocksPerAtom = Src::kWidth / 32;
  // 16-key groups: warp w takes w, w + 4, ... (224 keys: 14, so warps 2 and 3 take three).
  static constexpr int kGroups = kKeys / 16;
  static constexpr int kGroupsPerWarp = (kGroups + 3) / 4;
  // Lane 8m + r addresses row r of matrix m: for the load, key r of the
  // group's first (m even) or last 8, dims 0-15 (m < 2) or 16-31 of the
  // block; for the store, dim 2r + (m odd, flipped for r >= 4) (+ 16 for
  // m >= 2) of the block, the group's 16 key positions. The flip puts a
  // matrix's eight rows at dims 0, 2, 4, 6, 9, 11, 13, 15 (or 1, 3, 5, 7, 8,
  // 10, 12, 14): eight residues mod 8, so eight different 16-byte columns of
  // the swizzled rows and no bank twice (dims 2r alone, residues 0, 2, 4, 6
  // twice each, cost each stored matrix a second pass).
  CUTE_HOST_DEVICE static constexpr int load_lane(int lane) {
    const int m = lane / 8, r = lane % 8;
    return swizzled<Src::kWidth>((8 * (m & 1) + r) * Src::kWidth + 16 * (m >> 1));
  }
  CUTE_HOST_DEVICE static constexpr int store_lane(int lane) {
    const int m = lane / 8, r = lane % 8;
    return swizzled<Dst::kWidth>((2 * r + ((m & 1) ^ (r >> 2)) + 16 * (m >> 1)) * Dst::kWidth);
  }
  // The step's offsets given the lane's part (load_lane / store_lane): the
  // swizzle commutes with them, an add and an XOR each.
  CUTE_HOST_DEVICE static constexpr int load_row(int lane_part, int group, int block) {
    return (block / kBlocksPerAtom) * (kKeys * Src::kWidth) + group * 16 * Src::kWidth +
           (lane_part ^ ((block % kBlocksPerAtom) * 32));
  }
  CUTE_HOST_DEVICE static constexpr int store_row(int lane_part, int group, int block) {
    const int col = group * 16;  // the group's 16 key positions in a dst row
    return (col / Dst::kWidth) * (kDstRows * Dst::kWidth) + block * 32 * Dst::kWidth +
           (lane_part ^ (col % Dst::kWidth));
  }
  // __byte_perm selectors of a lane's words (w[0] and w[2]: `even`; w[1],
  // w[3]: the other): with c = lane / 4, the ldmatrix's v[0] holds (key 2t:
  // dims 2c, 2c + 1), (key 2t + 1: the same dims), v[1] the same for keys
  // 2t + 8, 2t + 9, v[2] and v[3] as v[0] and v[1] 16 dims on; 0x6420 takes
  // dim 2c of keys 2t, 2t + 1, 2t + 8, 2t + 9 (P's order), 0x7531 dim 2c + 1.
  // Lanes of c >= 4 give matrix 0 (and 2) dim 2c + 1: the store's flip.
  CUTE_HOST_DEVICE static constexpr uint32_t selector(int lane, bool even) {
    return even != (lane / 4 >= 4) ? 0x6420u : 0x7531u;
  }
};

// src: a (kKeys, kDim) tile as TMA landed it (ByteTile<kKeys, kDim>); dst:
// its (kDim, kKeys) transposed copy, the first kDim rows of
// ByteTile<kDstRows, kKeys>. Keys at or past `keys` are written as zeros (a
// packed tile's rows of the next sequence). 128 threads (a warpgroup),
// thread_idx among them.
template <int kKeys, int kDim, int kDstRows = kDim>
CUTE_DEVICE void transpose_v_tile(uint8_t const* src, uint8_t* dst, int keys, int thread_idx) {
  using Steps = TransposeSteps<kKeys, kDim, kDstRows>;
  static_assert(kKeys % 16 == 0 && kDim % 32 == 0);
  const int lane = thread_idx % 32, warp = thread_idx / 32;
  const int t = lane % 4;
  const int load_lane = Steps::load_lane(lane), store_lane = Steps::store_lane(lane);
  const uint32_t even = Steps::selector(lane, true), odd = Steps::selector(lane, false);
  const uint32_t src_base = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  const uint32_t dst_base = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  CUTE_UNROLL
  for (int gi = 0; gi < Steps::kGroupsPerWarp; ++gi) {
    const int group = warp + 4 * gi;
    if (Steps::kGroups % 4 != 0 && group >= Steps::kGroups) break;
    // A lane's words hold keys 16 group + 2t + {0, 1, 8, 9} (bytes 0-3).
    uint32_t keep = 0xffffffffu;
    if (keys < kKeys) {
      keep = 0;
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) keep |= (group * 16 + 2 * t + key_of_position(i) < keys ? 0xffu : 0u) << (8 * i);
    }
    CUTE_UNROLL
    for (int b = 0; b < kDim / 32; ++b) {
      const uint32_t from = src_base + Steps::load_row(load_lane, group, b);
      const uint32_t to = dst_base + Steps::store_row(store_lane, group, b);
      uint32_t v[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                   : "r"(from)
                   : "memory");
      const uint32_t w[4] = {__byte_perm(v[0], v[1], even) & keep, __byte_perm(v[0], v[1], odd) & keep,
                             __byte_perm(v[2], v[3], even) & keep, __byte_perm(v[2], v[3], odd) & keep};
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(to), "r"(w[0]),
                   "r"(w[1]), "r"(w[2]), "r"(w[3])
                   : "memory");
    }
  }
}

// Rows kDim .. kDstRows - 1 of each of `stages` transposed tiles
// (ByteTile<kDstRows, kKeys>, tiles kDstRows * kKeys bytes apart) set to
// `byte`: the swizzle only moves bytes within a row, so each atom column's
// rows below the dims are one run of bytes. nthreads threads, thread_idx
// among them.
template <int kKeys, int kDim, int kDstRows>
CUTE_HOST_DEVICE void fill_rows_below(uint8_t* dst, int stages, uint8_t byte, int thread_idx, int nthreads) {
  using Dst = ByteTile<kDstRows, kKeys>;
  constexpr int kRunWords = (kDstRows - kDim) * Dst::kWidth / 4;
  constexpr int kRuns = kKeys / Dst::kWidth;
  const uint32_t word = byte * 0x01010101u;
  for (int i = thread_idx; i < stages * kRuns * kRunWords; i += nthreads) {
    const int run = i / kRunWords;  // stage run / kRuns, atom column run % kRuns
    const int offset = (run / kRuns) * (kDstRows * kKeys) + Dst::offset(kDim, (run % kRuns) * Dst::kWidth);
    reinterpret_cast<uint32_t*>(dst + offset)[i % kRunWords] = word;
  }
}

}  // namespace sm90
}  // namespace tfb
