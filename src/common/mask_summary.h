// Masks read from memory (attn_mask), seen by the tiled kernels: the pre-pass
// that classifies each (query tile, key tile) as all visible, all hidden or
// mixed (mask.h TileKind), and the per-(batch, head) policy the kernels build.
//
// Every family that reads a mask runs summarize() for its own tile shape
// before its main kernel, into its workspace; the main kernel then skips the
// hidden tiles (no loads, no MMAs) and reads the mask's bytes in mixed tiles
// alone. The pre-pass reads the mask once per plane it varies over: a mask
// broadcast over batch or heads (stride 0) is summarised once.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/mask.h"
#include "params.h"

namespace tfb {
namespace mask {

struct SummaryShape {
  int planes_b, planes_h;  // 1 where the mask broadcasts (stride 0), else batch / q heads
  int m_blocks, n_blocks;
  TFB_HOST_DEVICE size_t bytes() const { return size_t(planes_b) * planes_h * m_blocks * n_blocks; }
};

inline SummaryShape summary_shape(const AttnFwdParams& p, int tile_m, int tile_n) {
  return {p.mask.values_batch_stride == 0 ? 1 : p.batch, p.mask.values_head_stride == 0 ? 1 : p.heads_q,
          (p.len_q + tile_m - 1) / tile_m, (p.len_k + tile_n - 1) / tile_n};
}

// Scratch the summary takes (0 without a mask), a multiple of 16 bytes so
// that a workspace carved after it stays aligned.
inline size_t summary_bytes(const AttnFwdParams& p, int tile_m, int tile_n) {
  if (p.mask.values == nullptr) return 0;
  return (summary_shape(p, tile_m, tile_n).bytes() + 15) / 16 * 16;
}

// Writes the summary for tiles of tile_m x tile_n into `kinds` (summary_bytes
// of scratch) and points p.mask.tile_kinds and its strides at it.
cudaError_t summarize(AttnFwdParams& p, int tile_m, int tile_n, uint8_t* kinds, cudaStream_t stream);

// Batch b, query head h's mask, for a kernel whose tiles summarize() saw.
TFB_HOST_DEVICE FromMemory from_memory(const AttnFwdParams& p, int b, int h, int len_q, int len_k) {
  const MaskArgs& m = p.mask;
  return {len_q,
          len_k,
          m.tile_kinds + b * m.tile_kinds_batch_stride + h * m.tile_kinds_head_stride,
          m.tile_kinds_n_blocks,
          m.values + b * m.values_batch_stride + h * m.values_head_stride,
          m.values_row_stride,
          m.values_col_stride};
}

// The policy a kernel built for Policy reads for batch b, query head h: the
// is_causal band, or the mask in memory.
template <class Policy>
TFB_HOST_DEVICE Policy policy_of(const AttnFwdParams& p, int b, int h, int len_q, int len_k) {
  if constexpr (kReadsMemory<Policy>) {
    return from_memory(p, b, h, len_q, len_k);
  } else {
    return causal_if(p.is_causal, len_q, len_k);
  }
}

}  // namespace mask
}  // namespace tfb
