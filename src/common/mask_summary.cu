// The mask pre-pass (mask_summary.h): a warp per tile reads the tile's mask
// 16 keys at a time, packs it into bits (mask.h FromMemory's words: nonzero
// bytes, or additive values other than -inf) and writes the tile's kind.
#include "common/mask_summary.h"

#include <algorithm>

#include "common/mask_values.h"

namespace tfb {
namespace mask {
namespace {

struct SummaryArgs {
  const uint8_t* values;
  int64_t batch_stride, head_stride, row_stride, col_stride;
  int len_q, len_k, tile_m, tile_n;
  SummaryShape shape;
  MaskValues type;
  bool vectors;  // boolean, 16-byte loads: contiguous keys, rows and planes on 16-byte boundaries, len_k % 16 == 0
  uint8_t* kinds;
  uint16_t* bits;  // the bit planes seen as 16-key pieces
  int tile_words;  // 64-bit words per key tile and row
  int* zero;       // set to 0 by the first thread, when given
};

// The four bytes of x as four bits, a bit per nonzero byte, byte 0 lowest.
__device__ __forceinline__ uint32_t nonzero_bytes(uint32_t x) {
  x |= x >> 4;
  x |= x >> 2;
  x |= x >> 1;  // bit 0 of each byte: the OR of its bits
  // The products of bit 8i by 2^(24 - 7i) land on bit 24 + i, the others
  // elsewhere, none carrying.
  return ((x & 0x01010101u) * 0x01020408u) >> 24 & 0xFu;
}

// One tile: lanes take its 16-key pieces in turn, row by row, kBatch at a
// time: all their loads first, then the bits (one load at a time, with 64-bit
// index arithmetic, the pass read masks at 1.9-2.2 TB/s).
// Bits are written for the tile's first write_rows rows (all, or the one row
// of a mask that is the same for every row).
template <bool kVectors>
__device__ __forceinline__ void scan_tile(const SummaryArgs& a, const uint8_t* base, uint16_t* out, int rows,
                                          int write_rows, int cols, int lane, bool& visible, bool& hidden) {
  constexpr int kBatch = 4;
  const int pieces_per_row = a.shape.words * 4;
  const int pieces = (cols + 15) / 16;
  const int items = rows * pieces;  // at most a tile's rows x 16-key pieces
  for (int i0 = lane; i0 < items; i0 += 32 * kBatch) {
    const uint8_t* at[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = min(i0 + 32 * j, items - 1);  // past the end: the last piece again, unused (no branch)
      const int r = i / pieces, c = i - r * pieces;
      at[j] = base + r * a.row_stride + c * 16 * a.col_stride;
    }
    uint32_t b16[kBatch];
    if constexpr (kVectors) {  // len_k and the tile a multiple of 16: whole pieces
      uint4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = __ldg(reinterpret_cast<const uint4*>(at[j]));
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        b16[j] = nonzero_bytes(v[j].x) | nonzero_bytes(v[j].y) << 4 | nonzero_bytes(v[j].z) << 8 |
                 nonzero_bytes(v[j].w) << 12;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = min(i0 + 32 * j, items - 1);
        const int n = min(16, cols - (i % pieces) * 16);
        b16[j] = 0;
        for (int k = 0; k < n; ++k) b16[j] |= uint32_t(__ldg(at[j] + k * a.col_stride) != 0) << k;
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + 32 * j;
      if (i >= items) break;
      const int r = i / pieces, c = i - r * pieces;
      const int n = min(16, cols - c * 16);
      visible |= b16[j] != 0;
      hidden |= b16[j] != (1u << n) - 1;
      if (r < write_rows) out[int64_t(r) * pieces_per_row + c] = uint16_t(b16[j]);
    }
  }
}

// One tile of an additive mask, a 16-key piece per lane at a time: a bit per
// value 0 (the pair keeps its score), and which other values it holds: -inf
// (hidden), values beyond mask_values.h's negative limit (floored), others
// (additive: such a tile reads the values themselves).
template <MaskValues kType>
__device__ __forceinline__ void scan_tile_values(const SummaryArgs& a, const uint8_t* base, uint16_t* out, int rows,
                                                 int write_rows, int cols, int lane, bool& visible, bool& hidden,
                                                 bool& floored, bool& additive) {
  const int pieces_per_row = a.shape.words * 4;
  const int pieces = (cols + 15) / 16;
  const int items = rows * pieces;
  for (int i = lane; i < items; i += 32) {
    const int r = i / pieces, c = i - r * pieces;
    const int n = min(16, cols - c * 16);
    const uint8_t* at = base + r * a.row_stride + c * 16 * a.col_stride;
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = k < n ? load_value<kType>(at + k * a.col_stride) : 0.f;
    uint32_t b16 = 0;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const bool in = k < n, zero = v[k] == 0.f, minus_inf = v[k] == -INFINITY;
      const bool low = v[k] < 0.f && beyond_limit(v[k]);
      b16 |= uint32_t(in && zero) << k;
      hidden |= in && minus_inf;
      floored |= in && low;
      additive |= in && !zero && !minus_inf && !low;  // NaN too
    }
    visible |= b16 != 0;
    if (r < write_rows) out[int64_t(r) * pieces_per_row + c] = uint16_t(b16);
  }
}

__global__ void __launch_bounds__(256) summarize_kernel(const SummaryArgs a) {
  if (a.zero != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *a.zero = 0;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t tiles = a.shape.tiles();
  const int pieces_per_row = a.shape.words * 4;
  for (int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; t < tiles; t += warps) {
    const int n_block = int(t % a.shape.n_blocks);
    const int m_block = int(t / a.shape.n_blocks % a.shape.m_blocks);
    const int64_t plane = t / (int64_t(a.shape.n_blocks) * a.shape.m_blocks);
    const int ph = int(plane % a.shape.planes_h), pb = int(plane / a.shape.planes_h);
    const int row0 = m_block * a.tile_m, col0 = n_block * a.tile_n;
    const int rows = min(a.tile_m, a.len_q - row0), cols = min(a.tile_n, a.len_k - col0);
    const uint8_t* base = a.values + pb * a.batch_stride + ph * a.head_stride + row0 * a.row_stride + col0 * a.col_stride;
    // Key tile n_block's words in each row: 4 pieces of 16 keys per word.
    const bool one_row = a.shape.bit_rows == 1;  // a mask the same for every row keeps row 0's bits
    uint16_t* out = a.bits + (plane * a.shape.bit_rows + (one_row ? 0 : row0)) * pieces_per_row +
                    n_block * a.tile_words * 4;
    const int write_rows = one_row ? (m_block == 0 ? 1 : 0) : rows;
    // A mask the same for every row: its first row says the tile's kind.
    const int scan_rows = a.row_stride == 0 ? 1 : rows;
    bool visible = false, hidden = false, floored = false, additive = false;
    if (a.type != MaskValues::kBool) {
      with_value_type(a.type, [&](auto type) {
        scan_tile_values<decltype(type)::value>(a, base, out, scan_rows, write_rows, cols, lane, visible, hidden,
                                                floored, additive);
      });
    } else if (a.vectors) {
      scan_tile<true>(a, base, out, scan_rows, write_rows, cols, lane, visible, hidden);
    } else {
      scan_tile<false>(a, base, out, scan_rows, write_rows, cols, lane, visible, hidden);
    }
    visible = __any_sync(0xffffffffu, visible);
    hidden = __any_sync(0xffffffffu, hidden);
    floored = __any_sync(0xffffffffu, floored);
    additive = __any_sync(0xffffffffu, additive);
    if (lane == 0) {  // one bit per pair cannot tell -inf from the limit: a tile of both reads its values
      a.kinds[t] = uint8_t(additive || (floored && hidden) ? TileKind::kAdditive
                           : floored                       ? TileKind::kFloored
                           : hidden                        ? (visible ? TileKind::kMixed : TileKind::kHidden)
                                                           : TileKind::kVisible);
    }
  }
}

}  // namespace

cudaError_t summarize(AttnFwdParams& p, int tile_m, int tile_n, void* scratch, cudaStream_t stream, int* zero) {
  if (tile_n % 16 != 0) return cudaErrorInvalidValue;
  MaskArgs& m = p.mask;
  const SummaryShape shape = summary_shape(p, tile_m, tile_n);
  uint8_t* kinds = static_cast<uint8_t*>(scratch);
  uint64_t* bits = reinterpret_cast<uint64_t*>(kinds + shape.kinds_bytes());
  SummaryArgs a{m.values, m.values_batch_stride, m.values_head_stride, m.values_row_stride, m.values_col_stride,
                p.len_q, p.len_k, tile_m, tile_n, shape, m.values_type, false, kinds,
                reinterpret_cast<uint16_t*>(bits), FromMemory::tile_words(tile_n), zero};
  a.vectors = a.type == MaskValues::kBool && a.col_stride == 1 && reinterpret_cast<uintptr_t>(a.values) % 16 == 0 && a.row_stride % 16 == 0 &&
              a.batch_stride % 16 == 0 && a.head_stride % 16 == 0 && p.len_k % 16 == 0;
  const int64_t blocks = std::min<int64_t>((shape.tiles() + 7) / 8, int64_t(1) << 20);
  summarize_kernel<<<unsigned(blocks), 256, 0, stream>>>(a);
  const int64_t kinds_plane = int64_t(shape.m_blocks) * shape.n_blocks;
  const int64_t bits_plane = int64_t(shape.bit_rows) * shape.words;
  m.tile_kinds = kinds;
  m.tile_kinds_n_blocks = shape.n_blocks;
  m.tile_kinds_head_stride = shape.planes_h == 1 ? 0 : kinds_plane;
  m.tile_kinds_batch_stride = shape.planes_b == 1 ? 0 : kinds_plane * shape.planes_h;
  m.tile_keys = tile_n;
  m.bits = bits;
  m.bits_words = shape.bit_rows == 1 ? 0 : shape.words;  // row stride: 0 repeats row 0's bits
  m.bits_head_stride = shape.planes_h == 1 ? 0 : bits_plane;
  m.bits_batch_stride = shape.planes_b == 1 ? 0 : bits_plane * shape.planes_h;
  return cudaGetLastError();
}

}  // namespace mask
}  // namespace tfb
