// Host side of the sm90 forward.
#pragma once

#include "sm90/launch.h"

namespace tfb {
namespace sm90 {

template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams&, cudaStream_t) {
  return cudaErrorNotSupported;
}

}  // namespace sm90
}  // namespace tfb
