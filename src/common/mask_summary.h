// Masks read from memory (attn_mask), seen by the tiled kernels: the pre-pass
// that classifies each (query tile, key tile) as all visible, all hidden or
// mixed (mask.h TileKind), and the per-(batch, head) policy the kernels build.
//
// Every family that reads a mask runs summarize() for its own tile shape
// before its main kernel, into its workspace; the main kernel then skips the
// hidden tiles (no loads, no MMAs) and reads the mask, packed a bit per score
// by the same pre-pass, in mixed tiles alone. The pre-pass reads the mask once
// per plane it varies over: a mask broadcast over batch or heads (stride 0)
// is summarised once.
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
  int bit_rows, words;     // the bit planes: rows of `words` 64-bit words (FromMemory); one row
                           // when the mask is the same for every row (row stride 0, a padding mask)
  TFB_HOST_DEVICE int64_t planes() const { return int64_t(planes_b) * planes_h; }
  TFB_HOST_DEVICE int64_t tiles() const { return planes() * m_blocks * n_blocks; }
  TFB_HOST_DEVICE int64_t words_total() const { return planes() * bit_rows * words; }
  // Tile kinds first, padded to 16 bytes, then the bit planes.
  size_t kinds_bytes() const { return size_t(tiles() + 15) / 16 * 16; }
  size_t bytes() const { return kinds_bytes() + size_t(words_total()) * sizeof(uint64_t); }
};

// tile_n: a multiple of 16 (the pre-pass packs 16 keys at a time).
inline SummaryShape summary_shape(const AttnFwdParams& p, int tile_m, int tile_n) {
  return {p.mask.values_batch_stride == 0 ? 1 : p.batch, p.mask.values_head_stride == 0 ? 1 : p.heads_q,
          (p.len_q + tile_m - 1) / tile_m, (p.len_k + tile_n - 1) / tile_n,
          p.mask.values_row_stride == 0 ? 1 : p.len_q,
          (p.len_k + tile_n - 1) / tile_n * FromMemory::tile_words(tile_n)};
}

// Scratch the summary takes (0 without a mask), a multiple of 16 bytes so
// that a workspace carved after it stays aligned.
inline size_t summary_bytes(const AttnFwdParams& p, int tile_m, int tile_n) {
  if (!p.mask.in_memory()) return 0;
  return summary_shape(p, tile_m, tile_n).bytes();
}

// Writes the summary for tiles of tile_m x tile_n (tile_n a multiple of 16)
// into `scratch` (summary_bytes of it, 16-byte aligned) and points
// p.mask.tile_kinds, p.mask.bits and their strides at it. zero: an int the
// pre-pass sets to 0 on the way (a main kernel's counter; saves a launch).
cudaError_t summarize(AttnFwdParams& p, int tile_m, int tile_n, void* scratch, cudaStream_t stream,
                      int* zero = nullptr);

// Batch b, query head h's mask, for a kernel whose tiles summarize() saw
// (Policy: FromMemory or FromMemoryAdditive).
template <class Policy = FromMemory>
TFB_HOST_DEVICE Policy from_memory(const MaskArgs& m, int b, int h, int len_q, int len_k) {
  return {len_q,
          len_k,
          m.tile_kinds + b * m.tile_kinds_batch_stride + h * m.tile_kinds_head_stride,
          m.tile_kinds_n_blocks,
          m.bits + b * m.bits_batch_stride + h * m.bits_head_stride,
          m.bits_words,
          m.tile_keys,
          m.values + b * m.values_batch_stride + h * m.values_head_stride,
          m.values_row_stride,
          m.values_col_stride,
          m.values_type,
          m.values_scale};
}
template <class Policy = FromMemory>
TFB_HOST_DEVICE Policy from_memory(const AttnFwdParams& p, int b, int h, int len_q, int len_k) {
  return from_memory<Policy>(p.mask, b, h, len_q, len_k);
}

// The policy a kernel built for Policy reads for batch b, query head h: the
// band, or the mask in memory.
template <class Policy>
TFB_HOST_DEVICE Policy policy_of(const AttnFwdParams& p, int b, int h, int len_q, int len_k) {
  if constexpr (kReadsMemory<Policy>) {
    return from_memory<Policy>(p, b, h, len_q, len_k);
  } else {
    return band_of(p.mask, len_q, len_k);
  }
}

// Every launcher's one way from the mask mode to a kernel: launch(policy,
// params) with a Band (no mask, a band), or, for a mask in memory, after the
// pre-pass has summarised it for tiles of tile_m x tile_n into scratch
// (summary_bytes of it; zero: as summarize's), with FromMemory or
// FromMemoryAdditive and params pointing at the summary. The policy is a
// value-initialised tag: launch reads its type.
template <class Params, class Launch>
cudaError_t with_policy(const Params& p, int tile_m, int tile_n, void* scratch, cudaStream_t stream,
                        Launch&& launch, int* zero = nullptr) {
  if (!p.mask.in_memory()) return launch(Band{}, p);
  if (scratch == nullptr) return cudaErrorInvalidValue;
  Params summarised = p;
  const cudaError_t err = summarize(summarised, tile_m, tile_n, scratch, stream, zero);
  if (err != cudaSuccess) return err;
  if (p.mask.mode == MaskMode::kAdditive) return launch(FromMemoryAdditive{}, summarised);
  return launch(FromMemory{}, summarised);
}

}  // namespace mask
}  // namespace tfb
