// Host-side size of the backward's scratch; the layout is in workspace_bwd.h.
#include "sm80/launch.h"
#include "common/workspace_bwd.h"

namespace tfb::sm80 {

size_t bwd_workspace_bytes_impl(const AttnBwdParams& params) { return bwd_workspace_size(params); }

}  // namespace tfb::sm80
