// The mask pre-pass (mask_summary.h): a warp per tile reads the tile's mask
// bytes and writes its TileKind.
#include "common/mask_summary.h"

#include <algorithm>

namespace tfb {
namespace mask {
namespace {

struct SummaryArgs {
  const uint8_t* values;
  int64_t batch_stride, head_stride, row_stride, col_stride;
  int len_q, len_k, tile_m, tile_n;
  SummaryShape shape;
  bool vectors;  // 16-byte loads: contiguous keys, rows and tiles on 16-byte boundaries
  uint8_t* kinds;
};

// Whether a 32-bit word of mask bytes has a zero byte / a nonzero byte.
__device__ __forceinline__ bool has_zero_byte(uint32_t w) { return ((w - 0x01010101u) & ~w & 0x80808080u) != 0; }

__global__ void __launch_bounds__(256) summarize_kernel(const SummaryArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t tiles = int64_t(a.shape.bytes());
  for (int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; t < tiles; t += warps) {
    const int n_block = int(t % a.shape.n_blocks);
    const int m_block = int(t / a.shape.n_blocks % a.shape.m_blocks);
    const int64_t plane = t / (int64_t(a.shape.n_blocks) * a.shape.m_blocks);
    const int ph = int(plane % a.shape.planes_h), pb = int(plane / a.shape.planes_h);
    const int row0 = m_block * a.tile_m, col0 = n_block * a.tile_n;
    const int rows = min(a.tile_m, a.len_q - row0), cols = min(a.tile_n, a.len_k - col0);
    const uint8_t* base = a.values + pb * a.batch_stride + ph * a.head_stride + row0 * a.row_stride + col0 * a.col_stride;
    // Lanes take items (16 keys of a row with vectors, else one) in turn;
    // the warp stops once it has seen both kinds (a random mask: at once).
    const int per_row = a.vectors ? cols / 16 : cols;  // vectors: len_k and tile_n are multiples of 16
    const int64_t items = int64_t(rows) * per_row;
    bool visible = false, hidden = false;
    for (int64_t i0 = 0; i0 < items; i0 += 32) {
      const int64_t i = i0 + lane;
      if (i < items) {
        const uint8_t* at = base + (i / per_row) * a.row_stride;
        if (a.vectors) {
          const uint4 v = *reinterpret_cast<const uint4*>(at + (i % per_row) * 16);
          visible |= (v.x | v.y | v.z | v.w) != 0;
          hidden |= has_zero_byte(v.x) || has_zero_byte(v.y) || has_zero_byte(v.z) || has_zero_byte(v.w);
        } else {
          const bool v = at[(i % per_row) * a.col_stride] != 0;
          visible |= v;
          hidden |= !v;
        }
      }
      if (__any_sync(0xffffffffu, visible) && __any_sync(0xffffffffu, hidden)) break;
    }
    visible = __any_sync(0xffffffffu, visible);
    hidden = __any_sync(0xffffffffu, hidden);
    if (lane == 0) {
      a.kinds[t] = uint8_t(hidden ? (visible ? TileKind::kMixed : TileKind::kHidden) : TileKind::kVisible);
    }
  }
}

}  // namespace

cudaError_t summarize(AttnFwdParams& p, int tile_m, int tile_n, uint8_t* kinds, cudaStream_t stream) {
  MaskArgs& m = p.mask;
  SummaryArgs a{m.values, m.values_batch_stride, m.values_head_stride, m.values_row_stride, m.values_col_stride,
                p.len_q, p.len_k, tile_m, tile_n, summary_shape(p, tile_m, tile_n), false, kinds};
  a.vectors = a.col_stride == 1 && reinterpret_cast<uintptr_t>(a.values) % 16 == 0 && a.row_stride % 16 == 0 &&
              a.batch_stride % 16 == 0 && a.head_stride % 16 == 0 && p.len_k % 16 == 0 && tile_n % 16 == 0;
  const int64_t tiles = int64_t(a.shape.bytes());
  const int64_t blocks = std::min<int64_t>((tiles + 7) / 8, int64_t(1) << 20);
  summarize_kernel<<<unsigned(blocks), 256, 0, stream>>>(a);
  m.tile_kinds = kinds;
  m.tile_kinds_n_blocks = a.shape.n_blocks;
  const int64_t plane = int64_t(a.shape.m_blocks) * a.shape.n_blocks;
  m.tile_kinds_head_stride = a.shape.planes_h == 1 ? 0 : plane;
  m.tile_kinds_batch_stride = a.shape.planes_b == 1 ? 0 : plane * a.shape.planes_h;
  return cudaGetLastError();
}

}  // namespace mask
}  // namespace tfb
