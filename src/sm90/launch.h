// Declarations of the sm90 family's launchers. Bodies live in launch_<pass>.h and
// are instantiated once per (dtype, head dim) in instantiations/*.cu, which are
// the only files compiled for sm_90a.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "common/workspace_bwd.h"
#include "kernel_info.h"
#include "params.h"

namespace tfb {
namespace sm90 {

// A masked forward's workspace: the mask's summary, then the counter of its
// dynamic scheduler (tile_scheduler.h), zeroed by the mask pre-pass.
constexpr size_t kUnitCounterBytes = 16;

// A packed backward's workspace: the accumulators (common/workspace_bwd.h),
// then, but in the deterministic mode, its key tiles' list from here.
inline size_t bwd_list_offset(const AttnBwdParams& p) { return (bwd_workspace_size(p) + 15) / 16 * 16; }

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
cudaError_t launch_bwd(const AttnBwdParams& params, cudaStream_t stream);

// The tile a pass reads attn_mask in (kernel_info.h; {0, 0}: it reads none),
// instantiated beside its launcher: the traits compile for sm_90a alone.
template <typename Element, int kHeadDim>
TileShape fwd_tile();
template <typename Element, int kHeadDim>
TileShape bwd_tile();

}  // namespace sm90
}  // namespace tfb
