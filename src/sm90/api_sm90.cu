// Runtime (dtype, head dim) -> compiled sm90 instantiation. Compiled like the
// rest of the library (no sm_90a code here), so it only names the launchers.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "api.h"
#include "dispatch.h"
#include "kernel_info.h"
#include "common/mask_summary.h"
#include "common/tile_list.h"
#include "common/workspace_bwd.h"
#include "sm90/launch.h"

namespace tfb {
namespace sm90 {
namespace {

template <typename Fn>
bool visit(DType dtype, int head_dim, Fn&& fn) {
#ifdef TFB_WITH_SM90  // the family can be left out of a build (TFB_BUILD_SM90=0)
  if (dtype == DType::kFloat8E4M3) return visit_fp8_instantiation<TFB_SM90_FWD_FP8_HEAD_DIMS>(head_dim, fn);
  return visit_instantiation<TFB_SM90_FWD_HEAD_DIMS>(dtype, head_dim, fn);
#else
  (void)dtype, (void)head_dim, (void)fn;
  return false;
#endif
}

template <typename Fn>
bool visit_bwd(DType dtype, int head_dim, Fn&& fn) {
#ifdef TFB_WITH_SM90
  return visit_instantiation<TFB_SM90_BWD_HEAD_DIMS>(dtype, head_dim, fn);
#else
  (void)dtype, (void)head_dim, (void)fn;
  return false;
#endif
}

// The registry's align_bytes (16: TMA's address and stride rule).
constexpr int kAlignBytes = TFB_SM90_ALIGN_BYTES;

bool aligned(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % kAlignBytes == 0; }

// TMA strides are in bytes and must be multiples of kAlignBytes (in elements
// of `bytes`, kAlignBytes / bytes). A dim of size 1 is never stepped along:
// the launcher replaces its stride. Stride 0 (a broadcast made with expand) is left to sm80.
bool stride_ok(int64_t stride, int size, int bytes) {
  return size <= 1 || (stride > 0 && stride % (kAlignBytes / bytes) == 0);
}

// bytes: the elements' size (params.h element_bytes; O's is always 2).
bool strides_ok(const AttnFwdParams& p, int64_t batch, int64_t head, int64_t row, int heads, int rows,
                int bytes = 2) {
  return stride_ok(batch, p.batch, bytes) && stride_ok(head, heads, bytes) && stride_ok(row, rows, bytes);
}

}  // namespace

bool has_fwd(DType dtype, int head_dim) { return visit(dtype, head_dim, [](auto, auto) {}); }
bool has_bwd(DType dtype, int head_dim) { return visit_bwd(dtype, head_dim, [](auto, auto) {}); }

// The family runs on compute capability 9.0 alone, whose 227 KB a block every
// configuration fits (its launcher sets the size); the router needs no number.
size_t smem_bytes_fwd(DType, int) { return 0; }
size_t smem_bytes_bwd(DType, int) { return 0; }
TileShape tile_fwd(DType dtype, int head_dim) {
  TileShape tile;
  visit(dtype, head_dim, [&](auto element, auto d) { tile = fwd_tile<decltype(element), decltype(d)::value>(); });
  return tile;
}
TileShape tile_bwd(DType dtype, int head_dim) {
  TileShape tile;
  visit_bwd(dtype, head_dim, [&](auto element, auto d) { tile = bwd_tile<decltype(element), decltype(d)::value>(); });
  return tile;
}

namespace {

// The layouts both passes read; per-batch lengths aside.
bool layout_ok(const AttnFwdParams& p) {
  return aligned(p.q) && aligned(p.k) && aligned(p.v) && aligned(p.o) &&
         strides_ok(p, p.q_batch_stride, p.q_head_stride, p.q_row_stride, p.heads_q, p.len_q, p.element_bytes) &&
         strides_ok(p, p.k_batch_stride, p.k_head_stride, p.k_row_stride, p.heads_kv, p.len_k, p.element_bytes) &&
         strides_ok(p, p.v_batch_stride, p.v_head_stride, p.v_row_stride, p.heads_kv, p.len_k, p.element_bytes) &&
         strides_ok(p, p.o_batch_stride, p.o_head_stride, p.o_row_stride, p.heads_q, p.len_q);
}

bool per_batch_lengths(const AttnFwdParams& p) { return p.seqlens.cu_q || p.seqlens.cu_k || p.seqlens.used_k; }

// The smallest of a pass's tile sides (TileShape::rows or ::keys) over the
// dtypes (FP8's too) built for this head dim, whose tile list is the longest (0: none built).
int smallest_side(TileShape (*tile_of)(DType, int), int TileShape::*side, int head_dim) {
  int smallest = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
    const int n = tile_of(dtype, head_dim).*side;
    if (n > 0 && (smallest == 0 || n < smallest)) smallest = n;
  }
  return smallest;
}
int smallest_fwd_rows(int head_dim) { return smallest_side(&tile_fwd, &TileShape::rows, head_dim); }

// A packed batch has both offsets (and seqused_k, maybe); lengths per batch
// without offsets (seqused_k alone) are not one.
bool packed(const AttnFwdParams& p) { return p.seqlens.cu_q && p.seqlens.cu_k; }

}  // namespace

// The forward reads a packed batch from a tile list (common/tile_list.h)
// whose positions must fit an int.
bool can_run_fwd(const AttnFwdParams& p) {
  if (per_batch_lengths(p)) {
    const int rows = smallest_fwd_rows(p.head_dim);
    if (!packed(p) || rows == 0 || tile_list_capacity(p, rows, TileAxis::kQueries) > INT_MAX / 2 - 4096) return false;
  }
  return layout_ok(p);
}

// attn_mask's tile summary (common/mask_summary.h) for the forward's tiles,
// then the dynamic scheduler's counter (launch.h); a packed batch's tile list.
size_t fwd_workspace_bytes(const AttnFwdParams& params) {
  if (params.seqlens.cu_q) {
    const int rows = smallest_fwd_rows(params.head_dim);
    return rows == 0 ? 0 : tile_list_bytes(params, rows, TileAxis::kQueries);
  }
  size_t bytes = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const TileShape tile = tile_fwd(dtype, params.head_dim);
    if (tile.rows > 0) bytes = std::max(bytes, mask::summary_bytes(params, tile.rows, tile.keys));
  }
  return bytes == 0 ? 0 : bytes + kUnitCounterBytes;
}

cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream) {
  cudaError_t err = cudaErrorNotSupported;
  visit(dtype, params.head_dim, [&](auto element, auto head_dim) {
    err = launch_fwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
  return err;
}

}  // namespace sm90
}  // namespace tfb

namespace tfb {
namespace sm90 {

// The backward loads Q, dO, K and V with TMA; it writes dq, dk and dv and
// reads out with 16-byte (preprocess) and 4-byte stores and loads, which the
// host's checks already allow. It reads a boolean attn_mask, not an additive
// one (the registry's additive_masks; sm80's backward serves those), and a
// packed batch (a grid over the longest sequence's key tiles).
bool can_run_bwd(const AttnBwdParams& p) {
  // A packed batch's key tiles (64 keys at the fewest) are a grid's x dimension.
  if (per_batch_lengths(p) && (!packed(p) || tile_list_capacity(p, 64, TileAxis::kKeys) > INT_MAX)) return false;
  return layout_ok(p) && aligned(p.dout) && p.mask.mode != MaskMode::kAdditive &&
         strides_ok(p, p.do_batch_stride, p.do_head_stride, p.do_row_stride, p.heads_q, p.len_q);
}

// The accumulators, then attn_mask's tile summary for the backward's tiles,
// or a packed batch's list of key tiles (launch.h bwd_list_offset).
size_t bwd_workspace_bytes(const AttnBwdParams& params) {
  if (packed(params) && !params.deterministic) {
    const int keys = smallest_side(&tile_bwd, &TileShape::keys, params.head_dim);
    if (keys > 0) return bwd_list_offset(params) + tile_list_bytes(params, keys, TileAxis::kKeys);
  }
  size_t bytes = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const TileShape tile = tile_bwd(dtype, params.head_dim);
    if (tile.rows > 0) bytes = std::max(bytes, mask::summary_bytes(params, tile.rows, tile.keys));
  }
  return bwd_workspace_size(params) + bytes;
}

cudaError_t run_bwd(const AttnBwdParams& params, DType dtype, cudaStream_t stream) {
  cudaError_t err = cudaErrorNotSupported;
  visit_bwd(dtype, params.head_dim, [&](auto element, auto head_dim) {
    err = launch_bwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
  return err;
}

}  // namespace sm90
}  // namespace tfb
