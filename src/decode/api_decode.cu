// The decode family's entry points: the split-KV forward for short queries.
#include <string_view>

#include "api.h"
#include "decode/launch.h"
#include "dispatch.h"
#include "kernel_info.h"
#include "kernel_list.h"

namespace tfb {
namespace decode {

bool has_fwd(DType dtype, int head_dim) {
  return visit_instantiation<TFB_DECODE_FWD_HEAD_DIMS>(dtype, head_dim, [](auto, auto) {});
}
bool can_run_fwd(const AttnFwdParams& params) { return fits(params); }
size_t fwd_workspace_bytes(const AttnFwdParams& params) { return workspace_bytes(params); }
// Q and each warp's ring of K and V tiles (decode/config.h).
size_t smem_bytes_fwd(DType, int head_dim) { return smem_bytes(head_dim); }
TileShape tile_fwd(DType dtype, int head_dim) {
  TileShape tile;
  visit_instantiation<TFB_DECODE_FWD_HEAD_DIMS>(dtype, head_dim, [&](auto element, auto d) {
    tile = fwd_tile<decltype(element), decltype(d)::value>();
  });
  return tile;
}

cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream) {
  return launch_instantiation<TFB_DECODE_FWD_HEAD_DIMS>(dtype, params.head_dim, [&](auto element, auto head_dim) {
    return launch_fwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
}

// The row cap the router reads (src/registry.py's max_rows) is the kernel's.
#define TFB_CHECK_MAX_ROWS(family, min_cc, max_cc, stride0_ok, align_bytes, max_rows, masks, additive_masks, \
                           windows, seqlens, pads, dropout, passes, head_dims)                                  \
  static_assert(std::string_view(#family) != "decode" || max_rows == kMaxRows,                           \
                "src/registry.py's max_rows for decode must equal decode/config.h's kMaxRows");
TFB_KERNEL_FAMILIES(TFB_CHECK_MAX_ROWS)
#undef TFB_CHECK_MAX_ROWS

}  // namespace decode
}  // namespace tfb
