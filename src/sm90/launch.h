// Declarations of the sm90 family's launchers. Bodies live in launch_<pass>.h and
// are instantiated once per (dtype, head dim) in instantiations/*.cu, which are
// the only files compiled for sm_90a.
#pragma once

#include <cuda_runtime_api.h>

#include "params.h"

namespace tfb {
namespace sm90 {

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
cudaError_t launch_bwd(const AttnBwdParams& params, cudaStream_t stream);

}  // namespace sm90
}  // namespace tfb
