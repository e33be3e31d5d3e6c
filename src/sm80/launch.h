// Declarations of the sm80 family's launchers. Their bodies live in
// launch_fwd.h / launch_bwd.h and are instantiated once per (dtype, head dim)
// in instantiations/*.cu, so this header stays cheap to include.
#pragma once

#include <cstddef>
#include <cuda_runtime_api.h>

#include "params.h"

namespace tfb {
namespace sm80 {

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream);

template <typename Element, int kHeadDim>
cudaError_t launch_bwd(const AttnBwdParams& params, cudaStream_t stream);

// Scratch for the backward (accumulators, row statistics); independent of dtype.
size_t bwd_workspace_bytes_impl(const AttnBwdParams& params);

}  // namespace sm80
}  // namespace tfb
