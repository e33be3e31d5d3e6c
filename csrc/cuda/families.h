// Which kernel family runs a CUDA call: the one place the ops choose.
#pragma once

#include <string_view>

#include <ATen/core/Tensor.h>

#include "checks.h"
#include "device.h"
#include "params.h"

namespace tfb {

// TFB_KERNEL_FAMILIES (comma-separated names, e.g. "sm80"; unset or naming
// none: all) limits the families these ops launch, as it limits the Python
// router. Read on every call: a process may change it between calls.
bool family_allowed(std::string_view family);

enum class Family { kSm80, kSm90 };

// The forward's family for these params on this device; raises naming the
// reason when none can run them.
Family forward_family(const DeviceInfo& info, DType dtype, const AttnFwdParams& p, const at::Tensor& q,
                      const AttnShape& s);

// The backward is sm80's on every chip; raises when it cannot run.
void check_backward(DType dtype, const at::Tensor& q, const AttnShape& s);

}  // namespace tfb
