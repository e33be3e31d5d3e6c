// Placeholder: replaced by the sm80 forward kernel.
#pragma once
#include <cutlass/numeric_types.h>
#include "sm80/launch.h"
namespace tfb::sm80 {
template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams&, cudaStream_t) { return cudaErrorNotSupported; }
}  // namespace tfb::sm80
