// The decode family's host side that needs no kernel code: whether it can
// serve a call, its split count and workspace, and the launcher's declaration
// (its body is in launch_fwd.h, instantiated per (dtype, head dim) in
// instantiations/*.cu).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/mask.h"
#include "kernel_info.h"
#include "decode/config.h"
#include "params.h"

namespace tfb::decode {

// Rows a CTA serves: the group's query heads times the query positions.
inline int rows_per_kv_head(const AttnFwdParams& p) { return p.heads_q / p.heads_kv * p.len_q; }

inline bool masked(const AttnFwdParams& p) { return p.mask.in_memory(); }

inline bool fits(const AttnFwdParams& p) {
  // A band's left edge (a window) is not read here; the pre-pass's tile
  // summary neither (the kernel reads attn_mask itself).
  const bool mask_ok = (p.mask.mode != MaskMode::kBand || p.mask.window_left < 0) &&
                       (!masked(p) || p.len_k <= int64_t(kMaxSplits) * kMaxMaskedSplitKeys);
  // Per-batch lengths: keys in use (seqused_k), or a packed batch (both
  // offsets), read through params.h's accessors; not beside a mask in memory.
  const bool lengths_ok = !p.seqlens.cu_q == !p.seqlens.cu_k && (!masked(p) || (!p.seqlens.cu_q && !p.seqlens.used_k));
  // Its loads and stores move whole rows of the kernel's head dim (the family does not pad).
  const bool dims_ok = p.qk_dim == p.head_dim && p.v_dim == p.head_dim;
  return mask_ok && lengths_ok && dims_ok && p.heads_kv > 0 && p.heads_q % p.heads_kv == 0 && p.len_q >= 1 &&
         p.len_q <= kMaxQueryLen && p.len_k >= 1 && p.batch >= 1 && rows_per_kv_head(p) <= kMaxRows &&
         p.heads_kv <= 65535 && p.batch <= 65535 &&
         int64_t(p.batch) * p.heads_q * p.len_q <= 0x7fffffff;  // the combine's grid: a CTA per query row
}

// Splits so that the CTAs fill the GPU's CTA slots about once (a second,
// partial wave would leave SMs idle at the end), or about half of them for a
// single query token without a mask, each with at least kMinSplitKeys keys
// and a whole number of tiles; masked calls at most kMaxMaskedSplitKeys keys
// each. Half for single tokens: on an H200 (benchmarks/history/
// 2026-11-29-decode-small-calls.md) fewer, longer splits cost less in the
// combine and in each CTA's fixed start and merge than the SMs they leave
// idle (B 1, GQA 8, S 4K, E 256: 12.9 against 16.2 µs); longer queries and
// masked calls keep the full wave until measured. (Twice as many splits for
// masked calls, so that a cache's used part spreads over more SMs, measured
// slower: a second wave of CTAs at 1K keys, 29 against 19 µs.)
// The calls the half-slot rule below is measured on: one query token, no mask in memory.
inline bool single_token(const AttnFwdParams& p) { return p.len_q == 1 && !masked(p); }

inline Splits splits_for(const AttnFwdParams& p) {
  const int keys = mask::band_of(p.mask, p.len_q, p.len_k).key_end(p.len_q - 1);
  const int64_t ctas = int64_t(p.batch) * p.heads_kv * Rows{rows_per_kv_head(p), 1}.tiles();
  const int64_t slots = int64_t(std::max(p.num_sms, 1)) * ctas_per_sm(p.head_dim, masked(p));
  const int64_t fill = single_token(p) ? slots / 2 : slots;
  int64_t wanted = std::max<int64_t>(1, fill / ctas);
  if (masked(p)) wanted = std::max<int64_t>(wanted, (keys + kMaxMaskedSplitKeys - 1) / kMaxMaskedSplitKeys);
  const int most = (keys + kMinSplitKeys - 1) / kMinSplitKeys;
  const int count = int(std::clamp<int64_t>(wanted, 1, std::min(most, kMaxSplits)));
  const int chunk = ((keys + count - 1) / count + kTileKeys - 1) / kTileKeys * kTileKeys;
  return {(keys + chunk - 1) / chunk, chunk};
}

inline size_t workspace_bytes(const AttnFwdParams& p) {
  if (!fits(p)) return 0;
  const Splits s = splits_for(p);
  if (s.count == 1) return 0;
  return size_t(s.count) * p.batch * p.heads_q * p.len_q * (p.head_dim + 1) * sizeof(float);
}

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream);

// The tile its mask walk skips by (kernel_info.h): a CTA's 16 group-packed
// rows by a warp's 16-key tile.
template <typename Element, int kHeadDim>
TileShape fwd_tile() {
  return {kTileRows, kTileKeys};
}

}  // namespace tfb::decode
