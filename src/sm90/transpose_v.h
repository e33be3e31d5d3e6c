// FP8's V transpose: FP8 wgmma reads its B operand K-major, so P V wants V
// with the keys contiguous, while TMA lands V's tiles with the head dim
// contiguous. The producer warpgroup rewrites each landed tile into a second
// ring, 4 keys x 4 dims per thread step: four 32-bit loads, a byte
// transpose in registers (__byte_perm), four 32-bit stores.
//
// The keys go in the order P's registers hold them. An accumulator gives a
// thread, per row and 16 keys, columns {2t, 2t+1, 2t+8, 2t+9} (t its lane
// in the quad), and an 8-bit A operand wants 4 consecutive k from each lane:
// so P's registers are used as they are, and position 4t + i of each 16 keys
// of the transposed tile holds key key_of_position(i) + 2t (the sum over k
// does not care about its order).
//
// Lanes: 4 (t) x 8 (head-dim words); a store's row is rotated per lane pair
// so that the 32 stores of a warp fall in 32 banks under the 128- and
// 64-byte swizzles (unrotated, 8 lanes shared a bank). Addresses are byte
// offsets worked out once per thread: the swizzle (an XOR of a row's bits
// into its 16-byte column) commutes with the steps' constant offsets, so a
// step costs an add or an XOR per access (through CuTe's layouts the
// address arithmetic outweighed the transpose itself).
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

// src: a (kKeys, kDim) tile as TMA landed it (ByteTile<kKeys, kDim>); dst:
// its (kDim, kKeys) transposed copy (ByteTile<kDim, kKeys>). Keys at or past
// `keys` are written as zeros (a packed tile's rows of the next sequence).
// 128 threads (a warpgroup), thread_idx among them.
template <int kKeys, int kDim>
CUTE_DEVICE void transpose_v_tile(uint8_t const* src, uint8_t* dst, int keys, int thread_idx) {
  using Src = ByteTile<kKeys, kDim>;
  using Dst = ByteTile<kDim, kKeys>;
  static_assert(kKeys % 64 == 0 && kDim % 32 == 0);
  constexpr int kGroupsPerWarp = kKeys / 16 / 4;  // 16-key groups: warp w takes w, w + 4, ...
  const int lane = thread_idx % 32, warp = thread_idx / 32;
  const int t = lane % 4, word = lane / 4;
  const int rot = (word >> 1) & 3;  // rotation of this lane's four output rows

  // Step (group g, 32-dim block b): loads at src_row[i] + g 16-row offset,
  // the column XORed with the block's; stores at dst_row[j] + the block's
  // rows, the column XORed with the group's.
  int src_row[4], dst_row[4], dst_xor[4];
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    src_row[i] = Src::offset(2 * t + key_of_position(i), 4 * word);
    const int d = 4 * word + ((i + rot) & 3);
    dst_row[i] = d * Dst::kWidth + 4 * t;
    dst_xor[i] = Dst::offset(d, 0) - d * Dst::kWidth;  // the row's swizzle of its 16-byte columns
  }
  CUTE_UNROLL
  for (int gi = 0; gi < kGroupsPerWarp; ++gi) {
    const int group = warp + 4 * gi;
    const int key0 = group * 16 + 2 * t;
    CUTE_UNROLL
    for (int b = 0; b < kDim / 32; ++b) {
      constexpr int kBlocksPerAtom = Src::kWidth / 32;
      uint32_t in[4];
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int at = (b / kBlocksPerAtom) * (kKeys * Src::kWidth) + group * 16 * Src::kWidth +
                       (src_row[i] ^ ((b % kBlocksPerAtom) * 32));
        in[i] = key0 + key_of_position(i) < keys ? *reinterpret_cast<uint32_t const*>(src + at) : 0u;
        // Rotated by rot bytes: out[j] below is then dim + (j + rot) % 4.
        in[i] = __funnelshift_r(in[i], in[i], 8 * rot);
      }
      const uint32_t lo01 = __byte_perm(in[0], in[1], 0x5140), hi01 = __byte_perm(in[0], in[1], 0x7362);
      const uint32_t lo23 = __byte_perm(in[2], in[3], 0x5140), hi23 = __byte_perm(in[2], in[3], 0x7362);
      const uint32_t out[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                               __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const int col = group * 16;  // of this lane's 4 keys, less 4t
        const int at = (col / Dst::kWidth) * (kDim * Dst::kWidth) + b * 32 * Dst::kWidth + dst_row[j] +
                       ((col % Dst::kWidth) ^ dst_xor[j]);
        *reinterpret_cast<uint32_t*>(dst + at) = out[j];
      }
    }
  }
}

}  // namespace sm90
}  // namespace tfb
