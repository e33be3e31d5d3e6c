// Declarations of the sm80 family's launchers. Their bodies live in
// launch_fwd.h / launch_bwd.h and are instantiated once per (dtype, head dim)
// in instantiations/*.cu, so this header stays cheap to include.
#pragma once

#include <cstddef>
#include <cuda_runtime_api.h>

#include "kernel_info.h"
#include "params.h"

namespace tfb {
namespace sm80 {

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream);

template <typename Element, int kHeadDim>
cudaError_t launch_bwd(const AttnBwdParams& params, cudaStream_t stream);

// The tile a pass reads attn_mask in (kernel_info.h), instantiated beside its launcher.
template <typename Element, int kHeadDim>
TileShape fwd_tile();
template <typename Element, int kHeadDim>
TileShape bwd_tile();  // the configuration for 227 KB a block (H100, H200)

// Scratch for the backward (accumulators, row statistics); independent of dtype.
size_t bwd_workspace_bytes_impl(const AttnBwdParams& params);

}  // namespace sm80
}  // namespace tfb
