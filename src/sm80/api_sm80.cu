// The sm80 family's entry points: every head dim, forward and backward.
#include <algorithm>

#include "api.h"
#include "common/mask_summary.h"
#include "dispatch.h"
#include "kernel_info.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/kernel_traits_fwd.h"
#include "sm80/launch.h"

namespace tfb {
namespace sm80 {
namespace {

template <typename Fn>
bool visit_fwd(DType dtype, int head_dim, Fn&& fn) {
  return visit_instantiation<TFB_SM80_FWD_HEAD_DIMS>(dtype, head_dim, fn);
}

template <typename Fn>
bool visit_bwd(DType dtype, int head_dim, Fn&& fn) {
  return visit_instantiation<TFB_SM80_BWD_HEAD_DIMS>(dtype, head_dim, fn);
}

}  // namespace

bool has_fwd(DType dtype, int head_dim) { return visit_fwd(dtype, head_dim, [](auto, auto) {}); }
bool has_bwd(DType dtype, int head_dim) { return visit_bwd(dtype, head_dim, [](auto, auto) {}); }

size_t smem_bytes_fwd(DType dtype, int head_dim) {
  size_t bytes = 0;
  visit_fwd(dtype, head_dim, [&](auto element, auto d) {
    bytes = FwdConfig<decltype(element), decltype(d)::value>::Traits::kSmemBytes;
  });
  return bytes;
}

size_t smem_bytes_bwd(DType dtype, int head_dim) {
  size_t bytes = 0;
  visit_bwd(dtype, head_dim, [&](auto element, auto d) {
    bytes = bwd::BwdConfig<decltype(element), decltype(d)::value>::SmallSmem::kSmemBytes;
  });
  return bytes;
}

// The launchers' own (launch_fwd.h / launch_bwd.h fwd_tile, bwd_tile).
TileShape tile_fwd(DType dtype, int head_dim) {
  TileShape tile;
  visit_fwd(dtype, head_dim, [&](auto element, auto d) { tile = fwd_tile<decltype(element), decltype(d)::value>(); });
  return tile;
}

TileShape tile_bwd(DType dtype, int head_dim) {
  TileShape tile;
  visit_bwd(dtype, head_dim, [&](auto element, auto d) { tile = bwd_tile<decltype(element), decltype(d)::value>(); });
  return tile;
}

cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream) {
  return launch_instantiation<TFB_SM80_FWD_HEAD_DIMS>(dtype, params.head_dim, [&](auto element, auto head_dim) {
    return launch_fwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
}

// Per-batch lengths (a packed batch) with a band or none: a mask in memory is
// summarised per (batch, head) over uniform lengths.
bool per_batch_lengths(const AttnFwdParams& p) { return p.seqlens.cu_q || p.seqlens.cu_k || p.seqlens.used_k; }
bool can_run_fwd(const AttnFwdParams& p) { return !per_batch_lengths(p) || !p.mask.in_memory(); }
bool can_run_bwd(const AttnBwdParams& p) { return can_run_fwd(p); }

// attn_mask's tile summary (common/mask_summary.h) for the pass's tiles; the
// backward's follows its accumulators.
size_t fwd_workspace_bytes(const AttnFwdParams& params) {
  size_t bytes = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const TileShape tile = tile_fwd(dtype, params.head_dim);
    if (tile.rows > 0) bytes = std::max(bytes, mask::summary_bytes(params, tile.rows, tile.keys));
  }
  return bytes;
}

size_t bwd_workspace_bytes(const AttnBwdParams& params) {
  size_t bytes = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    visit_bwd(dtype, params.head_dim, [&](auto element, auto d) {
      using Config = bwd::BwdConfig<decltype(element), decltype(d)::value>;
      for (size_t b : {mask::summary_bytes(params, Config::Traits::kBlockM, Config::Traits::kBlockN),
                       mask::summary_bytes(params, Config::SmallSmem::kBlockM, Config::SmallSmem::kBlockN)}) {
        bytes = std::max(bytes, b);
      }
    });
  }
  return bwd_workspace_bytes_impl(params) + bytes;
}

cudaError_t run_bwd(const AttnBwdParams& params, DType dtype, cudaStream_t stream) {
  return launch_instantiation<TFB_SM80_BWD_HEAD_DIMS>(dtype, params.head_dim, [&](auto element, auto head_dim) {
    return launch_bwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
}

}  // namespace sm80
}  // namespace tfb
